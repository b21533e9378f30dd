"""Speculative decoding combined with every request option.

Greedy: the tokens (and the target's log-probabilities, bit for bit) equal
plain decoding's with the same options. Sampling: the accept/reject rule
leaves the output distributed as the target's (checked statistically with
fixed seeds on a tiny vocabulary).
"""

from __future__ import annotations

import collections

import mlx.core as mx
import numpy as np
import pytest

import mlx_loom
from mlx_loom.engine import Speculation, make_request
from mlx_loom.engine.speculative import accept_sampled
from mlx_loom.generation import PromptCache, SamplingParams, make_sampler
from mlx_loom.host import resolve_model
from mlx_loom.loader import build_model
from mlx_loom.testing.checkpoints import write_checkpoint
from mlx_loom_minicpm5.plugin import TINY_CONFIG, checkpoint_tensors

from .conftest import SPEC_FAMILIES as FAMILIES
from .conftest import SPEC_PROMPT as PROMPT
from .test_speculative import responses, tokens

DRAFTERS = {"model": lambda other: {"draft_model": other}, "ngram": lambda _: {"draft": "ngram"}}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
def test_logprobs_are_the_targets_bit_for_bit(spec_models, family, drafter):
    model, other = spec_models[family]
    plain = responses(model, n=12, logprobs=3)
    spec = responses(model, n=12, logprobs=3, **DRAFTERS[drafter](other))
    assert [r.token for r in spec] == [r.token for r in plain]
    assert [r.logprob for r in spec] == [r.logprob for r in plain]
    assert [r.top_logprobs for r in spec] == [r.top_logprobs for r in plain]
    pairs = zip(spec, plain, strict=True)
    assert all(mx.array_equal(a.logprobs, b.logprobs).item() for a, b in pairs)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
def test_penalties_see_each_positions_own_history(spec_models, family, drafter):
    model, other = spec_models[family]
    options = dict(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2)
    want = tokens(model, n=16, **options)
    assert tokens(model, n=16, **options, **DRAFTERS[drafter](other)) == want


@pytest.mark.parametrize("family", FAMILIES)
def test_kv_quantization_speculates_to_the_quantized_greedy_tokens(spec_models, family):
    model, _ = spec_models[family]
    options = dict(kv_bits=8, kv_group_size=32, quantized_kv_start=10)
    want = tokens(model, n=16, **options)
    assert tokens(model, n=16, draft_model=model, **options) == want
    assert tokens(model, n=16, draft="ngram", **options) == want


@pytest.mark.parametrize("family", ["llama-sliding", "gemma4"])
def test_max_kv_size_windows_roll_back_past_the_window(spec_models, family):
    model, other = spec_models[family]
    want = tokens(model, n=16, max_kv_size=10)
    assert tokens(model, n=16, max_kv_size=10, draft_model=other) == want


@pytest.mark.parametrize("family", FAMILIES)
def test_a_prompt_cache_continues_across_speculative_turns(spec_models, family):
    model, other = spec_models[family]
    results = []
    for options in ({}, {"draft_model": other}, {"draft": "ngram"}):
        cache = PromptCache(model)
        first = tokens(model, PROMPT, 6, prompt_cache=cache, **options)
        longer = [*cache.tokens, 11, 12, 13]
        second = tokens(model, longer, 8, prompt_cache=cache, **options)
        results.append((first, second, list(cache.tokens)))
    assert results[0] == results[1] == results[2]


def test_stop_strings_end_a_speculative_window_where_plain_decoding_stops(tmp_path, llama_f32):
    model, tok = mlx_loom.load(llama_f32)
    text = mlx_loom.generate(model, tok, "the model reads", max_tokens=24)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    plain = list(
        mlx_loom.stream_generate(model, tok, "the model reads", max_tokens=24, stop=[stop])
    )
    spec = list(
        mlx_loom.stream_generate(
            model, tok, "the model reads", max_tokens=24, stop=[stop], draft_model=model
        )
    )
    assert "".join(r.text for r in spec) == "".join(r.text for r in plain)
    assert spec[-1].finish_reason == plain[-1].finish_reason == "stop"
    assert [r.token for r in spec] == [r.token for r in plain]


# --- sampling -------------------------------------------------------------------------


