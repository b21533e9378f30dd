"""Parity with mlx-lm's ``gpt_oss``: the same checkpoint files, each side with its own caches.

The op graph is mlx-lm's (sinks through the fused attention, YaRN RoPE, the
argpartition top-k, the compiled clamped SwiGLU, biased gathered experts,
per-kind masks), so every comparison is bit-equal: identical greedy tokens
and ``mx.array_equal`` logits at the prefill and every decode step (the
core's harness, :mod:`mlx_loom.testing.parity`). The harness's prompt (12
tokens) is longer than the tiny window (8), so the sliding layers' rotating
caches wrap during the prefill and keep wrapping.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from gpt_oss_testkit import write_tiny
from mlx_lm.models import cache as lm_cache

from mlx_loom.cache import BatchKVCache, BatchRotatingKVCache
from mlx_loom.testing.parity import PROMPT, compare_with_mlx_lm, greedy, load_oracle, load_ours

CHECKPOINTS = {
    "hf-fp32": {"layout": "hf"},
    "mlx-fp32": {"layout": "mlx"},
    "mlx-q4": {"layout": "mlx", "bits": 4},  # mlx-lm's recipe: 8-bit router, 4-bit rest
    "mlx-mxfp4": {"layout": "mlx-mxfp4"},  # MXFP4 experts (with their bias), 8-bit router
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    made: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in made:
            made[kind] = write_tiny(tmp_path_factory.mktemp(kind), **CHECKPOINTS[kind])
        return made[kind]

    return get


@pytest.mark.parametrize("kind", list(CHECKPOINTS))
def test_greedy_decode_matches_mlx_lm_bit_for_bit(checkpoint, kind):
    path = checkpoint(kind)
    if kind in ("mlx-q4", "mlx-mxfp4"):
        layer = load_ours(path).module.model.layers[0].mlp
        assert layer.router.bits == 8 and layer.experts.down_proj.bits == 4
        assert layer.experts.down_proj.mode == ("mxfp4" if kind == "mlx-mxfp4" else "affine")
        assert "bias" in layer.experts.down_proj  # the experts' bias survives quantization
    compare_with_mlx_lm(path, steps=24)


def test_cacheless_forward_matches_mlx_lm(checkpoint):
    path = checkpoint("hf-fp32")
    x = mx.array([list(PROMPT), list(PROMPT[::-1])])
    assert mx.array_equal(load_ours(path)(x), load_oracle(path)(x)).item()


def test_the_cpu_default_writes_the_oracles_greedy_tokens(checkpoint):
    path = checkpoint("mlx-fp32")
    ours = load_ours(path, compute_dtype=None, cpu_kernels=None)  # the CPU default
    oracle = load_oracle(path)
    x = mx.array([list(PROMPT)])
    mine = greedy(ours, x, ours.make_cache(), steps=24)
    assert mine.tokens == greedy(oracle, x, oracle.make_cache(), steps=24).tokens


def test_left_padded_batch_matches_mlx_lms_batch_caches(checkpoint):
    rows = [list(PROMPT), list(PROMPT[3:8]), list(PROMPT[:10])]
    width = max(map(len, rows))
    pad = [width - len(r) for r in rows]
    x = mx.array([[0] * p + r for p, r in zip(pad, rows, strict=True)])
    window = 8

    def ours(model):
        return [
            BatchRotatingKVCache(window, pad) if layer.sliding else BatchKVCache(pad)
            for layer in model.module.model.layers
        ]

    def theirs(model):
        return [
            lm_cache.BatchRotatingKVCache(window, pad)
            if kind == "sliding_attention"
            else lm_cache.BatchKVCache(pad)
            for kind in model.model.layer_types
        ]

    path = checkpoint("mlx-fp32")
    compare_with_mlx_lm(path, prompt=x, steps=10, our_cache=ours, oracle_cache=theirs)
