"""The native GeGLU gate (``gelu_mul``) and the GeGLU MLP and expert layers built on it.

MLX's CPU backend evaluates ``gelu_approx(gate) * up`` one element at a time
through the C library's ``powf`` and ``tanhf``; the native gate computes the
tanh from one vectorised exp, so it is not bit-equal to MLX. Its claim is a
bound, ``|ours - mlx| <= 2**-21 * |gate * up|``, with NaN and infinities where
MLX has them, checked over a dense sweep of gates and the special values.
Around it, bit for bit: the GeGLU MLP as a gated node and its down product
equals its three native products and the native gate; the GeGLU expert layer as one node equals each
expert's native products and the native gate; the hook gives the native gate
only in a native float32 forward. Whole Gemma models keep mlx-lm's greedy
tokens on the native sets (tests/cpu/test_model_parity.py,
tests/cpu/test_native_experts.py).
"""

from __future__ import annotations

import re
from functools import partial

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_loom.cpu import experts as expert_swaps
from mlx_loom.cpu import layers, native, ops
from mlx_loom.cpu.ops import forward_kernels
from mlx_loom.nn import GatedMLP, SwitchGLU, gather_switch_glu, gelu_approx_mul, geglu

nat = native.module()
BOUND = 2.0**-21


def rand(shape, dtype=mx.float32, seed=0, scale=1.0) -> mx.array:
    return (scale * mx.random.normal(shape, key=mx.random.key(seed))).astype(dtype)


def labels(out: mx.array, tmp_path) -> list[str]:
    path = tmp_path / "graph.dot"
    mx.export_to_dot(str(path), out)
    return re.findall(r'label ="([A-Za-z_0-9]+)', path.read_text())


@partial(mx.compile, shapeless=True)
def mlx_geglu(gate: mx.array, up: mx.array) -> mx.array:
    """What mlx-lm runs (and the cpu-ops set): MLX's compiled GeGLU."""
    return nn.gelu_approx(gate) * up


def sweep() -> np.ndarray:
    """Gates where tanh's shape changes (dense over [-12, 12]: the saturation on
    both sides), magnitudes from 1e-30 to past the cube's overflow, and the
    special values."""
    dense = np.linspace(-12, 12, 400_001, dtype=np.float32)
    mags = np.logspace(-30, 14, 40_001).astype(np.float32)
    special = np.array(
        [0.0, -0.0, 1e-45, -1e-45, 3.4e38, -3.4e38, np.inf, -np.inf, np.nan], np.float32
    )
    return np.concatenate([dense, mags, -mags, special])


def test_gelu_mul_is_within_its_bound_of_mlx_with_nan_and_infinities_alike():
    g = sweep()
    u = np.random.default_rng(0).standard_normal(g.shape).astype(np.float32) * 3
    u[-9:] = 1.5  # the specials against a plain multiplier
    ours = np.asarray(nat.gelu_mul(mx.array(g), mx.array(u)))
    theirs = np.asarray(mlx_geglu(mx.array(g), mx.array(u)))
    assert np.array_equal(np.isnan(ours), np.isnan(theirs))
    inf = np.isinf(theirs)
    assert np.array_equal(np.isinf(ours), inf) and np.array_equal(ours[inf], theirs[inf])
    finite = ~np.isnan(theirs) & ~inf
    err = np.abs(ours[finite].astype(np.float64) - theirs[finite])
    scale = np.abs(g[finite].astype(np.float64) * u[finite])
    assert np.all(err <= BOUND * scale)
    # Not a vacuous bound: the two differ somewhere, and MLX's tanh saturates
    # (the product is exactly 0 far below zero) where ours does.
    assert np.any(err > 0)
    far = finite & (g < -12)
    assert np.array_equal(ours[far], theirs[far])


@pytest.mark.parametrize("n", [1, 7, 8, 9, 5000, 40_000])  # tails, one block, the pool
def test_gelu_mul_gives_every_element_alike_whatever_the_length(n):
    g, u = rand((n,), seed=1, scale=3.0), rand((n,), seed=2)
    whole = nat.gelu_mul(g, u)
    assert mx.array_equal(whole[: min(n, 5)], nat.gelu_mul(g[:5], u[:5])[: min(n, 5)])
    # A strided view gives what its contiguous copy gives.
    g2, u2 = rand((n, 2), seed=3), rand((n, 2), seed=4)
    copies = mx.array(g2[:, 0]), mx.array(u2[:, 0])
    assert mx.array_equal(nat.gelu_mul(g2[:, 0], u2[:, 0]), nat.gelu_mul(*copies))