def tv(counts: collections.Counter, n: int, p: list[float]) -> float:
    return sum(abs(counts[i] / n - pi) for i, pi in enumerate(p)) / 2


@pytest.mark.parametrize("deterministic", [False, True])
def test_the_accept_reject_rule_samples_the_target_distribution(deterministic):
    """A draft far from the target (q peaks where p is small): the output is still p."""
    p = np.array([0.05, 0.1, 0.4, 0.3, 0.1, 0.05])
    q = np.array([0.7, 0.1, 0.05, 0.05, 0.05, 0.05])
    logprobs = mx.array(np.log(np.stack([p, p])), mx.float32)
    sampler = make_sampler(SamplingParams(temperature=1.0, seed=3))
    rng = np.random.default_rng(0)
    n, first = 1500, collections.Counter()
    for _ in range(n):
        draft = 0 if deterministic else int(rng.choice(6, p=q))
        dist = None if deterministic else mx.array(q[None], mx.float32)
        out, _ = accept_sampled(sampler, logprobs, [draft], dist)
        first[out[0]] += 1
    assert tv(first, n, p.tolist()) < 0.05
    # A rule that kept every draft would give the draft's distribution: far off.
    kept = np.eye(6)[0] if deterministic else q
    assert np.abs(kept - p).sum() / 2 > 0.3


@pytest.fixture(scope="module")
def tiny_vocab(tmp_path_factory):
    """A target and a different draft over a 12-token vocabulary (no tokenizer)."""
    cfg = {**TINY_CONFIG, "vocab_size": 12}
    tensors = {n: (shape, "F32") for n, (shape, _) in checkpoint_tensors(cfg).items()}
    root = tmp_path_factory.mktemp("vocab12")
    return [
        build_model(
            resolve_model(write_checkpoint(root / str(s), cfg, tensors, seed=s, tokenizer=False))
        )
        for s in (0, 4)
    ]


@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
def test_sampled_speculation_draws_the_targets_first_two_tokens(tiny_vocab, drafter):
    model, other = tiny_vocab
    prompt = [1, 2, 3, 4, 5, 6, 1, 2]

    def dist(seq):
        return mx.softmax(model(mx.array([seq]))[0, -1]).tolist()

    p1 = dist(prompt)
    p2 = [0.0] * 12
    for a in range(12):
        for b, pb in enumerate(dist([*prompt, a])):
            p2[b] += p1[a] * pb
    # Submitted at once, so the seeded rows also exercise batched sampling.
    spec = Speculation(other if drafter == "model" else None, num_draft=2)
    n, c1, c2 = 200, collections.Counter(), collections.Counter()
    params = [SamplingParams(temperature=1.0, seed=seed) for seed in range(n)]
    handles = [
        model.engine.submit(
            make_request(model, None, prompt, max_tokens=2, params=p, speculation=spec)
        )
        for p in params
    ]
    for handle in handles:
        out = [e.token for e in handle]
        c1[out[0]] += 1
        c2[out[1]] += 1
    assert tv(c1, n, p1) < 0.15 and tv(c2, n, p2) < 0.15


@pytest.mark.parametrize("family", FAMILIES)
def test_the_engines_prefix_store_serves_speculative_requests(spec_models, family):
    """A second request sharing a prefix reuses the first's caches, speculating exactly."""
    from mlx_loom.engine import Engine, EngineSettings, Speculation, make_request

    model, other = spec_models[family]
    engine = Engine(model, EngineSettings(prompt_cache_size=4))

    def run(prompt):
        request = make_request(model, None, prompt, max_tokens=8, speculation=Speculation(other, 3))
        (uid,) = engine.insert([request])
        events = []
        with mx.stream(mx.default_stream(mx.default_device())):
            while engine.has_work:
                events += [e for e in engine.step() if getattr(e, "uid", None) == uid]
        return [e for e in events if hasattr(e, "token")]

    run(PROMPT)
    # The same prompt again: every cache kind is served (untrimmable ones from the
    # checkpoint kept at the prompt's end).
    out = run(PROMPT)
    assert out[-1].cached_tokens == len(PROMPT) - 1
    assert [e.token for e in out] == tokens(model, PROMPT, 8)
