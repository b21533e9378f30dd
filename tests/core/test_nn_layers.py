"""mlx_loom.nn: gated MLPs and routed experts, against mlx-lm's layers bit for bit.

The one bf16-on-CPU expert strategy (grouped per expert on the host) must
produce exactly what a bf16 ``gather_mm`` would: the fp32 product of the
bf16 operands rounded once to bf16 (the fp32-upcast reference below).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import switch_layers
from mlx_lm.models.gemma4_text import GeGLU
from mlx_lm.models.qwen3_next import Qwen3NextMLP

from mlx_loom.backends import KernelRegistry
from mlx_loom.nn import (
    GatedMLP,
    QuantizedSwitchLinear,
    SwitchGLU,
    SwitchLinear,
    expert_kernels,
    gather_switch_glu,
    geglu,
    grouped_switch_glu,
    swiglu,
    switch_glu,
)

E, D, H, K = 8, 64, 32, 2


def _weights(dtype=mx.float32, seed=0):
    keys = mx.random.split(mx.random.key(seed), 3)
    return [
        (mx.random.normal(shape, key=k) * 0.2).astype(dtype)
        for k, shape in zip(keys, [(E, H, D), (E, H, D), (E, D, H)], strict=True)
    ]


def _ours(dtype=mx.float32, activation=swiglu, kernel=switch_glu):
    glu = SwitchGLU(D, H, E, kernel=kernel, activation=activation)
    glu.gate_proj.weight, glu.up_proj.weight, glu.down_proj.weight = _weights(dtype)
    return glu


def _theirs(dtype=mx.float32, activation=None):
    kwargs = {} if activation is None else {"activation": activation}
    glu = switch_layers.SwitchGLU(D, H, E, **kwargs)
    glu.gate_proj.weight, glu.up_proj.weight, glu.down_proj.weight = _weights(dtype)
    return glu


def _route(tokens: int, seed: int = 1):
    x = mx.random.normal((1, tokens, D), key=mx.random.key(seed))
    idx = mx.random.randint(0, E, (1, tokens, K), key=mx.random.key(seed + 1)).astype(mx.uint32)
    return x, idx


@pytest.mark.parametrize("tokens", [1, 40], ids=["unsorted", "sorted"])  # 80 pairs >= 64 sort
@pytest.mark.parametrize("act", ["swiglu", "geglu"])
def test_fp32_experts_are_mlx_lms_switch_glu_bit_for_bit(tokens, act):
    activation, theirs_act = (swiglu, None) if act == "swiglu" else (geglu, GeGLU())
    x, idx = _route(tokens)
    assert mx.array_equal(
        _ours(activation=activation)(x, idx), _theirs(activation=theirs_act)(x, idx)
    )


def test_quantized_experts_are_mlx_lms_bit_for_bit_in_bf16():
    ours, theirs = _ours(), _theirs()
    ours.update_modules(
        {n: getattr(ours, n).to_quantized(32, 4) for n in ("gate_proj", "up_proj", "down_proj")}
    )
    theirs.update_modules(
        {n: getattr(theirs, n).to_quantized(32, 4) for n in ("gate_proj", "up_proj", "down_proj")}
    )
    assert isinstance(ours.gate_proj, QuantizedSwitchLinear)
    x, idx = _route(40)
    x = x.astype(mx.bfloat16)
    assert mx.array_equal(ours(x, idx), theirs(x, idx))


def _fp32_upcast_reference(x, idx, gate, up, down, activation):
    """A bf16 gather_mm's arithmetic: fp32 products of bf16 operands, rounded once."""

    def project(layer, h, inds, sort):
        w = layer.weight.astype(mx.float32).swapaxes(-1, -2)
        y = mx.gather_mm(h.astype(mx.float32), w, rhs_indices=inds, sorted_indices=sort)
        return y.astype(h.dtype)

    class Up:
        is_quantized = False

        def __init__(self, layer):
            self.layer = layer

        def gather(self, h, inds, sort):
            return project(self.layer, h, inds, sort)

    return gather_switch_glu(x, idx, Up(gate), Up(up), Up(down), activation)


@pytest.mark.parametrize("tokens", [1, 3, 40], ids=["decode", "few", "prefill"])
@pytest.mark.parametrize("activation", [swiglu, geglu], ids=["swiglu", "geglu"])
def test_bf16_grouped_experts_equal_the_fp32_product_rounded_once(tokens, activation):
    glu = _ours(mx.bfloat16, activation)
    x, idx = _route(tokens)
    x = x.astype(mx.bfloat16)
    got = grouped_switch_glu(x, idx, glu.gate_proj, glu.up_proj, glu.down_proj, activation)
    want = _fp32_upcast_reference(x, idx, glu.gate_proj, glu.up_proj, glu.down_proj, activation)
    assert got.dtype == mx.bfloat16 and got.shape == (1, tokens, K, D)
    assert mx.array_equal(got, want)


def test_the_ops_kernel_routes_bf16_dense_experts_to_grouped_matmuls():
    glu = _ours(mx.bfloat16)
    x, idx = _route(5)
    x = x.astype(mx.bfloat16)
    parts = (glu.gate_proj, glu.up_proj, glu.down_proj, swiglu)
    assert mx.array_equal(switch_glu(x, idx, *parts), grouped_switch_glu(x, idx, *parts))


