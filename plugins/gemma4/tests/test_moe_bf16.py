"""bf16 MoE on the CPU: mlx-lm cannot run it; we run it through our ``gemma4.switch_glu`` kernel.

Reference for parity: mlx-lm's own bf16 graph in which each expert projection
upcasts its input and weights to fp32 for ``gather_mm`` and rounds the result
back to bf16 (a test-only patch). Our CPU kernel does bf16 matmuls per expert
group; MLX's CPU bf16 matmul accumulates in fp32 and rounds once, so the two
agree bit for bit (measured; asserted below over 64 greedy steps).
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models import switch_layers

from mlx_loom.nn import geglu, grouped_switch_glu, switch_glu


def _fp32_upcast_switch_linear(self, x, indices, sorted_indices=False):
    w = self["weight"].astype(mx.float32).swapaxes(-1, -2)
    y = mx.gather_mm(x.astype(mx.float32), w, rhs_indices=indices, sorted_indices=sorted_indices)
    return y.astype(x.dtype)


def test_mlx_lm_fails_on_bf16_moe_on_the_cpu(kit, checkpoint):
    """The limitation this kernel exists for (MLX 0.32: gather_mm is fp32-only on the CPU)."""
    theirs = kit.load_theirs(checkpoint(dtype=mx.bfloat16, **kit.MOE))
    with pytest.raises(RuntimeError, match="GatherMM"):
        mx.eval(theirs(kit.prompt_of(4)))


def test_bf16_moe_generates_on_the_cpu_equal_to_fp32_upcast_expert_reference(
    kit, checkpoint, monkeypatch
):
    path = checkpoint(dtype=mx.bfloat16, **kit.MOE, **kit.PER_LAYER, **kit.SHARED)
    ours = kit.load_ours(path)
    monkeypatch.setattr(switch_layers.SwitchLinear, "__call__", _fp32_upcast_switch_linear)
    theirs = kit.load_theirs(path)
    assert ours(kit.prompt_of(4)).dtype == mx.bfloat16
    tokens = kit.greedy_compare(
        ours,
        theirs,
        kit.prompt_of(20),
        ours.make_cache(),
        theirs.make_cache(),
        steps=64,
        chunks=(13, 7),
    )
    assert len(tokens[0]) == 64


def test_cpu_kernel_routes_bf16_experts_to_grouped_matmuls(kit, checkpoint):
    experts = kit.load_ours(checkpoint(dtype=mx.bfloat16, **kit.MOE)).model.layers[0].experts
    glu = experts.switch_glu
    x = mx.random.normal((2, 5, 64), key=mx.random.key(0)).astype(mx.bfloat16)
    idx = mx.random.randint(0, 4, (2, 5, 2), key=mx.random.key(1)).astype(mx.int32)
    via_kernel = switch_glu(x, idx, glu.gate_proj, glu.up_proj, glu.down_proj, geglu)
    grouped = grouped_switch_glu(x, idx, glu.gate_proj, glu.up_proj, glu.down_proj, geglu)
    assert via_kernel.shape == (2, 5, 2, 64) and via_kernel.dtype == mx.bfloat16
    assert mx.array_equal(via_kernel, grouped)


def test_grouped_kernel_agrees_with_fp32_gathered_experts_within_bf16_rounding(kit, checkpoint):
    """Kernel alone vs an all-fp32 computation on the same bf16 values.

    Tolerance: gate, up, the GeGLU product and the output are each rounded to
    bf16 (relative step 2**-8); three chained roundings on |y| <= ~4 stay below
    0.05 absolute (measured max 0.018).
    """
    glu = kit.load_ours(checkpoint(dtype=mx.bfloat16, **kit.MOE)).model.layers[0].experts.switch_glu
    x = mx.random.normal((1, 20, 64), key=mx.random.key(2)).astype(mx.bfloat16)
    idx = mx.random.randint(0, 4, (1, 20, 2), key=mx.random.key(3)).astype(mx.int32)
    got = grouped_switch_glu(x, idx, glu.gate_proj, glu.up_proj, glu.down_proj, geglu)
    xf = x.astype(mx.float32)
    ref = []
    for t in range(20):
        row = []
        for j in range(2):
            e = int(idx[0, t, j])
            g = xf[0, t] @ glu.gate_proj.weight[e].astype(mx.float32).T
            u = xf[0, t] @ glu.up_proj.weight[e].astype(mx.float32).T
            gelu_tanh = 0.5 * g * (1 + mx.tanh(0.7978845608 * (g + 0.044715 * g**3)))
            h = gelu_tanh * u
            row.append(h @ glu.down_proj.weight[e].astype(mx.float32).T)
        ref.append(mx.stack(row))
    ref = mx.stack(ref)[None]
    assert mx.allclose(got.astype(mx.float32), ref, atol=0.05, rtol=0).item()
