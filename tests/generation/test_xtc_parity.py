"""XTC in the token loop against mlx-lm's ``generate_step``, and at the API's door."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.sample_utils import make_sampler as lm_sampler

import mlx_loom
from mlx_loom.engine.request import make_request
from mlx_loom.errors import RequestError
from mlx_loom.generation import SamplingParams

from .test_loop_parity import assert_identical, prompt_ids, run_oracle, run_ours


def test_seeded_xtc_sampling_matches_mlx_lm(llama_f32):
    prompt = prompt_ids(17)
    params = SamplingParams(
        temperature=0.9, xtc_probability=0.6, xtc_threshold=0.005, xtc_special_tokens=(0, 5), seed=4
    )
    ours = run_ours(llama_f32, prompt, params=params)
    theirs = run_oracle(
        llama_f32,
        prompt,
        seed=4,
        sampler=lm_sampler(
            temp=0.9, xtc_probability=0.6, xtc_threshold=0.005, xtc_special_tokens=[0, 5]
        ),
    )
    assert_identical(ours, theirs)
    # Meaningful only if XTC had something to cut (the tiny model is nearly
    # uniform over 256 tokens, hence the low threshold): steps where two or more
    # tokens clear the threshold.
    above = [int((mx.exp(lp) > 0.005).sum().item()) for _, lp in ours]
    assert sum(n >= 2 for n in above) >= 10, above


def test_the_api_protects_eos_and_newline_and_refuses_speculation(llama_f32):
    model, tokenizer = mlx_loom.load(llama_f32)
    params = SamplingParams(temperature=1.0, xtc_probability=0.5)
    request = make_request(model, tokenizer, "hello", max_tokens=4, params=params)
    newline = tokenizer.encode("\n", add_special_tokens=False)
    assert set(request.params.xtc_special_tokens) == {*tokenizer.eos_token_ids, *newline}
    # Given ones are kept as given.
    given = SamplingParams(temperature=1.0, xtc_probability=0.5, xtc_special_tokens=(3,))
    assert make_request(model, tokenizer, "hi", params=given).params.xtc_special_tokens == (3,)
    with pytest.raises(RequestError) as info:
        make_request(
            model,
            tokenizer,
            "hi",
            params=SamplingParams(
                temperature=1.0, xtc_probability=0.5, xtc_special_tokens=(10**6,)
            ),
        )
    assert info.value.param == "xtc_special_tokens"
    text = mlx_loom.generate(
        model, tokenizer, "hello", max_tokens=6, temperature=1.0, seed=1, xtc_probability=1.0
    )
    assert isinstance(text, str)
    with pytest.raises(RequestError) as info:
        mlx_loom.generate(
            model,
            tokenizer,
            "hello",
            max_tokens=4,
            temperature=1.0,
            xtc_probability=0.5,
            draft="ngram",
        )
    assert info.value.param == "xtc_probability"
