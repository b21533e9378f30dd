"""stream_generate / generate: text, stops, EOS, logprobs, validation, prompt caches."""

from __future__ import annotations

import mlx.core as mx
import pytest

import mlx_loom
from mlx_loom.errors import CacheNotTrimmable, CapabilityRefused, RequestError
from mlx_loom.generation import PromptCache, stream_generate

PROMPT = "the model reads a token"


@pytest.fixture(scope="module")
def loaded(llama_f32):
    return mlx_loom.load(llama_f32)


def run(model, tok, prompt=PROMPT, **options):
    return list(stream_generate(model, tok, prompt, **options))


def test_streamed_text_is_the_decoded_tokens(loaded):
    model, tok = loaded
    responses = run(model, tok, max_tokens=24)
    tokens = [r.token for r in responses]
    assert "".join(r.text for r in responses) == tok.decode(tokens)
    assert responses[-1].finish_reason == "length"
    assert responses[-1].generation_tokens == 24
    assert all(r.finish_reason is None for r in responses[:-1])


def test_generate_returns_the_streamed_text(loaded):
    model, tok = loaded
    streamed = "".join(r.text for r in run(model, tok, max_tokens=12))
    assert mlx_loom.generate(model, tok, PROMPT, max_tokens=12) == streamed


def test_eos_stops_generation_without_emitting_it(loaded):
    model, tok = loaded
    eos = next(iter(tok.eos_token_ids))
    responses = run(model, tok, max_tokens=10, logit_bias={eos: 100.0})
    assert len(responses) == 1
    assert responses[0].token == eos and responses[0].finish_reason == "stop"
    assert responses[0].text == ""


def test_stop_string_ends_generation_and_is_never_streamed(loaded):
    model, tok = loaded
    full = "".join(r.text for r in run(model, tok, max_tokens=40))
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), "need a visible stop string"
    responses = run(model, tok, max_tokens=40, stop=[stop])
    text = "".join(r.text for r in responses)
    assert responses[-1].finish_reason == "stop" and responses[-1].stop == stop
    assert text == full[: full.index(stop)]
    assert stop not in text


def test_reported_logprobs_match_the_distribution(loaded):
    model, tok = loaded
    for r in run(model, tok, max_tokens=4, logprobs=3):
        assert r.logprob == pytest.approx(r.logprobs[r.token].item())
        assert len(r.top_logprobs) == 3
        values = [v for _, v in r.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert r.top_logprobs[0][0] == r.token  # greedy picks the most likely


def test_stats_are_reported(loaded):
    last = run(loaded[0], loaded[1], max_tokens=5)[-1]
    assert last.prompt_tokens > 0 and last.prompt_tps > 0 and last.generation_tps > 0
    assert last.peak_memory > 0


@pytest.mark.parametrize(
    "options, field",
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"kv_bits": 3.5}, "kv_bits"),
        ({"prefill_step_size": 0}, "prefill_step_size"),
        ({"logit_bias": {10_000: 1.0}}, "10000"),
        ({"top_q": 0.5}, "top_q"),
    ],
)
def test_invalid_requests_fail_before_any_work(loaded, options, field):
    model, tok = loaded
    with pytest.raises(RequestError, match=field):
        run(model, tok, **options)


def test_empty_prompt_is_refused(loaded):
    with pytest.raises(RequestError, match="prompt is empty"):
        run(loaded[0], loaded[1], prompt="")


def test_prompt_longer_than_the_context_is_refused(loaded):
    model, tok = loaded
    too_long = [5] * (model.context_length + 1)
    with pytest.raises(RequestError, match="max_position_embeddings"):
        run(model, tok, prompt=too_long)