def test_mlx_lm_cannot_gather_bf16_experts_on_the_cpu():
    """The limitation the grouped strategy exists for (MLX 0.32, CPU)."""
    theirs = _theirs(mx.bfloat16)
    x, idx = _route(3)
    with pytest.raises(RuntimeError, match="only supports float32"):
        mx.eval(theirs(x.astype(mx.bfloat16), idx))


def test_grouped_experts_equal_each_row_alone():
    """Grouping mixes tokens of different rows in one matmul; no row may see another."""
    glu = _ours(mx.bfloat16)
    x, idx = _route(6)
    x = x.astype(mx.bfloat16)
    batch = glu(mx.concatenate([x, x[:, ::-1]], 0), mx.concatenate([idx, idx[:, ::-1]], 0))
    assert mx.array_equal(batch[:1], glu(x, idx))


def test_expert_kernels_are_registered_for_every_backend():
    registry = KernelRegistry(expert_kernels("family.switch_glu"))
    assert registry.backends_for("family.switch_glu") == ("metal", "cuda", "cpu")
    by_backend = {k.backend: k for k in registry}
    assert by_backend["cpu"].fn is by_backend["cuda"].fn is switch_glu
    assert by_backend["metal"].fn is gather_switch_glu
    assert registry.resolve("family.switch_glu").fn is switch_glu  # this CPU device


def test_switch_linear_quantizes_to_mlx_affine_packing():
    layer = SwitchLinear(64, 16, 4)
    q = layer.to_quantized(group_size=32, bits=4)
    assert q.weight.shape == (4, 16, 64 * 4 // 32) and q.weight.dtype == mx.uint32
    assert q.scales.shape == q.biases.shape == (4, 16, 2)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=str)
def test_gated_mlp_is_mlx_lms_swiglu_mlp_bit_for_bit(dtype):
    ours, theirs = GatedMLP(D, H), Qwen3NextMLP(D, H)
    ours.update(theirs.parameters())
    ours.set_dtype(dtype)
    theirs.set_dtype(dtype)
    x = mx.random.normal((2, 5, D), key=mx.random.key(3)).astype(dtype)
    assert mx.array_equal(ours(x), theirs(x))


def test_gated_mlp_with_geglu_gates_through_tanh_gelu():
    mlp = GatedMLP(D, H, activation=geglu)
    x = mx.random.normal((1, 3, D), key=mx.random.key(4))
    want = mlp.down_proj(nn.gelu_approx(mlp.gate_proj(x)) * mlp.up_proj(x))
    assert mx.allclose(mlp(x), want, atol=1e-6)


def _biased(glu, seed=7):
    """Give each projection of ``glu`` a per-expert bias (gpt-oss's experts carry one)."""
    keys = mx.random.split(mx.random.key(seed), 3)
    for key, name in zip(keys, ("gate_proj", "up_proj", "down_proj"), strict=True):
        layer = getattr(glu, name)
        rows = layer.weight.shape[1]
        layer.bias = (mx.random.normal((E, rows), key=key) * 0.2).astype(layer.weight.dtype)
    return glu


@pytest.mark.parametrize("tokens", [1, 40], ids=["unsorted", "sorted"])
def test_biased_fp32_experts_are_mlx_lms_bit_for_bit(tokens):
    ours = _biased(SwitchGLU(D, H, E, kernel=switch_glu, bias=True))
    ours.gate_proj.weight, ours.up_proj.weight, ours.down_proj.weight = _weights()
    theirs = _biased(switch_layers.SwitchGLU(D, H, E, bias=True))
    theirs.gate_proj.weight, theirs.up_proj.weight, theirs.down_proj.weight = _weights()
    x, idx = _route(tokens)
    assert mx.array_equal(ours(x, idx), theirs(x, idx))
    names = ("gate_proj", "up_proj", "down_proj")
    ours.update_modules({n: getattr(ours, n).to_quantized(32, 4) for n in names})
    theirs.update_modules({n: getattr(theirs, n).to_quantized(32, 4) for n in names})
    assert "bias" in ours.down_proj and isinstance(ours.down_proj, QuantizedSwitchLinear)
    assert mx.array_equal(ours(x, idx), theirs(x, idx))


def test_biased_bf16_grouped_experts_add_the_bias_after_the_rounded_product():
    glu = _biased(_ours(mx.bfloat16))
    x, idx = _route(5)
    x = x.astype(mx.bfloat16)
    parts = (glu.gate_proj, glu.up_proj, glu.down_proj, swiglu)
    got = grouped_switch_glu(x, idx, *parts)

    class Biased:
        is_quantized = False

        def __init__(self, layer):
            self.layer = layer

        def gather(self, h, inds, sort):
            w = self.layer.weight.astype(mx.float32).swapaxes(-1, -2)
            y = mx.gather_mm(h.astype(mx.float32), w, rhs_indices=inds, sorted_indices=sort)
            return y.astype(h.dtype) + mx.expand_dims(self.layer.bias[inds], -2)

    want = gather_switch_glu(x, idx, *(Biased(p) for p in parts[:3]), swiglu)
    assert mx.array_equal(got, want)
