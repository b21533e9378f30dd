"""Hostile prompt-cache files: refused with a CacheError naming the file, before any use.

Before verification, ``tokens`` that disagreed with the cache length, caches
of another geometry and body bit flips loaded and gave wrong output or raw
MLX errors later, and ``n_arrays = 10**9`` hung building a billion names.
"""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

import mlx_loom
from mlx_loom.cache import save_prompt_cache
from mlx_loom.cache.persist import HEADER_KEY
from mlx_loom.errors import CacheError
from mlx_loom.generation import PromptCache
from mlx_loom.generation.prompt_cache import cache_binding

from .bounded import run_bounded
from .conftest import FAMILIES


@pytest.fixture(scope="module", params=FAMILIES)
def model_and_cache(request, family_dirs, tmp_path_factory):
    model, tok = mlx_loom.load(family_dirs[request.param])
    cache = PromptCache(model)
    prompt = tok.encode("the model reads a token")
    list(mlx_loom.stream_generate(model, tok, prompt, prompt_cache=cache, max_tokens=3))
    path = tmp_path_factory.mktemp("cache") / f"{request.param}.safetensors"
    cache.save(path)
    return model, cache, path


def refuse(path, model, needle: str) -> CacheError:
    with pytest.raises(CacheError, match=needle) as info:
        PromptCache.load(path, model)
    assert str(path) in info.value.message and info.value.fix
    return info.value


def copy(path, tmp_path, name="c.safetensors"):
    target = tmp_path / name
    target.write_bytes(path.read_bytes())
    return target


def test_the_saved_file_itself_loads(model_and_cache):
    model, cache, path = model_and_cache
    assert PromptCache.load(path, model).tokens == cache.tokens


@pytest.mark.parametrize("where", [1, 7, 64])
def test_a_bit_flip_in_the_body_is_refused(model_and_cache, tmp_path, where):
    model, _, path = model_and_cache
    target = copy(path, tmp_path)
    data = bytearray(target.read_bytes())
    data[-where] ^= 0x10
    target.write_bytes(bytes(data))
    refuse(target, model, "do not match the checksum")


def test_a_truncated_file_is_refused(model_and_cache, tmp_path):
    model, _, path = model_and_cache
    target = copy(path, tmp_path)
    target.write_bytes(target.read_bytes()[:-10])
    refuse(target, model, "run past the end of the data section")


def test_tokens_that_disagree_with_the_cache_length_are_refused(model_and_cache, tmp_path):
    model, cache, path = model_and_cache
    target = tmp_path / "tokens.safetensors"
    meta = {
        "tokens": json.dumps(cache.tokens + [1, 2, 3]),
        **cache_binding(model),
    }
    save_prompt_cache(target, cache.cache, meta)
    refuse(target, model, f"the file lists {len(cache.tokens) + 3}")


def test_a_file_not_from_mlx_loom_is_refused(model_and_cache, tmp_path):
    model, _, _ = model_and_cache
    target = tmp_path / "weights.safetensors"
    mx.save_safetensors(str(target), {"w": mx.zeros((2,))})
    refuse(target, model, "not an mlx-loom prompt cache")


def test_an_array_count_of_a_billion_is_refused_at_once(model_and_cache, tmp_path):
    model, _, path = model_and_cache
    target = tmp_path / "bomb.safetensors"
    header = {
        "format": "mlx-loom-prompt-cache",
        "version": 2,
        "layers": [{"kind": "KVCache", "meta_state": [], "n_arrays": 10**9}],
        "metadata": {},
        "checksum": "sha256:" + "0" * 64,
    }
    mx.save_safetensors(str(target), {"0.0": mx.zeros((1,))}, {HEADER_KEY: json.dumps(header)})
    code = """
    import mlx_loom
    from mlx_loom.generation import PromptCache
    model, _ = mlx_loom.load(ARGS["model"])
    PromptCache.load(ARGS["path"], model)
    """
    outcome = run_bounded(
        code, args={"model": str(model.model_dir), "path": str(target)}, timeout_s=60
    )
    outcome.expect_error("CacheError", "n_arrays")
    assert outcome.peak_rss_mb < 1024


def test_a_tensor_count_past_the_header_is_refused(model_and_cache, tmp_path):
    model, cache, path = model_and_cache
    arrays = mx.load(str(path))
    arrays["999.0"] = mx.zeros((1,))
    target = tmp_path / "extra.safetensors"
    header = mx.load(str(path), return_metadata=True)[1]
    mx.save_safetensors(str(target), arrays, header)
    refuse(target, model, "do not match its header")
