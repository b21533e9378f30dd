"""Prompt caches bound to the weights that produced them.

Before: a cache saved for a model directory still loaded after the
directory's weights were replaced by others of the same shapes, and
generation continued the old weights' state. A saved cache now names the
artifact fingerprint (tensor manifest) and the weight files' identity (name,
size and modification time of each, taken at load).
"""

from __future__ import annotations

import json
import os
import shutil

import mlx.core as mx
import pytest

import mlx_loom
from mlx_loom.cache import save_prompt_cache
from mlx_loom.errors import CacheError
from mlx_loom.generation import PromptCache
from mlx_loom.generation.prompt_cache import cache_binding


@pytest.fixture
def saved(family_dirs, tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(family_dirs["llama"], model_dir)
    model, tok = mlx_loom.load(model_dir)
    cache = PromptCache(model)
    prompt = tok.encode("the model reads a token")
    list(mlx_loom.stream_generate(model, tok, prompt, prompt_cache=cache, max_tokens=2))
    path = tmp_path / "c.safetensors"
    cache.save(path)
    return model_dir, model, cache, path


def test_the_cache_loads_with_the_weights_it_was_saved_with(saved):
    model_dir, _, cache, path = saved
    again, _ = mlx_loom.load(model_dir)
    assert PromptCache.load(path, again).tokens == cache.tokens


def test_replaced_weights_of_the_same_shapes_refuse_the_cache(saved):
    model_dir, _, _, path = saved
    weights = model_dir / "model.safetensors"
    tensors = dict(mx.load(str(weights)))
    tensors = {k: v * 1.5 if mx.issubdtype(v.dtype, mx.floating) else v for k, v in tensors.items()}
    weights.unlink()
    mx.save_safetensors(str(weights), tensors)
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # a later write
    other, _ = mlx_loom.load(model_dir)
    with pytest.raises(CacheError, match="saved with other weights") as info:
        PromptCache.load(path, other)
    assert str(path) in info.value.message and info.value.fix


def test_a_cache_naming_another_artifact_is_refused(saved, tmp_path):
    _, model, cache, _ = saved
    forged = tmp_path / "forged.safetensors"
    meta = {"tokens": json.dumps(cache.tokens), **cache_binding(model)}
    meta["artifact_fingerprint"] = "sha256:" + "0" * 64
    save_prompt_cache(forged, cache.cache, meta)
    with pytest.raises(CacheError, match="saved for artifact fingerprint 'sha256:000"):
        PromptCache.load(forged, model)


def test_a_cache_without_the_binding_is_refused(saved, tmp_path):
    _, model, cache, _ = saved
    old = tmp_path / "old.safetensors"
    meta = {
        "tokens": json.dumps(cache.tokens),
        "implementation": model.implementation.id,
        "model": str(model.model_dir.resolve()),
    }
    save_prompt_cache(old, cache.cache, meta)
    with pytest.raises(CacheError, match="does not name the artifact fingerprint"):
        PromptCache.load(old, model)
