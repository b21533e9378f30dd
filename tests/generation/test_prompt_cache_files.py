"""Prompt-cache files are verified against the model before use, for every family."""

from __future__ import annotations

import json

import pytest

import mlx_loom
from mlx_loom.cache import save_prompt_cache
from mlx_loom.errors import CacheError
from mlx_loom.generation import PromptCache
from mlx_loom.generation.prompt_cache import cache_binding
from mlx_loom.testing.checkpoints import write_checkpoint

VARIANTS = ["llama", "qwen3_next", "qwen3_5", "gemma4_text", "gemma4"]
# One geometry change per family, same layer count: KV heads (attention),
# the convolution width (recurrent state), the sliding window (rotating cache).
OTHER_GEOMETRY = {
    "llama": {"num_key_value_heads": 2},
    "qwen3_next": {"linear_conv_kernel_dim": 3},
    "gemma4_text": {"sliding_window": 16},
}


def checkpoint(tmp_path_factory, family: str, **changes):
    claim = mlx_loom.default_host().registry.model_types[family]
    config = {**claim.tiny_config, **changes}
    path = tmp_path_factory.mktemp(family) / "ckpt"
    return write_checkpoint(path, config, claim.checkpoint_tensors(config))


@pytest.fixture(scope="module", params=VARIANTS)
def loaded(request, tmp_path_factory):
    return mlx_loom.load(checkpoint(tmp_path_factory, request.param))


def filled(model, tok, text: str = "the model reads a token") -> PromptCache:
    cache = PromptCache(model)
    list(mlx_loom.stream_generate(model, tok, tok.encode(text), prompt_cache=cache, max_tokens=3))
    return cache


def forge(path, caches, model, tokens) -> None:
    """A correctly checksummed file claiming ``model``: only the contents can be wrong."""
    save_prompt_cache(
        path,
        caches,
        {
            "tokens": json.dumps(tokens),
            **cache_binding(model),
        },
    )


def test_a_saved_cache_reloads_and_continues_exactly_like_a_fresh_run(loaded, tmp_path):
    model, tok = loaded
    cache = filled(model, tok)
    cache.save(tmp_path / "p.safetensors")
    restored = PromptCache.load(tmp_path / "p.safetensors", model)
    assert restored.tokens == cache.tokens
    longer = restored.tokens + tok.encode(" and writes", add_special_tokens=False)
    reused = list(mlx_loom.stream_generate(model, tok, longer, prompt_cache=restored, max_tokens=6))
    fresh = list(mlx_loom.stream_generate(model, tok, longer, max_tokens=6))
    assert reused[-1].cached_tokens == len(cache.tokens)
    assert [r.token for r in reused] == [r.token for r in fresh]


def test_a_token_list_that_disagrees_with_the_cache_length_is_refused(loaded, tmp_path):
    model, tok = loaded
    cache = filled(model, tok)
    path = tmp_path / "short.safetensors"
    forge(path, cache.cache, model, cache.tokens[:-2])
    with pytest.raises(CacheError, match=f"holds {len(cache.tokens)} tokens") as info:
        PromptCache.load(path, model)
    assert "does not fit this model" in info.value.message and info.value.fix


def test_token_ids_outside_the_vocabulary_are_refused(loaded, tmp_path):
    model, tok = loaded
    cache = filled(model, tok)
    path = tmp_path / "vocab.safetensors"
    forge(path, cache.cache, model, [*cache.tokens[:-1], model.vocab_size])
    with pytest.raises(CacheError, match="not a list of token ids"):
        PromptCache.load(path, model)


def test_caches_of_another_family_are_refused(loaded, tmp_path, tmp_path_factory):
    model, tok = loaded
    other_family = "llama" if model.model_type != "llama" else "qwen3_next"
    other, other_tok = mlx_loom.load(checkpoint(tmp_path_factory, other_family))
    cache = filled(other, other_tok)
    path = tmp_path / "other.safetensors"
    forge(path, cache.cache, model, cache.tokens)
    with pytest.raises(CacheError, match="this model uses"):
        PromptCache.load(path, model)


@pytest.mark.parametrize("family", sorted(OTHER_GEOMETRY))
def test_caches_of_another_geometry_are_refused_before_use(family, tmp_path, tmp_path_factory):
    model, tok = mlx_loom.load(checkpoint(tmp_path_factory, family))
    other, _ = mlx_loom.load(checkpoint(tmp_path_factory, family, **OTHER_GEOMETRY[family]))
    cache = filled(other, tok)
    path = tmp_path / "geometry.safetensors"
    forge(path, cache.cache, model, cache.tokens)
    with pytest.raises(CacheError, match="does not fit this model") as info:
        PromptCache.load(path, model)
    assert "this model's is" in info.value.message


def test_a_cache_of_another_dtype_is_refused(tmp_path, tmp_path_factory):
    claim = mlx_loom.default_host().registry.model_types["llama"]
    config = claim.tiny_config
    bf16 = {n: (shape, "BF16") for n, (shape, _) in claim.checkpoint_tensors(config).items()}
    # In its own dtype: on the CPU the default float32 compute would give this
    # model float32 caches too (the cache dtype follows the compute dtype).
    model, tok = mlx_loom.load(
        write_checkpoint(tmp_path / "bf16", config, bf16), compute_dtype="checkpoint"
    )
    f32, _ = mlx_loom.load(checkpoint(tmp_path_factory, "llama"))
    cache = filled(f32, tok)
    path = tmp_path / "dtype.safetensors"
    forge(path, cache.cache, model, cache.tokens)
    with pytest.raises(CacheError, match="float32; this model's is bfloat16"):
        PromptCache.load(path, model)


def test_a_kv_quantized_prompt_cache_round_trips(tmp_path, tmp_path_factory):
    model, tok = mlx_loom.load(checkpoint(tmp_path_factory, "llama"))
    cache = PromptCache(model)
    options = {"kv_bits": 4, "kv_group_size": 32}
    list(
        mlx_loom.stream_generate(
            model, tok, "the model", prompt_cache=cache, max_tokens=3, **options
        )
    )
    assert {(type(c).__name__, c.codec, c.bits) for c in cache.cache} == {("KVCache", "affine", 4)}
    cache.save(tmp_path / "q.safetensors")
    restored = PromptCache.load(tmp_path / "q.safetensors", model)
    longer = restored.tokens + tok.encode(" reads", add_special_tokens=False)
    reused = list(
        mlx_loom.stream_generate(model, tok, longer, prompt_cache=restored, max_tokens=4, **options)
    )
    again = PromptCache(model)
    again.cache, again.tokens = cache.cache, list(cache.tokens)
    direct = list(
        mlx_loom.stream_generate(model, tok, longer, prompt_cache=again, max_tokens=4, **options)
    )
    assert [r.token for r in reused] == [r.token for r in direct]


def test_an_empty_prompt_cache_round_trips(tmp_path, tmp_path_factory):
    model, _ = mlx_loom.load(checkpoint(tmp_path_factory, "qwen3_next"))
    PromptCache(model).save(tmp_path / "empty.safetensors")
    restored = PromptCache.load(tmp_path / "empty.safetensors", model)
    assert restored.tokens == [] and all(c.empty() for c in restored.cache)