@pytest.mark.parametrize(
    "gate,up,match",
    [
        (mx.zeros((4,), mx.bfloat16), mx.zeros((4,), mx.bfloat16), "float32"),
        (mx.zeros((4,)), mx.zeros((5,)), "one shape"),
    ],
)
def test_gelu_mul_refuses_what_it_does_not_take(gate, up, match):
    with pytest.raises(ValueError, match=match):
        nat.gelu_mul(gate, up)


def test_geglu_takes_the_native_gate_only_in_a_native_float32_forward(tmp_path):
    gate, up = rand((2, 300), seed=5, scale=3.0), rand((2, 300), seed=6)
    assert mx.array_equal(geglu(gate, up), mlx_geglu(gate, up))
    assert "LoomGeluMul" not in labels(geglu(gate, up), tmp_path)
    with forward_kernels("cpu-native"):
        inside = geglu(gate, up)
        half = geglu(gate.astype(mx.bfloat16), up.astype(mx.bfloat16))
    assert "LoomGeluMul" in labels(inside, tmp_path)
    assert mx.array_equal(inside, nat.gelu_mul(gate, up))
    assert mx.array_equal(half, mlx_geglu(gate.astype(mx.bfloat16), up.astype(mx.bfloat16)))
    with forward_kernels("cpu-ops"):
        assert mx.array_equal(geglu(gate, up), mlx_geglu(gate, up))


def test_the_unfused_gelu_product_is_mlx_lms_two_operations_outside_a_native_forward():
    # Gemma 4's per-layer input gate: in bfloat16 the activation is rounded
    # before the product, as mlx-lm's two calls do.
    gate, up = rand((3, 128), mx.bfloat16, seed=7, scale=3.0), rand((3, 128), mx.bfloat16, seed=8)
    assert mx.array_equal(gelu_approx_mul(gate, up), mx.multiply(nn.gelu_approx(gate), up))
    g32, u32 = gate.astype(mx.float32), up.astype(mx.float32)
    with forward_kernels("cpu-native"):
        assert mx.array_equal(gelu_approx_mul(g32, u32), nat.gelu_mul(g32, u32))


# --- the GeGLU MLP --------------------------------------------------------------


def native_mlp(bits: int, int8: bool, bias: bool = False) -> GatedMLP:
    mlp = GatedMLP(64, 96, activation=geglu, bias=bias)
    mx.eval(mlp.parameters())
    if bits:
        nn.quantize(mlp, group_size=32, bits=bits)
    for _, mod in mlp.named_modules():
        if layers.swappable(mod):
            layers.swap_in(mod, mx.float32, int8_activations=int8)
    return mlp


@pytest.mark.parametrize("bits,int8", [(4, False), (4, True), (8, False), (0, False)])
@pytest.mark.parametrize("rows", [1, 40])
def test_the_geglu_mlp_is_a_gated_node_and_down_equal_to_its_products_and_the_native_gate(
    bits, int8, rows, tmp_path
):
    mlp = native_mlp(bits, int8)
    assert type(mlp) is ops.NativeGatedMLP
    x = rand((1, rows, 64), seed=9)
    # Outside a native forward the native gate is not provided: MLX's.
    assert mx.array_equal(mlp(x), GatedMLP.__call__(mlp, x))
    assert not any(label.startswith("LoomGated") for label in labels(mlp(x), tmp_path))
    with forward_kernels("cpu-native"):
        got = mlp(x)
    found = labels(got, tmp_path)
    kind = "Dense" if bits == 0 else "Affine"
    assert f"LoomGated{kind}MatmulGelu" in "".join(found)
    # Gate, up and the gate activation are one node, down the next: no view
    # nodes around them, no separate gate.
    assert sum("Matmul" in label for label in found) == 2
    assert "LoomGeluMul" not in found and "ExpandDims" not in found
    want = mlp.down_proj(nat.gelu_mul(mlp.gate_proj(x), mlp.up_proj(x)))
    assert got.shape == want.shape and mx.array_equal(got, want)


