"""KV codecs through every door, for every family: the API, loom generate, loom chat,
and prompt-cache files.

The API's tokens must equal a hand-written greedy loop over the same caches
(converted at the same point, as mlx-lm's ``generate_step`` converts), and a
prompt cache saved and loaded mid-conversation must continue exactly as the
one never saved.
"""

from __future__ import annotations

import io

import mlx.core as mx
import pytest

import mlx_loom
from mlx_loom.cache import maybe_quantize_kv_cache
from mlx_loom.cli.main import main
from mlx_loom.generation import PromptCache
from mlx_loom.testing.checkpoints import write_checkpoint

FAMILIES = ["llama", "qwen3_next", "gemma4_text", "gemma4", "gpt_oss"]
CODECS = [("turboquant", 3), ("turboquant", 4), ("affine", 8)]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    claim = mlx_loom.default_host().registry.model_types[request.param]
    path = tmp_path_factory.mktemp(request.param) / "ckpt"
    ckpt = write_checkpoint(path, claim.tiny_config, claim.checkpoint_tensors(claim.tiny_config))
    return ckpt, mlx_loom.load(ckpt)


def hand_loop(model, prompt, n, *, codec, bits, start=0):
    """Greedy decoding by hand: prefill, convert when due, one token per forward."""
    caches = model.make_cache()
    options = dict(kv_bits=bits, kv_group_size=32, quantized_kv_start=start, kv_codec=codec)
    model(mx.array(prompt[:-1], mx.uint32)[None], caches)
    maybe_quantize_kv_cache(caches, **options)
    token, out = prompt[-1], []
    for _ in range(n):
        logits = model(mx.array([[token]], mx.uint32), caches)[:, -1, :]
        maybe_quantize_kv_cache(caches, **options)
        token = mx.argmax(logits, axis=-1).item()
        out.append(token)
    return out, caches


@pytest.mark.parametrize(("codec", "bits"), CODECS)
def test_stream_generate_with_a_codec_equals_the_hand_loop(family, codec, bits):
    _, (model, tok) = family
    prompt = tok.encode("the model reads a token")
    options = dict(kv_codec=codec, kv_bits=bits, kv_group_size=32, quantized_kv_start=3)
    got = [r.token for r in mlx_loom.stream_generate(model, tok, prompt, max_tokens=8, **options)]
    want, caches = hand_loop(model, prompt, 8, codec=codec, bits=bits, start=3)
    assert got == want
    codecs = {c.codec for c in caches if hasattr(c, "append")}
    assert codecs == {codec}


def test_a_turboquant_prompt_cache_file_continues_like_the_unsaved_cache(family, tmp_path):
    _, (model, tok) = family
    first = tok.encode("the model reads a token")
    options = dict(kv_codec="turboquant", kv_bits=3, max_tokens=5)
    kept, saved = PromptCache(model), PromptCache(model)
    for cache in (kept, saved):
        list(mlx_loom.stream_generate(model, tok, first, prompt_cache=cache, **options))
    assert any(getattr(c, "codec", None) == "turboquant" for c in saved.cache)
    saved.save(tmp_path / "turbo.safetensors")
    loaded = PromptCache.load(tmp_path / "turbo.safetensors", model)
    forms = [(type(c), getattr(c, "codec_key", None)) for c in saved.cache]
    assert [(type(c), getattr(c, "codec_key", None)) for c in loaded.cache] == forms
    longer = kept.tokens + tok.encode(" and writes the next", add_special_tokens=False)
    a = list(mlx_loom.stream_generate(model, tok, longer, prompt_cache=kept, **options))
    b = list(mlx_loom.stream_generate(model, tok, longer, prompt_cache=loaded, **options))
    assert [r.token for r in a] == [r.token for r in b]
    assert b[-1].cached_tokens > len(first)


def test_loom_generate_with_turboquant(family, capsys):
    ckpt, _ = family
    args = ["generate", "--model", str(ckpt), "-p", "hello", "-m", "6", "--verbose"]
    code = main([*args, "--kv-codec", "turboquant", "--kv-bits", "3"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "kv cache: turboquant, 3-bit" in err


def test_loom_chat_with_turboquant_reuses_its_cache(family, capsys, monkeypatch):
    ckpt, _ = family
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\nand then?\n"))
    code = main(["chat", "--model", str(ckpt), "-m", "4", "--stats", "--kv-codec", "turboquant"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert err.count("Generation:") == 2
    assert "reused from cache" in err.split("Prompt:")[2]


def test_an_unknown_codec_is_refused_by_loom_generate(family, capsys):
    ckpt, _ = family
    code = main(["generate", "--model", str(ckpt), "-p", "hi", "--kv-codec", "zstd"])
    err = capsys.readouterr().err
    assert code != 0
    assert "--kv-codec zstd is not a KV cache codec" in err and "turboquant" in err


def test_batch_generate_with_turboquant_equals_each_prompt_alone(family):
    _, (model, tok) = family
    prompts = ["the model reads a token", "hello", "once upon a time there was"]
    options = dict(kv_codec="turboquant", kv_bits=3, max_tokens=6)
    batch = mlx_loom.batch_generate(model, tok, prompts, **options)
    for prompt, result in zip(prompts, batch, strict=True):
        alone = [r.token for r in mlx_loom.stream_generate(model, tok, prompt, **options)]
        # The stream also yields an EOS token, which a batch result leaves out.
        assert result.tokens and result.tokens == alone[: len(result.tokens)]
        assert len(alone) - len(result.tokens) in (0, 1)
