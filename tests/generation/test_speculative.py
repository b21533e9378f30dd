"""Speculative decoding through the engine: greedy output equals greedy output, every family.

Prompts are longer than every sliding window (the tiny Llama's window is 6,
Gemma 4's is 8), where mlx-lm's speculation is silently wrong for Gemma 4 and
refused for Qwen3-Next; drafts come from a different draft model (rejected
often), from the model itself (accepted always) or from prompt lookup.
"""

from __future__ import annotations

import pytest

import mlx_loom
from mlx_loom.errors import RequestError

from .conftest import SPEC_FAMILIES as FAMILIES
from .conftest import SPEC_PROMPT as PROMPT
from .conftest import make_llama


def tokens(model, prompt=PROMPT, n=20, **options):
    return [r.token for r in mlx_loom.stream_generate(model, None, prompt, max_tokens=n, **options)]


def responses(model, prompt=PROMPT, n=20, **options):
    return list(mlx_loom.stream_generate(model, None, prompt, max_tokens=n, **options))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("k", [1, 4])
def test_a_different_draft_model_gives_the_greedy_tokens_past_the_window(spec_models, family, k):
    model, other = spec_models[family]
    assert tokens(model, draft_model=other, num_draft_tokens=k) == tokens(model)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_model_as_its_own_draft_is_accepted_and_gives_the_greedy_tokens(spec_models, family):
    model, _ = spec_models[family]
    out = responses(model, draft_model=model, num_draft_tokens=3)
    assert [r.token for r in out] == tokens(model)
    assert sum(r.from_draft for r in out) == 15  # 5 windows of 3 accepted drafts + 1


@pytest.mark.parametrize("family", FAMILIES)
def test_ngram_drafting_gives_the_greedy_tokens(spec_models, family):
    model, _ = spec_models[family]
    before = model.engine.stats().engine.draft_tokens
    assert tokens(model, n=24, draft="ngram", num_draft_tokens=4) == tokens(model, n=24)
    assert model.engine.stats().engine.draft_tokens > before  # the repeated prompt is looked up


@pytest.mark.parametrize("family", FAMILIES)
def test_ngram_drafts_of_repeating_text_are_accepted(spec_models, family):
    """A logit bias makes the text repeat one token; prompt lookup then drafts it."""
    model, _ = spec_models[family]
    bias = {"logit_bias": {200: 100.0}}
    out = responses(model, n=16, draft="ngram", num_draft_tokens=4, **bias)
    assert [r.token for r in out] == tokens(model, n=16, **bias) == [200] * 16
    assert sum(r.from_draft for r in out) >= 6  # lookups grow as the repeat does


def test_a_one_token_prompt_speculates_from_empty_caches(spec_models):
    model, other = spec_models["qwen3_next"]
    assert tokens(model, [7], 12, draft_model=other) == tokens(model, [7], 12)


def test_a_cache_that_can_neither_trim_nor_open_a_round_is_refused_before_any_work():
    from mlx_loom.engine.speculative import check_rollback
    from mlx_loom.errors import CacheNotTrimmable

    class Summary:  # a cache kind that only moves forward
        def is_trimmable(self):
            return False

    with pytest.raises(CacheNotTrimmable, match="Summary can neither open a speculative round"):
        check_rollback([Summary()], owner="model")


def test_an_unknown_drafting_mode_is_refused_by_name(spec_models):
    model, _ = spec_models["llama-sliding"]
    with pytest.raises(RequestError, match="'lookahead' is not a drafting mode"):
        tokens(model, draft="lookahead")


def test_draft_model_and_draft_mode_together_are_refused(spec_models):
    model, other = spec_models["llama-sliding"]
    with pytest.raises(RequestError, match="Both draft_model= and draft="):
        tokens(model, draft_model=other, draft="ngram")


