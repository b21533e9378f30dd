"""Every family through the user-facing paths: loom generate, loom chat, prompt-cache reuse."""

from __future__ import annotations

import io

import pytest

import mlx_loom
from mlx_loom.cli.main import main
from mlx_loom.generation import PromptCache
from mlx_loom.testing.checkpoints import write_checkpoint

FAMILIES = ["llama", "qwen3_next", "qwen3_5", "gemma4_text", "gemma4", "gpt_oss"]


@pytest.fixture(scope="module", params=FAMILIES)
def family_checkpoint(request, tmp_path_factory):
    claim = mlx_loom.default_host().registry.model_types[request.param]
    path = tmp_path_factory.mktemp(request.param) / "ckpt"
    return write_checkpoint(path, claim.tiny_config, claim.checkpoint_tensors(claim.tiny_config))


def test_loom_generate(family_checkpoint, capsys):
    code = main(["generate", "--model", str(family_checkpoint), "-p", "hello", "-m", "12"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "Generation:" in err and "Peak memory:" in err


def test_loom_chat_two_turns(family_checkpoint, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\nand then?\n"))
    code = main(["chat", "--model", str(family_checkpoint), "-m", "6", "--stats"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert err.count("Generation:") == 2


def test_prompt_cache_reuse_matches_a_fresh_run(family_checkpoint):
    model, tok = mlx_loom.load(family_checkpoint)
    cache = PromptCache(model)
    first = tok.encode("the model reads a token")
    list(mlx_loom.stream_generate(model, tok, first, prompt_cache=cache, max_tokens=5))
    # Extend exactly what the cache holds, so even non-trimmable caches are reused.
    longer = cache.tokens + tok.encode(" and writes the next", add_special_tokens=False)
    reused = list(mlx_loom.stream_generate(model, tok, longer, prompt_cache=cache, max_tokens=12))
    fresh = list(mlx_loom.stream_generate(model, tok, longer, max_tokens=12))
    assert reused[-1].cached_tokens > len(first)
    assert [r.token for r in reused] == [r.token for r in fresh]
