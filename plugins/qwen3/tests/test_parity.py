"""Parity with mlx-lm's ``qwen3`` and ``qwen3_moe``: the same files, each side its own caches.

The op graph is mlx-lm's (per-head q/k norms before RoPE, fused attention,
the compiled SwiGLU, the router's precise softmax and argpartition, the
gathered expert matmuls), so on the oracle's arithmetic every comparison is
bit-equal: identical greedy tokens and ``mx.array_equal`` logits at the
prefill and every decode step. On the CPU default (native kernels, fp32
compute) the greedy tokens still match.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import maybe_quantize_kv_cache as lm_quantize_kv
from mlx_lm.models import cache as lm_cache
from qwen3_testkit import (
    LAYOUTS,
    PROMPT,
    assert_same_run,
    greedy,
    load_oracle,
    load_ours,
    write_checkpoint,
)

from mlx_loom.cache import maybe_quantize_kv_cache


def run_both(path, prompts=None, ours_cache=None, oracle_cache=None, ours_after=None,
             oracle_after=None, **options):
    ours, oracle = load_ours(path, **options), load_oracle(path)
    x = mx.array([PROMPT]) if prompts is None else prompts
    mine = greedy(ours, x, (ours_cache or (lambda m: m.make_cache()))(ours), after=ours_after)
    ref = greedy(oracle, x, (oracle_cache or lm_cache.make_prompt_cache)(oracle),
                 after=oracle_after)
    return mine, ref


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_both_layouts_match_mlx_lm_bit_for_bit(tmp_path, model_type, layout):
    path = write_checkpoint(tmp_path / "ckpt", model_type, layout)
    if layout == "mlx-q4":
        # The checkpoint really is quantized, experts included.
        names = mx.load(str(path / "model.safetensors"))
        assert names["model.layers.0.mlp.down_proj.scales" if model_type == "qwen3"
                     else "model.layers.0.mlp.switch_mlp.down_proj.scales"] is not None
    assert_same_run(*run_both(path))


def test_bf16_dense_matches_mlx_lm(tmp_path):
    # bf16 MoE is not compared: mlx-lm cannot run it on the CPU (gather_mm is fp32-only).
    assert_same_run(*run_both(write_checkpoint(tmp_path / "c", "qwen3", dtype=mx.bfloat16)))


def test_yarn_rope_scaling_matches_mlx_lm(tmp_path):
    # mlx-lm's qwen3 applies rope_scaling (its qwen3_moe ignores it; ours applies it to both).
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    path = write_checkpoint(tmp_path / "c", "qwen3", rope_scaling=yarn)
    assert_same_run(*run_both(path))


def test_quantized_kv_cache_matches_mlx_lm(tmp_path):
    # Quantize once the cache holds 8 tokens: the prompt is stored plain first and
    # converted after the prefill, as mlx-lm's generate does.
    args = {"kv_bits": 4, "kv_group_size": 32, "quantized_kv_start": 8}
    path = write_checkpoint(tmp_path / "c", "qwen3_moe", "mlx")
    assert_same_run(*run_both(
        path,
        ours_after=lambda c: maybe_quantize_kv_cache(c, **args),
        oracle_after=lambda c: lm_quantize_kv(c, 8, 32, 4),
    ))


def test_left_padded_batch_matches_mlx_lm_batch_caches(tmp_path):
    path = write_checkpoint(tmp_path / "c", "qwen3_moe", "hf")
    prompts = [PROMPT, PROMPT[:9], PROMPT[20:26]]
    width = max(map(len, prompts))
    padding = [width - len(p) for p in prompts]
    x = mx.array([[0] * pad + p for pad, p in zip(padding, prompts, strict=True)])
    assert_same_run(*run_both(
        path,
        prompts=x,
        ours_cache=lambda m: [c.empty_batch(padding) for c in m.make_cache()],
        oracle_cache=lambda m: [lm_cache.BatchKVCache(padding) for _ in m.layers],
    ))


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_cpu_default_gives_the_oracles_greedy_tokens(tmp_path, model_type):
    path = write_checkpoint(tmp_path / "c", model_type, "mlx-q4")
    ours = load_ours(path, compute_dtype=None, cpu_kernels=None)
    _, mine = greedy(ours, mx.array([PROMPT]), ours.make_cache())
    oracle = load_oracle(path)
    _, ref = greedy(oracle, mx.array([PROMPT]), lm_cache.make_prompt_cache(oracle))
    assert mine.tolist() == ref.tolist()
