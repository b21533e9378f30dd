"""A KV codec from a third-party plugin: checked by the kit, used by every family unchanged."""

from __future__ import annotations

import mlx.core as mx
import pytest

import mlx_loom
from mlx_loom import PromptCache
from mlx_loom.cache import maybe_quantize_kv_cache
from mlx_loom.errors import CapabilityRefused, RequestError
from mlx_loom.host import PluginHost
from mlx_loom.testing import run_conformance
from mlx_loom.testing.checkpoints import write_checkpoint

from .codec_plugin import CodecPlugin, HalfKVCache, HalfView, ScrambledKVCache

FAMILIES = ["llama", "qwen3_next"]


def test_the_kit_passes_a_conforming_codec_plugin():
    report = run_conformance("halfkv", plugin=CodecPlugin(), collisions=False)
    assert report.passed, report.format()
    result = report.result("kv-codec-kinds")
    assert result.status == "pass" and "test-half" in result.detail


def test_the_kit_fails_a_codec_whose_view_does_not_attend():
    report = run_conformance("scrambled", plugin=CodecPlugin([ScrambledKVCache]), collisions=False)
    result = report.result("kv-codec-kinds")
    assert result.status == "fail" and "off plain" in result.detail


@pytest.fixture(scope="module")
def host():
    return PluginHost(plugins=[("halfkv", CodecPlugin())])


@pytest.mark.parametrize("family", FAMILIES)
def test_a_family_attends_through_the_plugin_codec_without_knowing_it(family, host, tmp_path):
    claim = host.registry.model_types[family]
    ckpt = write_checkpoint(
        tmp_path / "ckpt", claim.tiny_config, claim.checkpoint_tensors(claim.tiny_config)
    )
    model, tok = mlx_loom.load(ckpt, host=host)
    prompt = tok.encode("the model reads a token")
    HalfView.calls.clear()
    got = [
        r.token
        for r in mlx_loom.stream_generate(model, tok, prompt, max_tokens=6, kv_codec="test-half")
    ]
    assert HalfView.calls, "the family never attended through the plugin's view"
    # The same by hand, converting with the model's cache-kind table.
    caches = model.make_cache()
    options = dict(
        kv_bits=None,
        kv_group_size=64,
        quantized_kv_start=0,
        kv_codec="test-half",
        kinds=model.binding.cache_kinds,
    )
    model(mx.array(prompt[:-1], mx.uint32)[None], caches)
    maybe_quantize_kv_cache(caches, **options)
    assert any(type(c) is HalfKVCache for c in caches)
    token, want = prompt[-1], []
    for _ in range(6):
        logits = model(mx.array([[token]], mx.uint32), caches)[:, -1, :]
        token = mx.argmax(logits, axis=-1).item()
        want.append(token)
    assert got == want


def test_a_prompt_cache_of_the_plugin_codec_round_trips_its_file(host, tmp_path):
    claim = host.registry.model_types["llama"]
    ckpt = write_checkpoint(
        tmp_path / "ckpt", claim.tiny_config, claim.checkpoint_tensors(claim.tiny_config)
    )
    model, tok = mlx_loom.load(ckpt, host=host)
    cache = PromptCache(model)
    first = tok.encode("the model reads a token")
    list(
        mlx_loom.stream_generate(
            model, tok, first, prompt_cache=cache, max_tokens=3, kv_codec="test-half"
        )
    )
    assert all(type(c) is HalfKVCache for c in cache.cache)
    cache.save(tmp_path / "half.safetensors")
    loaded = PromptCache.load(tmp_path / "half.safetensors", model)
    assert [type(c) for c in loaded.cache] == [HalfKVCache] * len(cache.cache)
    assert all(
        mx.array_equal(a, b).item()
        for x, y in zip(loaded.cache, cache.cache, strict=True)
        for a, b in zip(x.state, y.state, strict=True)
    )


def test_a_codec_without_a_window_kind_is_refused_for_a_model_with_windows(host, tmp_path):
    claim = host.registry.model_types["gemma4_text"]
    ckpt = write_checkpoint(
        tmp_path / "ckpt", claim.tiny_config, claim.checkpoint_tensors(claim.tiny_config)
    )
    model, tok = mlx_loom.load(ckpt, host=host)
    with pytest.raises(CapabilityRefused, match="no cache kind for a RotatingKVCache"):
        list(mlx_loom.stream_generate(model, tok, "hi", max_tokens=2, kv_codec="test-half"))


def test_without_the_plugin_the_codec_is_an_unknown_name(tmp_path):
    claim = mlx_loom.default_host().registry.model_types["llama"]
    ckpt = write_checkpoint(
        tmp_path / "ckpt", claim.tiny_config, claim.checkpoint_tensors(claim.tiny_config)
    )
    model, tok = mlx_loom.load(ckpt)
    with pytest.raises(RequestError, match="test-half"):
        list(mlx_loom.stream_generate(model, tok, "hi", max_tokens=2, kv_codec="test-half"))
