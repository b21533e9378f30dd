"""The sampler picks the token mlx-lm's sampler picks, for the same key.

mlx-lm is the oracle: ``mlx_lm.sample_utils.make_sampler`` seeded through
``mx.random.seed(seed)``, against our ``Sampler`` that owns a key derived from
the same seed. Parity is bit-equality of the chosen tokens over many draws,
and bit-equality of the logits each draw samples from (filters applied,
temperature scaled) — the token check alone would not notice a one-ulp
difference in the filtered logits, so both are checked.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm import sample_utils as ref

from mlx_loom.engine.params import SamplingParams
from mlx_loom.engine.sampling import Sampler, logprobs_from_logits, logprobs_top_k, make_sampler
from mlx_loom.errors import RequestError

VOCAB = 64
BATCH = 4
DRAWS = 150
SEED = 1234

# Each case: our options. mlx-lm gets the same values under its own names.
# The float settings repeat across cases on purpose: mlx-lm bakes each
# distinct float into a freshly built kernel, and a cold kernel cache would
# pay for every distinct value.
CASES = {
    "temperature_only": dict(temperature=0.8),
    "top_p": dict(temperature=0.8, top_p=0.8),
    "top_k": dict(temperature=0.8, top_k=5),
    "min_p": dict(temperature=0.8, min_p=0.2),
    "min_p_keep_several": dict(temperature=0.8, min_p=0.2, min_tokens_to_keep=4),
    "top_p_and_top_k": dict(temperature=0.8, top_p=0.8, top_k=12),
    "top_p_and_min_p": dict(temperature=0.8, top_p=0.8, min_p=0.2),
    "all_filters": dict(temperature=0.8, top_p=0.8, min_p=0.2, min_tokens_to_keep=3, top_k=10),
}


def _reference_sampler(params: SamplingParams):
    return ref.make_sampler(
        temp=params.temperature,
        top_p=params.top_p,
        min_p=params.min_p,
        min_tokens_to_keep=params.min_tokens_to_keep,
        top_k=params.top_k,
    )


def _reference_sampling_logits(params: SamplingParams, logprobs: mx.array) -> mx.array:
    """mlx-lm's filter chain, then the scaling its categorical_sampling applies."""
    if 0 < params.top_p < 1.0:
        logprobs = ref.apply_top_p(logprobs, params.top_p)
    if params.min_p != 0.0:
        logprobs = ref.apply_min_p(logprobs, params.min_p, params.min_tokens_to_keep)
    if params.top_k > 0:
        logprobs = ref.apply_top_k(logprobs, params.top_k)
    return logprobs * (1.0 / params.temperature)


def _logprobs(i: int, dtype=mx.float32, ties: bool = False) -> mx.array:
    """Row-normalised log-probabilities; ``ties`` rounds logits to force equal values."""
    logits = mx.random.normal((BATCH, VOCAB), key=mx.random.key(10_000 + i)) * 3.0
    if ties:
        logits = mx.round(logits)
    return logprobs_from_logits(logits.astype(dtype))


def _assert_tokens_match_mlx_lm(options: dict, dtype, ties: bool) -> None:
    params = SamplingParams.parse(seed=SEED, **options)
    ours = make_sampler(params)
    theirs = _reference_sampler(params)
    mx.random.seed(SEED)
    mine, oracle = [], []
    for i in range(DRAWS):
        lp = _logprobs(i, dtype, ties)
        mine.append(ours(lp))
        oracle.append(theirs(lp))
    mine, oracle = mx.stack(mine), mx.stack(oracle)
    assert mine.dtype == oracle.dtype == mx.uint32
    assert mx.array_equal(mine, oracle).item()


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_tokens_equal_mlx_lm_for_same_seed(case, dtype):
    _assert_tokens_match_mlx_lm(CASES[case], dtype, ties=False)


@pytest.mark.parametrize("case", ["top_p", "top_k", "min_p_keep_several", "all_filters"])
def test_tokens_equal_mlx_lm_when_logprobs_have_ties(case):
    _assert_tokens_match_mlx_lm(CASES[case], mx.bfloat16, ties=True)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_sampling_logits_equal_mlx_lm_bit_for_bit(case, dtype):
    params = SamplingParams.parse(seed=SEED, **CASES[case])
    sampler = make_sampler(params)
    for i in range(8):
        for ties in (False, True):
            lp = _logprobs(i, dtype, ties)
            ours = sampler.sampling_logits(lp)
            assert ours.dtype == dtype
            assert mx.array_equal(ours, _reference_sampling_logits(params, lp)).item()


