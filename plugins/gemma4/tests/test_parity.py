"""Parity with mlx-lm's ``gemma4_text`` / ``gemma4`` on tiny random HF-layout checkpoints.

Same op graph as mlx-lm, so every comparison is bit-exact (``mx.array_equal``):
prompt logits (prefilled in two chunks so the rotating window both fills and
wraps), then >= 64 greedy decode steps, each side on its own caches (ours: the
core's cache kinds; theirs: mlx-lm's). Prompts are longer than the sliding
window (8).
"""

from __future__ import annotations

import logging

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache as LmBatchKVCache
from mlx_lm.models.cache import BatchRotatingKVCache as LmBatchRotatingKVCache

from mlx_loom.cache import BatchKVCache, BatchRotatingKVCache

PROMPT, CHUNKS, STEPS = 20, (13, 7), 64


def _run(kit, path, *, rows: int = 1):
    ours, theirs = kit.load_ours(path), kit.load_theirs(path)
    prompt = kit.prompt_of(PROMPT, rows=rows)
    return kit.greedy_compare(
        ours, theirs, prompt, ours.make_cache(), theirs.make_cache(), steps=STEPS, chunks=CHUNKS
    )


def test_sliding_and_global_layers_with_proportional_rope_match_mlx_lm(kit, checkpoint):
    tokens = _run(kit, checkpoint())
    assert len(tokens[0]) == STEPS


def test_per_layer_inputs_match_mlx_lm(kit, checkpoint):
    _run(kit, checkpoint(**kit.PER_LAYER))


def test_kv_sharing_with_double_wide_mlp_matches_mlx_lm(kit, checkpoint):
    path = checkpoint(**kit.SHARED, **kit.PER_LAYER)
    ours = kit.load_ours(path)
    assert len(ours.make_cache()) == 3  # the two shared layers own no cache
    assert ours.model.layers[4].mlp.gate_proj.weight.shape[0] == 2 * 96
    _run(kit, path)


def test_attention_k_eq_v_with_global_kv_heads_matches_mlx_lm(kit, checkpoint):
    path = checkpoint(**kit.K_EQ_V)
    ours = kit.load_ours(path)
    assert "v_proj" not in ours.model.layers[2].self_attn  # full layer: values = keys
    assert "v_proj" in ours.model.layers[0].self_attn  # sliding layer keeps v_proj
    _run(kit, path)


def test_moe_fp32_matches_mlx_lm(kit, checkpoint):
    _run(kit, checkpoint(**kit.MOE, **kit.SHARED))


def test_moe_affine_quantized_matches_mlx_lm(kit, checkpoint, tmp_path):
    src = checkpoint(**kit.MOE, **kit.PER_LAYER)
    _run(kit, kit.write_quantized(src, tmp_path / "q4"))


def test_dense_affine_quantized_with_every_feature_matches_mlx_lm(kit, checkpoint, tmp_path):
    src = checkpoint(**kit.PER_LAYER, **kit.SHARED, **kit.K_EQ_V)
    _run(kit, kit.write_quantized(src, tmp_path / "q4", bits=4))


def test_bf16_dense_checkpoint_matches_mlx_lm(kit, checkpoint):
    path = checkpoint(dtype=mx.bfloat16, **kit.PER_LAYER, **kit.SHARED)
    assert kit.load_ours(path).model.embed_tokens.weight.dtype == mx.bfloat16
    _run(kit, path)


def test_gemma4_wrapper_layout_matches_mlx_lm_and_drops_towers_with_a_notice(kit, tmp_path, caplog):
    import numpy as np

    towers = {
        "model.vision_tower.encoder.weight": np.ones((4, 4), np.float32),
        "model.audio_tower.conv.weight": np.ones((2, 2), np.float32),
        "model.embed_vision.embedding_projection.weight": np.ones((4, 4), np.float32),
    }
    cfg = kit.tiny_config(**kit.PER_LAYER, **kit.SHARED, **kit.MOE)
    path = kit.write_checkpoint(tmp_path / "wrap", cfg, wrapper=True, extra_tensors=towers)
    with caplog.at_level(logging.WARNING, logger="mlx_loom.artifacts"):
        ours = kit.load_ours(path)
    notices = [r.getMessage() for r in caplog.records if "non-text" in r.getMessage()]
    assert len(notices) == 1 and "dropped 3 non-text tensor(s)" in notices[0]
    theirs = kit.load_theirs(path)
    kit.greedy_compare(
        ours,
        theirs,
        kit.prompt_of(PROMPT),
        ours.make_cache(),
        theirs.make_cache(),
        steps=STEPS,
        chunks=CHUNKS,
    )


def test_batched_prompts_of_different_lengths_match_mlx_lm_batch_path(kit, checkpoint):
    """Left-padded rows (20 and 11 tokens) on the core's batch caches vs mlx-lm's."""
    path = checkpoint(**kit.PER_LAYER, **kit.SHARED, **kit.MOE)
    ours, theirs = kit.load_ours(path), kit.load_theirs(path)
    long, short = kit.prompt_of(20, seed=3), kit.prompt_of(11, seed=4)
    pad = [0, 9]
    prompt = mx.concatenate([long, mx.concatenate([mx.zeros((1, 9), mx.int32), short], 1)], 0)
    cfg = ours.cfg

    def caches(kv, rot):
        return [kv(pad) if k == kit.F else rot(cfg.sliding_window, pad) for k in cfg.kinds[:3]]

    tokens = kit.greedy_compare(
        ours,
        theirs,
        prompt,
        caches(BatchKVCache, BatchRotatingKVCache),
        caches(LmBatchKVCache, LmBatchRotatingKVCache),
        steps=STEPS,
    )
    assert len(tokens) == 2 and all(len(t) == STEPS for t in tokens)
