"""Speculative decoding: exact rollback through trim or speculative rounds."""

from __future__ import annotations

import pytest

import mlx_loom
from mlx_loom.errors import CacheNotTrimmable, RequestError
from mlx_loom.generate import SamplingParams, generate_tokens, make_sampler
from mlx_loom.generate.speculative import speculative_generate_tokens
from mlx_loom.testing.checkpoints import write_checkpoint
from mlx_loom_gemma4.manifest import TINY_TEXT_CONFIG
from mlx_loom_gemma4.manifest import checkpoint_tensors as gemma_tensors
from mlx_loom_qwen3_next.manifest import TINY_QWEN3_NEXT
from mlx_loom_qwen3_next.manifest import checkpoint_tensors as qwen_tensors

from .conftest import make_llama

PROMPT = [5, 17, 42, 9, 100, 3, 77, 12, 31]


def greedy(model, prompt, steps):
    out = generate_tokens(
        model, prompt, model.make_cache(), sampler=make_sampler(SamplingParams()), max_tokens=steps
    )
    return [t for t, _ in out]


def speculate(model, draft, prompt, steps, k=3):
    return list(speculative_generate_tokens(model, draft, prompt, num_draft=k, max_tokens=steps))


@pytest.mark.parametrize("k", [1, 3, 5])
def test_trimmed_caches_reproduce_greedy_decoding(tmp_path, llama_f32, k):
    model, _ = mlx_loom.load(llama_f32)
    draft, _ = mlx_loom.load(make_llama(tmp_path / "draft", seed=3))
    out = speculate(model, draft, PROMPT, 24, k)
    assert [t for t, _, _ in out] == greedy(model, PROMPT, 24)
    assert not all(d for _, _, d in out)  # a different draft is rejected sometimes


def test_the_model_as_its_own_draft_accepts_every_proposal(llama_f32):
    model, _ = mlx_loom.load(llama_f32)
    out = speculate(model, model, PROMPT, 16)
    assert [t for t, _, _ in out] == greedy(model, PROMPT, 16)
    assert sum(d for _, _, d in out) >= 12


def test_recurrent_caches_roll_back_through_speculative_rounds(tmp_path):
    main = write_checkpoint(tmp_path / "q", TINY_QWEN3_NEXT, qwen_tensors(TINY_QWEN3_NEXT))
    other = write_checkpoint(tmp_path / "d", TINY_QWEN3_NEXT, qwen_tensors(TINY_QWEN3_NEXT), seed=5)
    model, _ = mlx_loom.load(main)
    draft, _ = mlx_loom.load(other)
    out = speculate(model, draft, PROMPT, 20)
    assert [t for t, _, _ in out] == greedy(model, PROMPT, 20)


def test_a_wrapped_sliding_window_refuses_to_roll_back(tmp_path):
    """mlx-lm silently keeps rejected tokens here; we refuse."""
    main = write_checkpoint(tmp_path / "g", TINY_TEXT_CONFIG, gemma_tensors(TINY_TEXT_CONFIG))
    other = write_checkpoint(
        tmp_path / "d", TINY_TEXT_CONFIG, gemma_tensors(TINY_TEXT_CONFIG), seed=9
    )
    model, _ = mlx_loom.load(main)
    draft, _ = mlx_loom.load(other)
    long_prompt = PROMPT * 3  # longer than the sliding window (8)
    with pytest.raises(CacheNotTrimmable):
        speculate(model, draft, long_prompt, 20)


def test_invalid_draft_count_is_refused(llama_f32):
    model, _ = mlx_loom.load(llama_f32)
    with pytest.raises(RequestError, match="num_draft"):
        speculate(model, model, PROMPT, 4, k=0)


def test_stream_generate_with_a_draft_model_streams_the_greedy_text(tmp_path, llama_f32):
    model, tok = mlx_loom.load(llama_f32)
    draft, _ = mlx_loom.load(make_llama(tmp_path / "draft", seed=3))
    plain = mlx_loom.generate(model, tok, "the model reads", max_tokens=20)
    responses = list(
        mlx_loom.stream_generate(model, tok, "the model reads", max_tokens=20, draft_model=draft)
    )
    assert "".join(r.text for r in responses) == plain
    assert responses[-1].finish_reason == "length"


def test_speculative_refuses_options_it_cannot_honour(llama_f32):
    model, tok = mlx_loom.load(llama_f32)
    with pytest.raises(RequestError, match="Speculative decoding does not combine"):
        list(mlx_loom.stream_generate(model, tok, "hi", draft_model=model, repetition_penalty=1.2))


def test_cli_generate_with_a_draft_model(tmp_path, llama_f32, capsys):
    from mlx_loom.cli.main import main

    draft = make_llama(tmp_path / "draft", seed=3)
    code = main(
        [
            "generate",
            "--model",
            str(llama_f32),
            "-p",
            "hi",
            "-m",
            "8",
            "--draft-model",
            str(draft),
            "--num-draft-tokens",
            "2",
        ]
    )
    assert code == 0
    assert "Generation: 8 tokens" in capsys.readouterr().err