def test_temperature_scales_by_reciprocal_not_by_division():
    # The parity above is only meaningful if the two roundings differ here.
    lp = _logprobs(0)
    scaled = make_sampler(SamplingParams.parse(temperature=0.7)).sampling_logits(lp)
    assert mx.array_equal(scaled, lp * (1.0 / 0.7)).item()
    assert not mx.array_equal(scaled, lp / 0.7).item()


def test_filters_leave_the_expected_number_of_candidates():
    lp = _logprobs(3)
    sampler = make_sampler(SamplingParams.parse(temperature=1, top_k=5))
    kept = mx.isfinite(sampler.sampling_logits(lp))
    assert kept.sum(axis=-1).tolist() == [5] * BATCH


# --- greedy ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["fp32", "bf16"])
def test_greedy_equals_mlx_lm_greedy(dtype):
    sampler = make_sampler(SamplingParams())
    for i in range(20):
        lp = _logprobs(i, dtype, ties=True)
        assert mx.array_equal(sampler(lp), ref.make_sampler(temp=0.0)(lp)).item()


def test_greedy_ignores_filters_and_does_not_advance_key():
    sampler = make_sampler(SamplingParams.parse(top_k=3, top_p=0.5, seed=1))
    before = sampler.key
    lp = _logprobs(0)
    assert mx.array_equal(sampler(lp), mx.argmax(lp, axis=-1)).item()
    assert mx.array_equal(sampler.key, before).item()


# --- the owned key -------------------------------------------------------------------


def test_owned_key_starts_at_the_key_mx_random_seed_would_set():
    sampler = make_sampler(SamplingParams.parse(temperature=1.0, seed=99))
    assert mx.array_equal(sampler.key, mx.random.key(99)).item()


def test_sampling_does_not_touch_the_global_generator():
    mx.random.seed(5)
    expected = mx.random.uniform(shape=(4,))
    mx.random.seed(5)
    sampler = make_sampler(SamplingParams.parse(temperature=1.0, seed=3))
    for i in range(5):
        sampler(_logprobs(i))
    assert mx.array_equal(mx.random.uniform(shape=(4,)), expected).item()


def test_interleaved_samplers_do_not_perturb_each_other():
    params = SamplingParams.parse(temperature=1.0, top_p=0.9, seed=7)
    alone = make_sampler(params)
    solo = [alone(_logprobs(i)) for i in range(10)]
    a, b = make_sampler(params), make_sampler(params.model_copy(update={"seed": 8}))
    interleaved = []
    for i in range(10):
        interleaved.append(a(_logprobs(i)))
        b(_logprobs(i))
    assert mx.array_equal(mx.stack(interleaved), mx.stack(solo)).item()


def test_different_seeds_give_different_streams():
    lp = _logprobs(0)
    a = make_sampler(SamplingParams.parse(temperature=2.0, seed=1))
    b = make_sampler(SamplingParams.parse(temperature=2.0, seed=2))
    assert not mx.array_equal(
        mx.stack([a(lp) for _ in range(10)]), mx.stack([b(lp) for _ in range(10)])
    ).item()


def test_unseeded_sampler_records_a_seed_that_replays_it():
    params = SamplingParams.parse(temperature=1.5)
    first = make_sampler(params)
    assert first.seed is not None
    replay = make_sampler(params.model_copy(update={"seed": first.seed}))
    run = [first(_logprobs(i)) for i in range(10)]
    again = [replay(_logprobs(i)) for i in range(10)]
    assert mx.array_equal(mx.stack(run), mx.stack(again)).item()


def test_explicit_key_continues_a_stream():
    params = SamplingParams.parse(temperature=1.0, seed=42)
    whole = make_sampler(params)
    tokens = [whole(_logprobs(i)) for i in range(6)]
    head = make_sampler(params)
    for i in range(3):
        head(_logprobs(i))
    tail = Sampler(params, key=head.key)
    assert tail.seed is None
    rest = [tail(_logprobs(i)) for i in range(3, 6)]
    assert mx.array_equal(mx.stack(rest), mx.stack(tokens[3:])).item()