@pytest.mark.parametrize("bad", [0, 33, True, 2.0])
def test_an_invalid_draft_count_is_refused(spec_models, bad):
    model, _ = spec_models["llama-sliding"]
    with pytest.raises(RequestError, match="num_draft_tokens"):
        tokens(model, draft="ngram", num_draft_tokens=bad)


def test_a_custom_sampler_is_refused_with_the_reason(spec_models):
    import mlx.core as mx

    model, _ = spec_models["llama-sliding"]
    with pytest.raises(RequestError, match="custom sampler"):
        tokens(model, draft="ngram", sampler=lambda lp: mx.argmax(lp, axis=-1))


def test_stream_generate_with_a_draft_model_streams_the_greedy_text(tmp_path, llama_f32):
    model, tok = mlx_loom.load(llama_f32)
    draft, _ = mlx_loom.load(make_llama(tmp_path / "draft", seed=3))
    plain = mlx_loom.generate(model, tok, "the model reads", max_tokens=20)
    out = list(
        mlx_loom.stream_generate(model, tok, "the model reads", max_tokens=20, draft_model=draft)
    )
    assert "".join(r.text for r in out) == plain
    assert out[-1].finish_reason == "length"


# --- batched: rows keep their own drafts ------------------------------------------------

BATCH_PROMPTS = [PROMPT, PROMPT[3:], [9, 8, 7, 6, 5, 4, 3, 2, 1, 9, 8, 7], PROMPT[:10] * 2]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_batched_speculative_rows_equal_their_greedy_runs(spec_models, family, drafter):
    from mlx_loom.text import Tokenizer

    model, other = spec_models[family]
    tok = Tokenizer.from_dir(model.model_dir)
    options = {"draft_model": other} if drafter == "model" else {"draft": "ngram"}
    stats = model.engine.stats().engine
    out = mlx_loom.batch_generate(model, tok, BATCH_PROMPTS, max_tokens=14, **options)
    after = model.engine.stats().engine
    plain = mlx_loom.batch_generate(model, tok, BATCH_PROMPTS, max_tokens=14)
    assert [r.tokens for r in out.results] == [r.tokens for r in plain.results]
    assert after.peak_decoding >= 2  # the rows decoded as one batch
    assert after.draft_tokens > stats.draft_tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_rows_with_different_drafters_share_one_stacked_verify_batch(spec_models, family):
    """Rows accept different numbers of drafts per step (self-draft, other draft, lookup)."""
    import mlx.core as mx

    from mlx_loom.engine import Engine, Speculation, make_request

    model, other = spec_models[family]
    drafters = [model, other, None]
    prompts = [PROMPT, PROMPT[2:], PROMPT[5:]]
    engine = Engine(model)
    uids = engine.insert(
        [
            make_request(model, None, p, max_tokens=16, speculation=Speculation(d, 3))
            for p, d in zip(prompts, drafters, strict=True)
        ]
    )
    got: dict[int, list[int]] = {u: [] for u in uids}
    shapes = []
    with mx.stream(mx.default_stream(mx.default_device())):
        while engine.has_work:
            for event in engine.step():
                if hasattr(event, "token"):
                    got[event.uid].append(event.token)
            shapes.append([(len(g), g.stacked) for g in engine._groups])
    assert (3, True) in {s for step in shapes for s in step}
    assert [got[u] for u in uids] == [tokens(model, p, 16) for p in prompts]


def test_a_model_split_across_ranks_refuses_speculation(spec_models):
    """The other ranks rebuild requests without the drafter, so they would diverge."""
    from types import SimpleNamespace

    from mlx_loom.engine import Speculation, make_request
    from mlx_loom.errors import ParallelRefused

    model, _ = spec_models["llama-sliding"]
    saved = model.parallel
    model.parallel = SimpleNamespace(mode="tensor", rank=0, size=2)
    try:
        with pytest.raises(ParallelRefused, match="split across ranks"):
            make_request(model, None, PROMPT, speculation=Speculation(None, 3))
    finally:
        model.parallel = saved
