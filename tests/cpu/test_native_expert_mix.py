"""The routed experts' weighted sum (``mix_experts``) and its native node.

Every mixture-of-experts family weighs the k chosen experts' outputs by the
router and sums them: ``(y * w[..., None]).sum(axis=-2)``, five MLX nodes a
layer (expand, broadcast, multiply, sum, squeeze). On the native sets float32
operands are one node, ``LoomExpertMix``, with MLX's arithmetic: each product
rounded, then summed from the first expert up. Tested bit for bit against
MLX's evaluation (specials included), and per MoE family: the model's
logits with the node equal the logits with MLX's five nodes. A shared expert
gated per token (Qwen3-Next) is one more term of the same node, added last:
inside a compiled step MLX would otherwise fuse its gate's sigmoid into the
broadcast product and evaluate it once per output element.
"""

from __future__ import annotations

import re

import mlx.core as mx
import numpy as np
import pytest

from mlx_loom.cpu import native
from mlx_loom.cpu.ops import forward_kernels
from mlx_loom.nn import experts, mix_experts

from .test_model_parity import PROMPT, ours

nat = native.module()


def labels(out: mx.array, tmp_path) -> list[str]:
    path = tmp_path / "graph.dot"
    mx.export_to_dot(str(path), out)
    return re.findall(r'label ="([A-Za-z_0-9]+)', path.read_text())


def mlx_mix(y: mx.array, w: mx.array) -> mx.array:
    return (y * w[..., None]).sum(axis=-2)


@pytest.mark.parametrize(
    "shape", [(1, 1, 4, 1024), (3, 5, 8, 384), (1, 7, 2, 100), (2, 1, 1, 9), (6, 3, 33)]
)
def test_expert_mix_equals_mlx_bit_for_bit_specials_included(shape):
    rng = np.random.default_rng(len(shape) + shape[-1])
    y = rng.standard_normal(shape) * rng.choice([1e-38, 1e-3, 1.0, 1e30], size=shape)
    y = y.astype(np.float32)
    y.flat[:6] = [np.nan, np.inf, -np.inf, 0.0, -0.0, 3.4e38]
    w = rng.random(shape[:-1]).astype(np.float32)
    got = np.asarray(nat.expert_mix(mx.array(y), mx.array(w)))
    want = np.asarray(mlx_mix(mx.array(y), mx.array(w)))
    assert got.shape == shape[:-2] + shape[-1:]
    assert np.array_equal(got, want, equal_nan=True)


def test_expert_mix_reads_strided_operands_as_their_copies():
    y = mx.random.normal((4, 3, 16), key=mx.random.key(1)).transpose(1, 0, 2)
    w = mx.random.uniform(shape=(4, 3), key=mx.random.key(2)).T
    assert mx.array_equal(nat.expert_mix(y, w), mlx_mix(y, w))


@pytest.mark.parametrize(
    "y,w,match",
    [
        (mx.zeros((2, 4, 8), mx.bfloat16), mx.zeros((2, 4), mx.bfloat16), "float32"),
        (mx.zeros((2, 4, 8)), mx.zeros((2, 3)), r"\[\.\.\., k\]"),
        (mx.zeros((8,)), mx.zeros(()), r"\[\.\.\., k, D\]"),
    ],
)
def test_expert_mix_refuses_what_it_does_not_take(y, w, match):
    with pytest.raises(ValueError, match=match):
        nat.expert_mix(y, w)


def mlx_shared_mix(y, w, shared, gate) -> mx.array:
    return mlx_mix(y, w) + gate * shared


@pytest.mark.parametrize("shape", [(1, 1, 4, 1024), (3, 5, 8, 384), (2, 1, 1, 9)])
def test_the_shared_term_equals_mlx_bit_for_bit_specials_included(shape):
    rng = np.random.default_rng(shape[-1])
    y = (rng.standard_normal(shape) * rng.choice([1e-38, 1.0, 1e30], size=shape)).astype(np.float32)
    lead = shape[:-2]
    shared = (rng.standard_normal(lead + shape[-1:]) * 1e3).astype(np.float32)
    shared.flat[:3] = [np.nan, -np.inf, 0.0]
    gate = rng.random(lead + (1,)).astype(np.float32)
    w = rng.random(shape[:-1]).astype(np.float32)
    args = [mx.array(a) for a in (y, w, shared, gate)]
    got = np.asarray(nat.expert_mix(*args))
    assert np.array_equal(got, np.asarray(mlx_shared_mix(*args)), equal_nan=True)
    # the term is there: without it the results differ
    assert not np.array_equal(got, np.asarray(nat.expert_mix(*args[:2])), equal_nan=True)


