"""XTC ("exclude top choices") picks the token mlx-lm's XTC picks, for the same seed.

mlx-lm's ``apply_xtc`` draws its uniform from MLX's global generator, then
``categorical_sampling`` draws the token: both are deterministic given
``mx.random.seed``, so the oracle is bit-equality of the tokens over many
draws, with the filters XTC sits between (top-p and min-p before it, top-k
after), in float32 and bfloat16, with and without protected tokens.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm import sample_utils as ref

from mlx_loom.engine.params import SamplingParams
from mlx_loom.engine.sampling import logprobs_from_logits, make_sampler
from mlx_loom.errors import RequestError

VOCAB = 64
BATCH = 4
DRAWS = 150
SEED = 99

CASES = {
    "xtc_only": dict(temperature=0.8, xtc_probability=0.5, xtc_threshold=0.1),
    "always": dict(temperature=0.8, xtc_probability=1.0, xtc_threshold=0.05),
    "with_filters": dict(
        temperature=0.8, top_p=0.9, min_p=0.02, top_k=10, xtc_probability=0.5, xtc_threshold=0.1
    ),
    "protected": dict(
        temperature=0.8, xtc_probability=1.0, xtc_threshold=0.05, xtc_special_tokens=[3, 7, 11]
    ),
}


def _logprobs(i: int, dtype) -> mx.array:
    # A peaked distribution, so several tokens clear the threshold.
    logits = mx.random.normal((BATCH, VOCAB), key=mx.random.key(20_000 + i)) * 2.0
    return logprobs_from_logits(logits.astype(dtype))


def _reference(params: SamplingParams):
    return ref.make_sampler(
        temp=params.temperature,
        top_p=params.top_p,
        min_p=params.min_p,
        top_k=params.top_k,
        xtc_probability=params.xtc_probability,
        xtc_threshold=params.xtc_threshold,
        xtc_special_tokens=list(params.xtc_special_tokens or ()),
    )


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_xtc_tokens_equal_mlx_lm_for_same_seed(case, dtype):
    params = SamplingParams.parse(seed=SEED, **CASES[case])
    ours, theirs = make_sampler(params), _reference(params)
    mx.random.seed(SEED)
    mine, oracle = [], []
    for i in range(DRAWS):
        lp = _logprobs(i, dtype)
        mine.append(ours(lp))
        oracle.append(theirs(lp))
    assert mx.array_equal(mx.stack(mine), mx.stack(oracle)).item()


def test_xtc_changes_what_is_drawn():
    # The parity above means something only if XTC moves tokens: with
    # probability 1 the most likely token of a peaked row is never drawn.
    lp = logprobs_from_logits(mx.array([[4.0, 3.0, 0.0, -1.0] + [-9.0] * 60]))
    plain = make_sampler(SamplingParams.parse(temperature=1.0, seed=0))
    xtc = make_sampler(
        SamplingParams.parse(temperature=1.0, seed=0, xtc_probability=1.0, xtc_threshold=0.1)
    )
    plain_tokens = {plain(lp).item() for _ in range(60)}
    xtc_tokens = {xtc(lp).item() for _ in range(60)}
    assert 0 in plain_tokens
    assert 0 not in xtc_tokens and 1 in xtc_tokens


def test_a_protected_token_is_never_cut():
    lp = logprobs_from_logits(mx.array([[4.0, 3.0, 0.0, -1.0] + [-9.0] * 60]))
    params = SamplingParams.parse(
        temperature=1.0, seed=0, xtc_probability=1.0, xtc_threshold=0.1, xtc_special_tokens=[0]
    )
    assert 0 in {make_sampler(params)(lp).item() for _ in range(60)}


@pytest.mark.parametrize(
    ("options", "param"),
    [
        (dict(xtc_probability=1.5), "xtc_probability"),
        (dict(xtc_probability=float("nan")), "xtc_probability"),
        (dict(xtc_threshold=0.6), "xtc_threshold"),
        (dict(xtc_threshold=True), "xtc_threshold"),
        (dict(xtc_special_tokens=[-1]), "xtc_special_tokens"),
    ],
)
def test_out_of_range_xtc_values_are_named(options, param):
    with pytest.raises(RequestError) as info:
        SamplingParams.parse(**options)
    assert info.value.param == param and info.value.fix