# --- filters that keep the whole vocabulary ----------------------------------------------


def _stream(options: dict, n: int = 20) -> mx.array:
    sampler = make_sampler(SamplingParams.parse(seed=SEED, **options))
    return mx.stack([sampler(_logprobs(i)) for i in range(n)])


def test_top_k_at_least_vocab_size_is_the_same_as_no_top_k():
    # mlx-lm raises for top_k >= vocab; keeping every token is the identity.
    plain = _stream(dict(temperature=1.0))
    assert mx.array_equal(_stream(dict(temperature=1.0, top_k=VOCAB)), plain).item()
    assert mx.array_equal(_stream(dict(temperature=1.0, top_k=10 * VOCAB)), plain).item()


def test_min_tokens_to_keep_at_least_vocab_size_disables_min_p():
    plain = _stream(dict(temperature=1.0))
    kept_all = _stream(dict(temperature=1.0, min_p=0.9, min_tokens_to_keep=VOCAB))
    assert mx.array_equal(kept_all, plain).item()


def test_top_p_of_one_is_the_same_as_no_top_p():
    assert mx.array_equal(
        _stream(dict(temperature=0.9, top_p=1.0)), _stream(dict(temperature=0.9))
    ).item()


def test_sampler_returns_one_token_per_row():
    tokens = make_sampler(SamplingParams.parse(temperature=1.0, seed=0))(_logprobs(0))
    assert tokens.shape == (BATCH,)
    assert all(0 <= t < VOCAB for t in tokens.tolist())


# --- logprobs_from_logits --------------------------------------------------------------


def test_logprobs_from_logits_matches_mlx_lm_step_normalisation():
    # mlx-lm's generate_step normalises over the whole [1, V] array.
    logits = mx.random.normal((1, VOCAB), key=mx.random.key(0)) * 4
    expected = logits - mx.logsumexp(logits, keepdims=True)
    assert mx.array_equal(logprobs_from_logits(logits), expected).item()


def test_logprobs_from_logits_normalises_each_row():
    logits = mx.random.normal((BATCH, VOCAB), key=mx.random.key(1))
    mass = mx.exp(logprobs_from_logits(logits)).sum(axis=-1)
    assert mx.allclose(mass, mx.ones((BATCH,)), atol=1e-5).item()


# --- logprobs_top_k ---------------------------------------------------------------------


def test_logprobs_top_k_returns_most_likely_first():
    lp = _logprobs(4)
    ids, values = logprobs_top_k(lp, 5)
    assert ids.shape == values.shape == (BATCH, 5)
    expected_ids = mx.argsort(-lp, axis=-1)[:, :5]
    assert mx.array_equal(ids, expected_ids).item()
    assert mx.array_equal(values, mx.take_along_axis(lp, expected_ids, axis=-1)).item()


def test_logprobs_top_k_values_are_exactly_the_reported_tokens_logprobs():
    lp = _logprobs(5, mx.bfloat16, ties=True)
    ids, values = logprobs_top_k(lp, 7)
    assert values.dtype == mx.bfloat16
    assert mx.array_equal(values, mx.take_along_axis(lp, ids, axis=-1)).item()
    assert mx.all(values[:, :-1] >= values[:, 1:]).item()


def test_logprobs_top_k_first_is_the_greedy_token():
    lp = _logprobs(6)
    ids, _ = logprobs_top_k(lp, 3)
    assert mx.array_equal(ids[:, 0], mx.argmax(lp, axis=-1)).item()


def test_logprobs_top_k_of_zero_is_empty():
    ids, values = logprobs_top_k(_logprobs(0), 0)
    assert ids.shape == values.shape == (BATCH, 0)


def test_logprobs_top_k_beyond_vocab_returns_whole_vocab():
    ids, _ = logprobs_top_k(_logprobs(0), VOCAB + 10)
    assert ids.shape == (BATCH, VOCAB)
    assert sorted(ids[0].tolist()) == list(range(VOCAB))


def test_logprobs_top_k_refuses_negative_k():
    with pytest.raises(RequestError, match="k=-1"):
        logprobs_top_k(_logprobs(0), -1)
