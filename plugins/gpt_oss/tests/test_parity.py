"""Parity with mlx-lm's ``gpt_oss``: the same checkpoint files, each side with its own caches.

The op graph is mlx-lm's (sinks through the fused attention, YaRN RoPE, the
argpartition top-k, the compiled clamped SwiGLU, biased gathered experts,
per-kind masks), so every comparison is bit-equal: identical greedy tokens
and ``mx.array_equal`` logits at the prefill and every decode step. The
prompt (12 tokens) is longer than the tiny window (8), so the sliding
layers' rotating caches wrap during the prefill and keep wrapping.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from gpt_oss_testkit import (
    PROMPT,
    assert_same_run,
    greedy,
    load_oracle,
    load_ours,
    write_checkpoint,
)
from mlx_lm.models import cache as lm_cache

from mlx_loom.cache import BatchKVCache, BatchRotatingKVCache

CHECKPOINTS = {
    "hf-fp32": {"layout": "hf"},
    "mlx-fp32": {"layout": "mlx"},
    "mlx-q4": {"layout": "mlx", "bits": 4},  # mlx-lm's recipe: 8-bit router, 4-bit rest
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    made: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in made:
            made[kind] = write_checkpoint(tmp_path_factory.mktemp(kind), **CHECKPOINTS[kind])
        return made[kind]

    return get


@pytest.mark.parametrize("kind", list(CHECKPOINTS))
def test_greedy_decode_matches_mlx_lm_bit_for_bit(checkpoint, kind):
    path = checkpoint(kind)
    ours, oracle = load_ours(path), load_oracle(path)
    if kind == "mlx-q4":
        layer = ours.module.model.layers[0].mlp
        assert layer.router.bits == 8 and layer.experts.down_proj.bits == 4
        assert "bias" in layer.experts.down_proj  # the experts' bias survives quantization
    x = mx.array([PROMPT])
    assert_same_run(greedy(ours, x, ours.make_cache()), greedy(oracle, x, oracle.make_cache()))


def test_cacheless_forward_matches_mlx_lm(checkpoint):
    path = checkpoint("hf-fp32")
    x = mx.array([PROMPT, PROMPT[::-1]])
    assert mx.array_equal(load_ours(path)(x), load_oracle(path)(x)).item()


def test_the_cpu_default_writes_the_oracles_greedy_tokens(checkpoint):
    path = checkpoint("mlx-fp32")
    ours = load_ours(path, compute_dtype=None, cpu_kernels=None)  # the CPU default
    oracle = load_oracle(path)
    x = mx.array([PROMPT])
    mine, ref = greedy(ours, x, ours.make_cache()), greedy(oracle, x, oracle.make_cache())
    assert mine[1].tolist() == ref[1].tolist()


def _left_pad(rows):
    width = max(map(len, rows))
    return mx.array([[0] * (width - len(r)) + r for r in rows]), [width - len(r) for r in rows]


def test_left_padded_batch_matches_mlx_lms_batch_caches(checkpoint):
    path = checkpoint("mlx-fp32")
    ours, oracle = load_ours(path), load_oracle(path)
    rows = [PROMPT, PROMPT[3:8], PROMPT[:10]]
    x, pad = _left_pad(rows)

    def caches(model, full, window):
        return [window(8, pad) if layer.sliding else full(pad) for layer in model.model.layers]

    ca = caches(ours.module, BatchKVCache, BatchRotatingKVCache)
    cb = [
        lm_cache.BatchRotatingKVCache(8, pad) if kind == "sliding_attention"
        else lm_cache.BatchKVCache(pad)
        for kind in oracle.model.layer_types
    ]
    la, lb = ours(x, cache=ca), oracle(x, cache=cb)
    for r, p in enumerate(pad):
        assert mx.array_equal(la[r, p:], lb[r, p:]).item()
    for _ in range(10):
        t = mx.argmax(la[:, -1], -1)[:, None]
        assert mx.array_equal(t, mx.argmax(lb[:, -1], -1)[:, None]).item()
        la, lb = ours(t, cache=ca), oracle(t, cache=cb)
        assert mx.array_equal(la, lb).item()