def test_prompt_cache_reuses_the_common_prefix_and_matches_a_fresh_run(loaded):
    model, tok = loaded
    cache = PromptCache(model)
    first = tok.encode(PROMPT)
    run(model, tok, prompt=first, prompt_cache=cache, max_tokens=6)
    longer = first + tok.encode(" and writes the next one", add_special_tokens=False)
    reused = run(model, tok, prompt=longer, prompt_cache=cache, max_tokens=16)
    fresh = run(model, tok, prompt=longer, max_tokens=16)
    assert reused[-1].cached_tokens >= len(first)
    assert [r.token for r in reused] == [r.token for r in fresh]


def test_prompt_cache_trims_a_diverging_tail_exactly(loaded):
    model, tok = loaded
    cache = PromptCache(model)
    run(model, tok, prompt="the model reads a token and writes", prompt_cache=cache, max_tokens=8)
    other = "the model reads a word"
    reused = run(model, tok, prompt=other, prompt_cache=cache, max_tokens=16)
    fresh = run(model, tok, prompt=other, max_tokens=16)
    assert reused[-1].cached_tokens > 0
    assert [r.token for r in reused] == [r.token for r in fresh]
    for a, b in zip(reused, fresh, strict=True):
        assert mx.allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_prompt_cache_never_trims_a_wrapped_window(llama_sliding):
    model, tok = mlx_loom.load(llama_sliding)
    cache = PromptCache(model)
    long_prompt = "the model reads a token and writes the next one while the cache keeps"
    run(model, tok, prompt=long_prompt, prompt_cache=cache, max_tokens=4)
    sliding = cache.cache[0]
    assert not sliding.is_trimmable()
    with pytest.raises(CacheNotTrimmable):
        sliding.trim(1)
    other = "the model reads a token"
    reused = run(model, tok, prompt=other, prompt_cache=cache, max_tokens=12)
    fresh = run(model, tok, prompt=other, max_tokens=12)
    assert reused[-1].cached_tokens == 0  # started afresh instead of trimming
    assert [r.token for r in reused] == [r.token for r in fresh]


def test_kv_quantization_is_refused_for_a_model_without_the_capability(tmp_path):
    from mlx_loom.host import PluginHost
    from mlx_loom.testing.tokenizer import write_tokenizer

    from ..core.toyfamily import ToyPlugin, write_toy_checkpoint

    ckpt = write_toy_checkpoint(tmp_path / "toy", vocab=256)
    write_tokenizer(ckpt, 256)
    host = PluginHost(plugins=[("toy", ToyPlugin())], entry_points=False)
    model, tok = mlx_loom.load(ckpt, host=host)
    with pytest.raises(CapabilityRefused, match="kv-quantization"):
        run(model, tok, kv_bits=4)


def test_a_saved_prompt_cache_reloads_and_is_reused(loaded, tmp_path):
    model, tok = loaded
    cache = PromptCache(model)
    first = tok.encode(PROMPT)
    run(model, tok, prompt=first, prompt_cache=cache, max_tokens=4)
    cache.save(tmp_path / "prompt.safetensors")
    restored = PromptCache.load(tmp_path / "prompt.safetensors", model)
    assert restored.tokens == cache.tokens
    longer = first + tok.encode(" and writes", add_special_tokens=False)
    reused = run(model, tok, prompt=longer, prompt_cache=restored, max_tokens=10)
    fresh = run(model, tok, prompt=longer, max_tokens=10)
    assert reused[-1].cached_tokens >= len(first)
    assert [r.token for r in reused] == [r.token for r in fresh]


def test_a_prompt_cache_saved_for_another_model_is_refused(loaded, tmp_path, llama_sliding):
    from mlx_loom.errors import CacheError

    model, tok = loaded
    other, _ = mlx_loom.load(llama_sliding)
    cache = PromptCache(other)
    run(other, tok, prompt="hello", prompt_cache=cache, max_tokens=2)
    cache.save(tmp_path / "p.safetensors")
    with pytest.raises(CacheError, match="was saved for model"):
        PromptCache.load(tmp_path / "p.safetensors", model)
