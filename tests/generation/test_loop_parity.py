"""The token loop against mlx-lm's ``generate_step`` on the same checkpoint.

Same graph ops, same caches, same loop order: greedy tokens must be identical
over 64 steps and the log-probabilities bit-equal at every step.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors as lm_processors
from mlx_lm.sample_utils import make_sampler as lm_sampler
from mlx_lm.utils import load_model

import mlx_loom
from mlx_loom.generation import (
    SamplingParams,
    generate_tokens,
    make_logits_processors,
    make_sampler,
)
from mlx_loom.generation.loop import KVQuantization

STEPS = 64


def prompt_ids(n: int, vocab: int = 256, seed: int = 7) -> list[int]:
    return mx.random.randint(0, vocab, (n,), key=mx.random.key(seed)).tolist()


def run_ours(path, prompt, *, params=None, steps=STEPS, **loop):
    params = params or SamplingParams()
    # The oracle's own arithmetic (checkpoint dtype, MLX operations): bit-equal.
    model, _ = mlx_loom.load(path, compute_dtype="checkpoint", cpu_kernels="cpu-ops")
    out = generate_tokens(
        model,
        prompt,
        model.make_cache(),
        sampler=make_sampler(params),
        processors=make_logits_processors(params),
        max_tokens=steps,
        **loop,
    )
    return [(t, lp) for t, lp in out]


def run_oracle(path, prompt, *, steps=STEPS, seed=None, **kwargs):
    model, _ = load_model(path)
    if seed is not None:
        mx.random.seed(seed)
    return [(t, lp) for t, lp in generate_step(mx.array(prompt), model, max_tokens=steps, **kwargs)]


def assert_identical(ours, theirs):
    assert [t for t, _ in ours] == [t for t, _ in theirs]
    for step, ((_, a), (_, b)) in enumerate(zip(ours, theirs, strict=True)):
        assert mx.array_equal(a, b), f"log-probabilities differ at step {step}"


@pytest.mark.parametrize("fixture", ["llama_f32", "llama_bf16"])
def test_greedy_tokens_and_logprobs_match_mlx_lm(fixture, request):
    path = request.getfixturevalue(fixture)
    prompt = prompt_ids(19)
    ours = run_ours(path, prompt, prefill_step_size=8)
    theirs = run_oracle(path, prompt, prefill_step_size=8)
    assert len(ours) == STEPS
    assert_identical(ours, theirs)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_kv_matches_mlx_lm(llama_hd32, bits):
    prompt = prompt_ids(21)
    ours = run_ours(llama_hd32, prompt, kv=KVQuantization(bits, 32, 8), prefill_step_size=8)
    theirs = run_oracle(
        llama_hd32,
        prompt,
        kv_bits=bits,
        kv_group_size=32,
        quantized_kv_start=8,
        prefill_step_size=8,
    )
    assert_identical(ours, theirs)


def test_seeded_sampling_matches_mlx_lm(llama_f32):
    prompt = prompt_ids(12)
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=11)
    ours = run_ours(llama_f32, prompt, params=params)
    theirs = run_oracle(
        llama_f32, prompt, seed=11, sampler=lm_sampler(temp=0.9, top_p=0.9, top_k=40)
    )
    assert_identical(ours, theirs)


def test_penalties_match_mlx_lm(llama_f32):
    prompt = prompt_ids(12)
    params = SamplingParams(repetition_penalty=1.5, penalty_context_size=16)
    ours = run_ours(llama_f32, prompt, params=params)
    theirs = run_oracle(
        llama_f32,
        prompt,
        logits_processors=lm_processors(repetition_penalty=1.5, repetition_context_size=16),
    )
    assert_identical(ours, theirs)


def test_sliding_window_loop_matches_mlx_lm_past_the_window(llama_sliding):
    prompt = prompt_ids(15)
    assert_identical(
        run_ours(llama_sliding, prompt, prefill_step_size=4),
        run_oracle(llama_sliding, prompt, prefill_step_size=4),
    )
