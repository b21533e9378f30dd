"""The native logit soft cap (``softcap``): ``tanh(x / cap) * cap`` as one node.

MLX's CPU backend evaluates the tanh through the C library's ``tanhf``, one
element at a time (about half a millisecond a token over a 32,000-entry
vocabulary); the native node computes the native GeGLU gate's tanh eight
lanes at a time, so it is not bit-equal to MLX. Its claim is a bound,
``|ours - mlx| <= 2**-21 * cap``, with NaN and infinities where MLX has them,
over a dense sweep and the special values. :func:`mlx_loom.nn.softcap` takes
the native node only in a native float32 forward, and is mlx-lm's compiled
function everywhere else. A Gemma 4 model on the native sets keeps its
greedy tokens (tests/cpu/test_model_parity.py) and its logits carry the node.
"""

from __future__ import annotations

import re
from functools import partial

import mlx.core as mx
import numpy as np
import pytest

from mlx_loom.cpu import native
from mlx_loom.cpu.ops import forward_kernels
from mlx_loom.nn import softcap

nat = native.module()
BOUND = 2.0**-21


def labels(out: mx.array, tmp_path) -> list[str]:
    path = tmp_path / "graph.dot"
    mx.export_to_dot(str(path), out)
    return re.findall(r'label ="([A-Za-z_0-9]+)', path.read_text())


@partial(mx.compile, shapeless=True)
def mlx_softcap(cap: float, x: mx.array) -> mx.array:
    """What mlx-lm runs for Gemma's final logits."""
    return mx.tanh(x / cap) * cap


def sweep(cap: float) -> np.ndarray:
    """Dense over +-40 caps (tanh's whole shape and both saturations), magnitudes
    from 1e-30 to 1e6 caps, and the special values."""
    dense = np.linspace(-40 * cap, 40 * cap, 400_001).astype(np.float32)
    mags = (np.logspace(-30, 6, 20_001) * cap).astype(np.float32)
    special = np.array([0.0, -0.0, 1e-45, -1e-45, 3.4e38, -3.4e38, np.inf, -np.inf, np.nan])
    return np.concatenate([dense, mags, -mags, special.astype(np.float32)])


@pytest.mark.parametrize("cap", [0.3, 1.0, 13.0, 30.0, 50.0, 1234.5])
def test_softcap_is_within_its_bound_of_mlx_with_nan_and_infinities_alike(cap):
    x = sweep(cap)
    ours = np.asarray(nat.softcap(mx.array(x), cap))
    theirs = np.asarray(mlx_softcap(cap, mx.array(x)))
    assert np.array_equal(np.isnan(ours), np.isnan(theirs))
    finite = ~np.isnan(theirs)
    err = np.abs(ours[finite].astype(np.float64) - theirs[finite])
    assert err.max() <= BOUND * cap
    # Not a vacuous bound: the two differ somewhere; zeros and the
    # saturated ends (tanh exactly +-1) are the same bits.
    assert np.any(err > 0)
    same = finite & ((x == 0) | (np.abs(x) > 20 * cap))
    assert np.array_equal(ours[same], theirs[same])
    assert np.array_equal(np.signbit(ours[x == 0]), np.signbit(theirs[x == 0]))


@pytest.mark.parametrize("n", [1, 7, 8, 9, 5000, 40_000])  # tails, one block, the pool
def test_softcap_gives_every_element_alike_whatever_the_length(n):
    x = 40.0 * mx.random.normal((n,), key=mx.random.key(1))
    whole = nat.softcap(x, 30.0)
    k = min(n, 5)
    assert mx.array_equal(whole[:k], nat.softcap(x[:5], 30.0)[:k])
    assert mx.array_equal(whole[-k:], nat.softcap(mx.array(x[-k:]), 30.0))
    # A strided view gives what its contiguous copy gives.
    x2 = 40.0 * mx.random.normal((n, 2), key=mx.random.key(2))
    assert mx.array_equal(nat.softcap(x2[:, 0], 30.0), nat.softcap(mx.array(x2[:, 0]), 30.0))


@pytest.mark.parametrize(
    "x,cap,match",
    [
        (mx.zeros((4,), mx.bfloat16), 30.0, "float32"),
        (mx.zeros((4,)), 0.0, "above 0"),
        (mx.zeros((4,)), -2.0, "above 0"),
        (mx.zeros((4,)), float("inf"), "finite"),
        (mx.zeros((4,)), float("nan"), "finite"),
    ],
)
def test_softcap_refuses_what_it_does_not_take(x, cap, match):
    with pytest.raises(ValueError, match=match):
        nat.softcap(x, cap)


def test_softcap_takes_the_native_node_only_in_a_native_float32_forward(tmp_path):
    x = 40.0 * mx.random.normal((2, 3, 700), key=mx.random.key(3))
    assert mx.array_equal(softcap(x, 30.0), mlx_softcap(30.0, x))
    assert "LoomSoftcap" not in labels(softcap(x, 30.0), tmp_path)
    for kernel_set in ("cpu-native", "cpu-native-int8-act"):
        with forward_kernels(kernel_set):
            y = softcap(x, 30.0)
            assert "LoomSoftcap" in labels(y, tmp_path)
            assert mx.array_equal(y, nat.softcap(x, 30.0))
            # Half precision keeps MLX's own arithmetic (it rounds in that dtype).
            h = x.astype(mx.bfloat16)
            assert mx.array_equal(softcap(h, 30.0), mlx_softcap(30.0, h))
    with forward_kernels("cpu-ops"):
        assert mx.array_equal(softcap(x, 30.0), mlx_softcap(30.0, x))


@pytest.mark.parametrize("kernel_set", ["cpu-ops", "cpu-native", "cpu-native-int8-act"])
def test_a_gemma4_forward_caps_its_logits_on_the_native_node_only_on_the_native_sets(
    checkpoints, kernel_set, tmp_path
):
    from mlx_loom.host import resolve_model
    from mlx_loom.loader import build_model

    path = checkpoints("gemma4_text", "q4")
    model = build_model(resolve_model(path, compute_dtype="float32", cpu_kernels=kernel_set))
    cap = model.module.cfg.final_logit_softcapping
    assert cap  # the tiny config caps its logits
    logits = model(mx.array([[1, 5, 7, 42]]), cache=model.make_cache())
    found = labels(logits, tmp_path)
    assert ("LoomSoftcap" in found) == (kernel_set != "cpu-ops")
    assert ("Tanh" in " ".join(found)) == (kernel_set == "cpu-ops")
    assert float(mx.max(mx.abs(logits)).item()) <= cap
