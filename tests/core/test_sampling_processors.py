"""Logits processors produce mlx-lm's processed logits, bit for bit.

The oracle is ``mlx_lm.sample_utils.make_logits_processors`` with every
penalty's context size set to our shared ``penalty_context_size``. mlx-lm's
repetition and presence processors assign into the logits they are given, so
each side gets its own freshly built logits array.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm import sample_utils as ref

from mlx_loom.engine.logits import (
    FrequencyPenalty,
    LogitBias,
    PresencePenalty,
    RepetitionPenalty,
)
from mlx_loom.engine.params import SamplingParams
from mlx_loom.engine.sampling import apply_logits_processors, make_logits_processors

VOCAB = 48
BATCH = 2

# A history with repeats inside and outside the last-8 window, long enough
# that a context size of 8 cuts it.
HISTORY = [3, 7, 7, 11, 3, 40, 2, 7, 9, 9, 9, 3, 15, 47, 0, 7]


def _logits(dtype=mx.float32, seed: int = 0) -> mx.array:
    """Built fresh per call: mlx-lm's processors mutate the array they are given."""
    return (mx.random.normal((BATCH, VOCAB), key=mx.random.key(seed)) * 5).astype(dtype)


def _tokens(history=HISTORY, dtype=mx.uint32) -> mx.array:
    return mx.array(history, dtype)


def _reference(params: SamplingParams):
    size = params.penalty_context_size
    return ref.make_logits_processors(
        logit_bias=params.logit_bias,
        repetition_penalty=params.repetition_penalty,
        repetition_context_size=size,
        presence_penalty=params.presence_penalty,
        presence_context_size=size,
        frequency_penalty=params.frequency_penalty,
        frequency_context_size=size,
    )


def _assert_matches_mlx_lm(options: dict, dtype, history=HISTORY, seed: int = 0) -> None:
    params = SamplingParams.parse(**options)
    processors = make_logits_processors(params)
    ours = apply_logits_processors(processors, _tokens(history), _logits(dtype, seed))
    theirs = _logits(dtype, seed)
    for processor in _reference(params):
        theirs = processor(_tokens(history), theirs)
    assert ours.dtype == theirs.dtype == dtype
    assert mx.array_equal(ours, theirs).item()
    # The processed logits differ from the input, so equality above is not vacuous.
    assert not mx.array_equal(ours, _logits(dtype, seed)).item()


CASES = {
    "repetition": dict(repetition_penalty=1.3),
    "repetition_below_one": dict(repetition_penalty=0.7),
    "repetition_short_window": dict(repetition_penalty=1.5, penalty_context_size=8),
    "presence": dict(presence_penalty=0.8),
    "presence_negative": dict(presence_penalty=-0.4),
    "presence_short_window": dict(presence_penalty=1.1, penalty_context_size=8),
    "frequency": dict(frequency_penalty=0.3),
    "frequency_short_window": dict(frequency_penalty=0.7, penalty_context_size=8),
    "logit_bias": dict(logit_bias={5: 2.5, 7: -100.0, 47: 0.125}),
    "all_together": dict(
        logit_bias={3: 1.5, 20: -3.0},
        repetition_penalty=1.2,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        penalty_context_size=10,
    ),
}


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_processed_logits_equal_mlx_lm(case, dtype):
    _assert_matches_mlx_lm(CASES[case], dtype)


@pytest.mark.parametrize("step", range(1, len(HISTORY) + 1, 3))
def test_all_processors_equal_mlx_lm_as_history_grows(step):
    _assert_matches_mlx_lm(CASES["all_together"], mx.float32, HISTORY[:step], seed=step)


def test_processors_run_in_mlx_lm_order():
    params = SamplingParams.parse(**CASES["all_together"])
    kinds = [type(p) for p in make_logits_processors(params)]
    assert kinds == [LogitBias, RepetitionPenalty, PresencePenalty, FrequencyPenalty]


def test_int32_history_gives_the_same_logits_as_uint32():
    processors = make_logits_processors(SamplingParams.parse(**CASES["all_together"]))
    a = apply_logits_processors(processors, _tokens(dtype=mx.uint32), _logits())
    b = apply_logits_processors(processors, _tokens(dtype=mx.int32), _logits())
    assert mx.array_equal(a, b).item()


# --- penalty arithmetic, stated directly ----------------------------------------


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = mx.array([[2.0, -2.0, 1.0, 4.0]])
    out = RepetitionPenalty(2.0, context_size=20)(mx.array([0, 1, 1]), logits)
    assert out.tolist() == [[1.0, -4.0, 1.0, 4.0]]


def test_presence_penalty_counts_a_repeated_token_once():
    out = PresencePenalty(0.5, context_size=20)(mx.array([2, 2, 2]), mx.zeros((1, 4)))
    assert out.tolist() == [[0.0, 0.0, -0.5, 0.0]]


def test_frequency_penalty_counts_every_occurrence():
    out = FrequencyPenalty(0.5, context_size=20)(mx.array([2, 2, 2, 0]), mx.zeros((1, 4)))
    assert out.tolist() == [[-0.5, 0.0, -1.5, 0.0]]


def test_penalties_only_see_the_last_context_size_tokens():
    out = PresencePenalty(1.0, context_size=2)(mx.array([0, 1, 2, 3]), mx.zeros((1, 4)))
    assert out.tolist() == [[0.0, 0.0, -1.0, -1.0]]


def test_penalties_apply_to_every_batch_row():
    out = FrequencyPenalty(1.0, context_size=4)(mx.array([1]), mx.zeros((3, 2)))
    assert out.tolist() == [[0.0, -1.0]] * 3


def test_empty_history_leaves_logits_unchanged():
    logits = _logits()
    for processor in make_logits_processors(
        SamplingParams.parse(repetition_penalty=1.3, presence_penalty=1.0, frequency_penalty=1.0)
    ):
        assert mx.array_equal(processor(mx.array([], mx.uint32), logits), logits).item()


def test_processors_do_not_modify_the_logits_they_are_given():
    logits = _logits()
    before = mx.array(logits.tolist())
    params = SamplingParams.parse(**CASES["all_together"])
    apply_logits_processors(make_logits_processors(params), _tokens(), logits)
    assert mx.array_equal(logits, before).item()


# --- which processors are built --------------------------------------------------


def test_default_params_build_no_processors():
    assert make_logits_processors(SamplingParams()) == []


def test_neutral_settings_build_no_processors():
    # Repetition 1.0 and additive 0.0 change no logit; skipping them is exact.
    params = SamplingParams.parse(
        repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, logit_bias={}
    )
    assert make_logits_processors(params) == []


def test_neutral_repetition_penalty_is_bit_identical_to_skipping_it():
    theirs = ref.make_repetition_penalty(1.0, 20)(_tokens(), _logits())
    assert mx.array_equal(theirs, _logits()).item()


def test_each_penalty_uses_the_shared_context_size():
    params = SamplingParams.parse(
        repetition_penalty=1.1, presence_penalty=0.1, frequency_penalty=0.1, penalty_context_size=5
    )
    assert [p.context_size for p in make_logits_processors(params)] == [5, 5, 5]
