"""Batched generation: rows of different lengths decoded together."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache
from mlx_lm.utils import load_model

import mlx_loom
import mlx_loom.loader
from mlx_loom.engine.params import SamplingParams
from mlx_loom.errors import CapabilityRefused
from mlx_loom.generation import batch_generate, batch_generate_tokens, generate_tokens, make_sampler

PROMPTS = [[5, 17, 42, 9, 100, 3, 77], [8, 8, 1], [200, 13, 55, 66, 2]]


def single(model, prompt, steps):
    out = generate_tokens(
        model, prompt, model.make_cache(), sampler=make_sampler(SamplingParams()), max_tokens=steps
    )
    return [t for t, _ in out]


@pytest.mark.parametrize("fixture", ["llama_f32", "llama_sliding"])
def test_each_row_equals_the_prompt_run_alone(fixture, request):
    model, _ = mlx_loom.load(request.getfixturevalue(fixture))
    rows = batch_generate_tokens(model, PROMPTS, max_tokens=32)
    for prompt, (tokens, reason) in zip(PROMPTS, rows, strict=True):
        assert tokens == single(model, prompt, 32)
        assert reason == "length"


def test_batched_prefill_logits_match_mlx_lm_batch_cache(llama_f32):
    """Our left-padded batch forward against mlx-lm's BatchKVCache on the same weights."""
    model, _ = mlx_loom.load(llama_f32, compute_dtype="checkpoint", cpu_kernels="cpu-ops")
    oracle, _ = load_model(llama_f32)
    width = max(map(len, PROMPTS))
    padding = [width - len(p) for p in PROMPTS]
    inputs = mx.array([[0] * pad + p for p, pad in zip(PROMPTS, padding, strict=True)])
    ours = model(inputs, [c.empty_batch(padding) for c in model.make_cache()])
    theirs = oracle(inputs, cache=[BatchKVCache(padding) for _ in oracle.layers])
    for row, pad in enumerate(padding):
        assert mx.array_equal(ours[row, pad:], theirs[row, pad:])


def test_rows_that_finish_early_leave_the_others_unchanged(llama_f32):
    model, tok = mlx_loom.load(llama_f32)
    alone = single(model, PROMPTS[0], 20)
    stop_token = single(model, PROMPTS[1], 3)[2]
    rows = batch_generate_tokens(model, PROMPTS[:2], max_tokens=20, eos=frozenset({stop_token}))
    assert rows[1][1] == "stop" and len(rows[1][0]) <= 2
    if stop_token not in alone:
        assert rows[0][0] == alone


def test_batch_generate_returns_text_per_prompt(llama_f32):
    model, tok = mlx_loom.load(llama_f32)
    results = batch_generate(model, tok, ["the model", "hello world, this is"], max_tokens=8)
    assert len(results) == 2
    for r in results:
        assert r.text == tok.decode(r.tokens)


def test_batching_is_refused_without_the_capability(tmp_path):
    from mlx_loom.host import PluginHost

    from ..core.toyfamily import ToyPlugin, write_toy_checkpoint

    ckpt = write_toy_checkpoint(tmp_path / "toy")
    host = PluginHost(plugins=[("toy", ToyPlugin())], entry_points=False)
    model, _ = mlx_loom.loader.build_model(mlx_loom.resolve_model(ckpt, host=host)), None
    with pytest.raises(CapabilityRefused, match="batch"):
        batch_generate_tokens(model, [[1, 2], [3]], max_tokens=2)