@pytest.mark.parametrize("bits", [0, 4])
def test_the_gated_product_takes_silu_unless_told_gelu(bits):
    mlp = native_mlp(bits, False)
    x = rand((3, 64), seed=12)
    g, u = mlp.gate_proj, mlp.up_proj
    if bits:
        args = (g["weight"], g["scales"], g["biases"], u["weight"], u["scales"], u["biases"], bits, 32)
        silu, gelu = nat.gated_affine_matmul(x, *args), nat.gated_affine_matmul(x, *args, gelu=True)
    else:
        silu = nat.gated_dense_matmul(x, g["weight"], u["weight"])
        gelu = nat.gated_dense_matmul(x, g["weight"], u["weight"], gelu=True)
    assert mx.array_equal(silu, nat.silu_mul(g(x), u(x)))
    assert mx.array_equal(gelu, nat.gelu_mul(g(x), u(x)))
    assert not mx.array_equal(silu, gelu)


def test_the_geglu_mlp_runs_its_own_forward_where_the_node_does_not_fit(tmp_path):
    mlp = native_mlp(4, False, bias=True)
    x = rand((1, 2, 64), seed=10)
    with forward_kernels("cpu-native"):
        got = mlp(x)
        want = GatedMLP.__call__(mlp, x)
    assert not any(label.startswith("LoomGated") for label in labels(got, tmp_path))
    assert mx.array_equal(got, want)


# --- the GeGLU expert layer ---------------------------------------------------------

E, K, H = 6, 128, 64


def native_glu(bits: int, int8: bool) -> SwitchGLU:
    layer = SwitchGLU(K, H, E, kernel=gather_switch_glu, activation=geglu)
    for i, name in enumerate(("gate_proj", "up_proj", "down_proj")):
        proj = getattr(layer, name)
        proj.weight = (rand(proj.weight.shape, seed=i) * 0.2).astype(mx.bfloat16)
        if bits:
            q = proj.to_quantized(group_size=64, bits=bits)
            q.scales, q.biases = q.scales.astype(mx.bfloat16), q.biases.astype(mx.bfloat16)
            setattr(layer, name, q)
    for _, mod in layer.named_modules():
        if type(mod) is SwitchGLU or type(mod) in expert_swaps.SWAPS:
            layers.swap_in(mod, mx.float32, int8_activations=int8)
    return layer


@pytest.mark.parametrize("T", [1, 40])
@pytest.mark.parametrize("bits,int8", [(0, False), (4, False), (4, True)])
def test_the_geglu_expert_layer_is_one_node_equal_to_each_experts_products(bits, int8, T, tmp_path):
    layer = native_glu(bits, int8)
    gate, up, down = layer.gate_proj, layer.up_proj, layer.down_proj
    x = rand((1, T, K), seed=11)
    rng = np.random.default_rng(12)
    idx = np.stack([rng.permutation(E)[:2] for _ in range(T)]).astype(np.uint32)
    y = layer(x, mx.array(idx).reshape(1, T, 2))
    assert y.shape == (1, T, 2, K)
    assert sum(label.startswith("LoomExperts") for label in labels(y, tmp_path)) == 1

    def product(proj, rows, e):
        if bits:
            return nat.affine_matmul(
                rows, proj.weight[e], proj.scales[e], proj.biases[e], bits, 64, None, int8
            )
        return nat.dense_matmul(rows, proj.weight[e])

    rows = x.reshape(T, K)
    want = np.zeros((T, 2, K), np.float32)
    for e in np.unique(idx):
        pairs = np.argwhere(idx == e)  # (token, slot), in pair order
        xr = rows[mx.array(pairs[:, 0].astype(np.int32))]
        h = nat.gelu_mul(product(gate, xr, int(e)), product(up, xr, int(e)))
        out = np.asarray(product(down, h, int(e)))
        for i, (t, s) in enumerate(pairs):
            want[t, s] = out[i]
    assert np.array_equal(np.asarray(y).reshape(T, 2, K), want)
