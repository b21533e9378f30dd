"""The generation API as the engine's clients: batch_generate, mlx-lm-style callables,
max_kv_size, and stopping at the context — through the API, ``loom generate`` and the server."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models import cache as lm_cache
from mlx_lm.sample_utils import make_logits_processors as lm_processors
from mlx_lm.sample_utils import make_sampler as lm_sampler
from mlx_lm.utils import load_model

import mlx_loom
from mlx_loom.assets import BUNDLED_MODEL
from mlx_loom.errors import CapabilityRefused, RequestError
from mlx_loom.generation import BatchResponse, generate_tokens

PROMPTS = ["the model reads a token", "hello world, this is", "a b c"]


@pytest.fixture(scope="module")
def llama(llama_f32):
    # Compared with mlx-lm: the checkpoint's dtype and MLX's own ops, as mlx-lm runs.
    return mlx_loom.load(llama_f32, compute_dtype="checkpoint", cpu_kernels="cpu-ops")


def prompt_ids(n: int, seed: int = 7) -> list[int]:
    return mx.random.randint(0, 256, (n,), key=mx.random.key(seed)).tolist()


# --- batch_generate -----------------------------------------------------------


def test_batch_generate_returns_texts_and_per_row_results(llama):
    model, tok = llama
    out = mlx_loom.batch_generate(model, tok, PROMPTS, max_tokens=[8, 5, 3])
    assert isinstance(out, BatchResponse) and len(out) == 3
    assert out.texts == [r.text for r in out]
    assert [len(t) for t in out.token_ids] == [8, 5, 3]
    assert out.finish_reasons == ["length"] * 3
    assert all(len(lp) == len(t) for lp, t in zip(out.logprobs, out.token_ids, strict=True))
    assert out.stats.generation_tokens == 16 and out.stats.prompt_tokens > 0


def test_batch_generate_takes_penalties_and_stop_strings_like_a_single_request(llama):
    model, tok = llama
    options = dict(max_tokens=24, repetition_penalty=1.4, frequency_penalty=0.3, stop=["e"])
    out = mlx_loom.batch_generate(model, tok, PROMPTS, **options)
    for prompt, row in zip(PROMPTS, out, strict=True):
        assert row.text == mlx_loom.generate(model, tok, prompt, **options)
        assert "e" not in row.text


def test_batch_generate_refuses_a_max_tokens_list_of_the_wrong_length(llama):
    model, tok = llama
    with pytest.raises(RequestError, match="2 entries for 3 prompts"):
        mlx_loom.batch_generate(model, tok, PROMPTS, max_tokens=[4, 4])


# --- mlx-lm-style callables -------------------------------------------------------


def test_logits_processor_callables_match_mlx_lm(llama, llama_f32):
    model, _ = llama
    prompt = prompt_ids(12)
    processors = lm_processors(repetition_penalty=1.3, repetition_context_size=8)
    ours = list(generate_tokens(model, prompt, processors=processors, max_tokens=24))
    oracle, _ = load_model(llama_f32)
    theirs = list(
        generate_step(mx.array(prompt), oracle, max_tokens=24, logits_processors=processors)
    )
    assert [t for t, _ in ours] == [t for t, _ in theirs]
    assert all(mx.array_equal(a, b).item() for (_, a), (_, b) in zip(ours, theirs, strict=True))


def test_a_sampler_callable_matches_mlx_lm(llama, llama_f32):
    model, tok = llama
    prompt = prompt_ids(10)
    ours = [
        r.token
        for r in mlx_loom.stream_generate(
            model, tok, prompt, max_tokens=16, sampler=lm_sampler(temp=0.9, top_k=20), seed=3
        )
        if r.token not in tok.eos_token_ids
    ]
    oracle, _ = load_model(llama_f32)
    mx.random.seed(3)
    theirs = [
        int(t)
        for t, _ in generate_step(
            mx.array(prompt), oracle, max_tokens=16, sampler=lm_sampler(temp=0.9, top_k=20)
        )
    ]
    assert ours == theirs[: len(ours)] and ours


def test_a_sampler_with_sampling_settings_is_refused(llama):
    model, tok = llama
    with pytest.raises(RequestError, match="sampler= and temperature"):
        mlx_loom.generate(model, tok, "hi", sampler=lm_sampler(temp=0.5), temperature=0.5)


# --- max_kv_size ---------------------------------------------------------------------


def test_max_kv_size_is_a_sliding_window_that_matches_mlx_lm(llama, llama_f32):
    model, _ = llama
    prompt = prompt_ids(11)
    ours = list(generate_tokens(model, prompt, max_kv_size=8, max_tokens=20, prefill_step_size=4))
    oracle, _ = load_model(llama_f32)
    # mlx-lm ignores max_kv_size for models that make their own caches, so the
    # oracle gets the caches max_kv_size means, directly.
    caches = [lm_cache.RotatingKVCache(max_size=8, keep=0) for _ in oracle.layers]
    theirs = list(
        generate_step(
            mx.array(prompt), oracle, max_tokens=20, prompt_cache=caches, prefill_step_size=4
        )
    )
    assert [t for t, _ in ours] == [t for t, _ in theirs]
    assert all(mx.array_equal(a, b).item() for (_, a), (_, b) in zip(ours, theirs, strict=True))


def test_max_kv_size_is_refused_where_a_cache_kind_cannot_honour_it():
    from mlx_loom.engine.caches import fresh_caches

    class Opaque:
        """A cache kind the core does not know how to bound."""

    class Stub:
        def make_cache(self):
            return [Opaque()]

    with pytest.raises(CapabilityRefused, match="cannot bound a Opaque cache"):
        fresh_caches(Stub(), 64)  # type: ignore[arg-type]


def test_a_prompt_cache_must_be_made_with_the_requests_max_kv_size(llama):
    model, tok = llama
    cache = mlx_loom.PromptCache(model, max_kv_size=16)
    assert list(
        mlx_loom.stream_generate(model, tok, "hi", prompt_cache=cache, max_kv_size=16, max_tokens=2)
    )
    with pytest.raises(RequestError, match="max_kv_size=None"):
        list(mlx_loom.stream_generate(model, tok, "hi", prompt_cache=cache, max_tokens=2))


# --- never past the context ----------------------------------------------------------


@pytest.fixture(scope="module")
def bundled():
    return mlx_loom.load(BUNDLED_MODEL)


def long_prompt(tok, n: int) -> list[int]:
    ids = tok.encode("once upon a time there was a little model that read stories " * 40)
    assert len(ids) >= n
    return ids[:n]


def test_generation_stops_at_the_context_with_finish_reason_length(bundled):
    model, tok = bundled
    assert model.context_length == 256
    responses = list(
        mlx_loom.stream_generate(
            model,
            tok,
            long_prompt(tok, 225),
            max_tokens=150,
            logit_bias={t: -100.0 for t in tok.eos_token_ids},
        )
    )
    assert len(responses) == 31 and responses[-1].finish_reason == "length"


def test_a_prompt_that_fills_the_context_is_refused(bundled):
    model, tok = bundled
    with pytest.raises(RequestError, match="leaves no room"):
        mlx_loom.generate(model, tok, long_prompt(tok, 256), max_tokens=4)


def test_loom_generate_stops_at_the_context(bundled, capsys, monkeypatch):
    import io

    from mlx_loom.cli.main import main
    from mlx_loom.text import Tokenizer

    model, tok = bundled
    monkeypatch.setattr("sys.stdin", io.StringIO(tok.decode(long_prompt(tok, 225)[1:])))
    # No EOS: only the context can end this generation before its 150 tokens.
    monkeypatch.setattr(Tokenizer, "eos_token_ids", property(lambda self: frozenset()))
    code = main(["generate", "--no-chat-template", "-p", "-", "-m", "150"])
    err = capsys.readouterr().err
    assert code == 0, err
    prompt = int(err.split("Prompt: ")[1].split(" tokens")[0])
    generated = int(err.split("Generation: ")[1].split(" tokens")[0])
    assert prompt > 200 and generated == 256 - prompt


def test_the_server_stops_at_the_context(bundled):
    from tests.server.conftest import serve

    model, tok = bundled
    gen = serve(model, tok)
    client = next(gen)
    try:
        body = {
            "prompt": long_prompt(tok, 225),
            "max_tokens": 150,
            "logit_bias": {str(t): -100 for t in tok.eos_token_ids},
        }
        reply = client.post("/v1/completions", body)
        assert reply.status == 200, reply.text
        assert reply.json["usage"]["completion_tokens"] == 31
        assert reply.json["choices"][0]["finish_reason"] == "length"
        full = client.post("/v1/completions", {**body, "prompt": long_prompt(tok, 256)})
        assert full.status == 400 and full.error["code"] == "context_length_exceeded"
    finally:
        gen.close()
