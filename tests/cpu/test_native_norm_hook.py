"""``mlx_loom.nn.rms_norm``: MLX's ``mx.fast.rms_norm`` outside a native forward, the
swapped norm modules' native node inside one (Gemma 4's router and value norms,
Qwen3-Next's q/k normalisation and gated norm call it; whole models keep
mlx-lm's greedy tokens: tests/cpu/test_model_parity.py)."""

from __future__ import annotations

import re

import mlx.core as mx
import pytest

from mlx_loom.cpu import native
from mlx_loom.cpu.ops import MAX_NORM_WIDTH, forward_kernels
from mlx_loom.nn import rms_norm

nat = native.module()


def labels(out: mx.array, tmp_path) -> list[str]:
    path = tmp_path / "graph.dot"
    mx.export_to_dot(str(path), out)
    return re.findall(r'label ="([A-Za-z_0-9]+)', path.read_text())


@pytest.mark.parametrize("with_weight", [True, False])
def test_the_norm_is_mlxs_outside_a_native_forward_and_the_native_node_inside(
    with_weight, tmp_path
):
    x = mx.random.normal((2, 3, 64), key=mx.random.key(0))
    w = mx.random.normal((64,), key=mx.random.key(1)) if with_weight else None
    assert mx.array_equal(rms_norm(x, w, 1e-6), mx.fast.rms_norm(x, w, 1e-6))
    with forward_kernels("cpu-ops"):
        assert mx.array_equal(rms_norm(x, w, 1e-6), mx.fast.rms_norm(x, w, 1e-6))
    with forward_kernels("cpu-native"):
        inside = rms_norm(x, w, 1e-6)
    assert "LoomRMSNorm" in labels(inside, tmp_path)
    assert mx.array_equal(inside, nat.rms_norm(x, w, 1e-6))
    assert mx.allclose(inside, mx.fast.rms_norm(x, w, 1e-6), rtol=1e-5, atol=1e-6)


def test_rows_past_the_kernels_width_stay_on_mlx(tmp_path):
    x = mx.ones((1, MAX_NORM_WIDTH + 1))
    with forward_kernels("cpu-native"):
        out = rms_norm(x, None, 1e-6)
    assert "LoomRMSNorm" not in labels(out, tmp_path)
    assert mx.array_equal(out, mx.fast.rms_norm(x, None, 1e-6))