@pytest.mark.parametrize(
    "shared,gate,match",
    [
        (mx.zeros((2, 8)), None, "together, or neither"),
        (mx.zeros((2, 8)), mx.zeros((2,)), r"gate weight \(2, 1\)"),
        (mx.zeros((2, 7)), mx.zeros((2, 1)), r"shared output \(2, 8\)"),
        (mx.zeros((2, 8), mx.float16), mx.zeros((2, 1)), "float16"),
    ],
)
def test_the_shared_term_refuses_what_it_does_not_take(shared, gate, match):
    with pytest.raises(ValueError, match=match):
        nat.expert_mix(mx.zeros((2, 4, 8)), mx.zeros((2, 4)), shared, gate)


def test_mix_experts_adds_the_shared_term_on_the_node_and_off_it_alike(tmp_path):
    y = mx.random.normal((2, 3, 4, 64), key=mx.random.key(5))
    w = mx.random.uniform(shape=(2, 3, 4), key=mx.random.key(6))
    shared = mx.random.normal((2, 3, 64), key=mx.random.key(7))
    gate = mx.sigmoid(mx.random.normal((2, 3, 1), key=mx.random.key(8)))
    want = mlx_shared_mix(y, w, shared, gate)
    assert mx.array_equal(mix_experts(y, w, shared=shared, shared_weight=gate), want)
    with pytest.raises(ValueError, match="together"):
        mix_experts(y, w, shared=shared)
    with forward_kernels("cpu-native-int8-act"):
        got = mix_experts(y, w, shared=shared, shared_weight=gate)
        assert labels(got, tmp_path).count("LoomExpertMix") == 1
        assert "Add" not in labels(got, tmp_path)
        assert mx.array_equal(got, want)
        # a shared output of another dtype keeps MLX's expression for that term
        h = shared.astype(mx.bfloat16)
        assert mx.array_equal(
            mix_experts(y, w, shared=h, shared_weight=gate), mlx_shared_mix(y, w, h, gate)
        )


def test_mix_experts_takes_the_node_only_in_a_native_float32_forward(tmp_path):
    y = mx.random.normal((2, 3, 4, 64), key=mx.random.key(3))
    w = mx.random.uniform(shape=(2, 3, 4), key=mx.random.key(4))
    assert mx.array_equal(mix_experts(y, w), mlx_mix(y, w))
    assert "LoomExpertMix" not in labels(mix_experts(y, w), tmp_path)
    for kernel_set in ("cpu-native", "cpu-native-int8-act"):
        with forward_kernels(kernel_set):
            got = mix_experts(y, w)
            assert "LoomExpertMix" in labels(got, tmp_path)
            assert mx.array_equal(got, mlx_mix(y, w))
            # Other dtypes keep MLX's expression (its promotion and rounding).
            h = y.astype(mx.bfloat16)
            assert mx.array_equal(mix_experts(h, w), mlx_mix(h, w))
            hw = w.astype(mx.bfloat16)
            assert mx.array_equal(mix_experts(h, hw), mlx_mix(h, hw))


GEMMA4_MOE = {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2}


@pytest.mark.parametrize(
    "family,config",
    [("qwen3_next", {}), ("gemma4_text", GEMMA4_MOE), ("qwen3_moe", {}), ("gpt_oss", {})],
    ids=["qwen3_next", "gemma4", "qwen3_moe", "gpt_oss"],
)
@pytest.mark.parametrize("kernel_set", ["cpu-native", "cpu-native-int8-act"])
def test_each_moe_family_mixes_on_the_node_with_the_same_logits(
    checkpoints, family, config, kernel_set, monkeypatch, tmp_path
):
    model, make_cache = ours(checkpoints(family, "q4", **config), "float32", kernel_set)
    prompt = mx.array([PROMPT])
    fused = model(prompt, cache=make_cache())
    assert "LoomExpertMix" in labels(fused, tmp_path)
    monkeypatch.setattr(experts, "current_expert_mix", lambda: None)
    unfused = model(prompt, cache=make_cache())
    assert "LoomExpertMix" not in labels(unfused, tmp_path)
    assert mx.array_equal(fused, unfused)
