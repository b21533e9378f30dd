"""Parity with mlx-lm's ``llama``: same checkpoint files, each side with its own caches.

The op graph is the same as mlx-lm's (fused attention, RoPE, RMSNorm, the same
compiled SwiGLU, the same masks and quantized attention), so every comparison
is bit-equal: identical greedy tokens over 64 decode steps and ``mx.array_equal``
logits at the prefill and at every decode step. The harness is the core's
(:mod:`mlx_loom.testing.parity`).
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import pytest
from mlx_lm.generate import maybe_quantize_kv_cache as lm_quantize_kv
from mlx_lm.models import cache as lm_cache

from mlx_loom.cache import maybe_quantize_kv_cache
from mlx_loom.testing.parity import PROMPT, compare_with_mlx_lm, load_ours


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32, mx.float16], ids=str)
def test_unquantized_weights_match_mlx_lm(make_checkpoint, dtype):
    compare_with_mlx_lm(make_checkpoint(dtype=dtype))


@pytest.mark.parametrize("bits,group_size", [(4, 64), (8, 32), (4, 32), (8, 128)])
def test_affine_quantized_weights_match_mlx_lm(
    make_checkpoint, quantize_checkpoint, bits, group_size
):
    # Group 128 leaves every module whose input width (64) it does not divide
    # unquantized: a mixed checkpoint, as mlx-lm's converter writes it.
    path = quantize_checkpoint(make_checkpoint(), bits, group_size)
    ours = load_ours(path)
    assert ours.module.model.layers[0].mlp.down_proj.weight.dtype == mx.uint32
    compare_with_mlx_lm(path)


def test_per_module_quantization_overrides_match_mlx_lm(make_checkpoint, quantize_checkpoint):
    def recipe(path, module):
        if path == "model.embed_tokens":
            return False  # left unquantized
        if path.endswith("down_proj") or path == "lm_head":
            return {"group_size": 32, "bits": 8}
        return True

    path = quantize_checkpoint(make_checkpoint(), 4, 64, predicate=recipe)
    ours = load_ours(path).module
    assert ours.model.embed_tokens.weight.dtype == mx.float32
    assert ours.lm_head.bits == 8 and ours.model.layers[1].self_attn.q_proj.bits == 4
    compare_with_mlx_lm(path)


@pytest.mark.parametrize("kv_bits", [4, 8])
def test_quantized_kv_cache_matches_mlx_lm(make_checkpoint, kv_bits):
    # Quantize once the cache holds 8 tokens: the prompt (12) is stored plain
    # first and converted after the prefill, as mlx-lm's generate does.
    args = {"kv_bits": kv_bits, "kv_group_size": 32, "quantized_kv_start": 8}
    compare_with_mlx_lm(
        make_checkpoint(dtype=mx.bfloat16),
        our_after=partial(maybe_quantize_kv_cache, **args),
        oracle_after=lambda c: lm_quantize_kv(c, 8, 32, kv_bits),
    )


def test_sliding_window_layers_match_mlx_lm(make_checkpoint):
    # A window of 5 < the 12-token prompt: the rotating cache wraps during prefill.
    path = make_checkpoint(layer_types=["sliding_attention", "full_attention"], sliding_window=5)
    compare_with_mlx_lm(path)


def test_tied_embeddings_match_mlx_lm(make_checkpoint):
    compare_with_mlx_lm(make_checkpoint(tie_word_embeddings=True))


def test_attention_and_mlp_bias_match_mlx_lm(make_checkpoint):
    path = make_checkpoint(dtype=mx.bfloat16, attention_bias=True, mlp_bias=True)
    compare_with_mlx_lm(path)


ROPE_SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    # max_position_embeddings 16 < prompt + 64 steps: the base grows during decode.
    "dynamic": {"type": "dynamic", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "longrope": {
        "rope_type": "longrope",
        "original_max_position_embeddings": 8,
        "short_factor": [1.0] * 16,
        "long_factor": [1.0 + 0.25 * i for i in range(16)],
    },
}


@pytest.mark.parametrize("kind", list(ROPE_SCALINGS))
def test_rope_scaling_matches_mlx_lm(make_checkpoint, kind):
    path = make_checkpoint(
        dtype=mx.bfloat16, rope_scaling=ROPE_SCALINGS[kind], max_position_embeddings=16
    )
    compare_with_mlx_lm(path)


def _left_padded(prompts):
    width = max(map(len, prompts))
    padding = [width - len(p) for p in prompts]
    return mx.array([[0] * pad + p for pad, p in zip(padding, prompts, strict=True)]), padding


@pytest.mark.parametrize("sliding", [False, True], ids=["full", "sliding"])
def test_left_padded_batch_matches_mlx_lm_batch_caches(make_checkpoint, sliding):
    overrides = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 6}
    path = make_checkpoint(dtype=mx.bfloat16, **(overrides if sliding else {}))
    prompt = list(PROMPT)
    x, padding = _left_padded([prompt, prompt[:7], prompt[4:7]])

    def oracle_caches(model):
        return [
            lm_cache.BatchRotatingKVCache(6, padding)
            if layer.use_sliding
            else lm_cache.BatchKVCache(padding)
            for layer in model.layers
        ]

    compare_with_mlx_lm(
        path,
        prompt=x,
        our_cache=lambda m: [c.empty_batch(padding) for c in m.make_cache()],
        oracle_cache=oracle_caches,
    )
