"""Native RoPE positions: refused when out of range, never read uninitialised memory.

Before: the kernel marked "no angles computed yet" with the position -1, so a
row at position -1 rotated by whatever the stack held; ``offset + l`` was
int32 arithmetic that could overflow. Offsets that hold data are now checked
where the node is built (a ``ValueError`` naming the offset); a computed
offset, unknown then, still rotates by its own angle (as ``mx.fast.rope``
does). Each case runs in a child process: a regression reads wild memory.
"""

from __future__ import annotations

import pytest

from mlx_loom.cpu import native

from .bounded import run_bounded

pytestmark = pytest.mark.skipif(
    native.unavailable_reason() is not None, reason="native kernels unavailable"
)

_SETUP = """
import mlx.core as mx
from mlx_loom.cpu import native, ops
nat = native.module()
x = mx.random.normal((1, 2, 3, 8), key=mx.random.key(0))
inv = 1.0 / (10000.0 ** (mx.arange(0, 8, 2, dtype=mx.float32) / 8))
"""


@pytest.mark.parametrize(
    "offset, needle",
    [(-1, "offset -1 with 3"), (2**31 - 2, "offset 2147483646 with 3"), (-(2**31), "offset -2")],
)
def test_out_of_range_offsets_are_refused_at_the_binding(offset, needle):
    outcome = run_bounded(
        _SETUP + f"nat.rope(x, 8, False, inv, 1.0, mx.array([{offset}], dtype=mx.int32))",
        timeout_s=30,
    )
    outcome.expect_error("ValueError", needle, "positions must lie in 0..2147483647")


@pytest.mark.parametrize("offset", [-1, 2**31 - 2, 2**31, 2**40])
def test_the_rope_module_refuses_python_offsets_out_of_range(offset):
    outcome = run_bounded(
        _SETUP
        + f"""
import mlx.nn as nn
rope = ops.NativeRoPE(8)
rope.prepare()
rope(x, offset={offset})
""",
        timeout_s=30,
    )
    outcome.expect_error("ValueError", f"offset {offset} with 3", "out of range")


def test_a_computed_position_of_minus_one_rotates_by_its_own_angle():
    """Lazily computed offsets are only known when the node runs: the kernel
    must then still read angles it computed (mx.fast.rope's rotation)."""
    outcome = run_bounded(
        _SETUP
        + """
offsets = mx.array([3], dtype=mx.int32) - 4          # -1, not yet evaluated
ours = nat.rope(x, 8, False, inv, 1.0, offsets)
theirs = mx.fast.rope(x, 8, traditional=False, base=10000.0, scale=1.0, offset=-1)
RESULT = mx.abs(ours - theirs).max().item()
""",
        timeout_s=30,
    )
    assert outcome.expect_ok() < 1e-5


def test_offsets_in_range_still_run():
    outcome = run_bounded(
        _SETUP + "RESULT = nat.rope(x, 8, False, inv, 1.0, mx.array([2**31 - 3], mx.int32)).shape",
        timeout_s=30,
    )
    assert outcome.expect_ok() == [1, 2, 3, 8]
