"""A PromptCache steps back to a turn boundary where its caches cannot trim.

``loom chat`` and the Python API keep one conversation in a PromptCache;
when the next prompt diverges from what the caches hold (an edited or
retried turn, a reply the template re-renders differently), a cache that
cannot trim used to start afresh. It now restores the checkpoint the engine
kept at the last turn boundary both share.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

import mlx_loom
from mlx_loom.generation import PromptCache
from mlx_loom.testing.checkpoints import write_checkpoint


@pytest.fixture(scope="module", params=["qwen3_next", "gemma4_text", "llama"])
def loaded(request, tmp_path_factory):
    claim = mlx_loom.default_host().registry.model_types[request.param]
    path = tmp_path_factory.mktemp(request.param) / "ckpt"
    config = claim.tiny_config
    return mlx_loom.load(write_checkpoint(path, config, claim.checkpoint_tensors(config)))


def ids(n: int, seed: int) -> list[int]:
    return mx.random.randint(4, 200, (n,), key=mx.random.key(seed)).tolist()


def run(model, tok, prompt, cache=None):
    out = list(
        mlx_loom.stream_generate(
            model, tok, prompt, prompt_cache=cache, max_tokens=4, temperature=0.0
        )
    )
    return [r.token for r in out], [r.logprobs for r in out], out[0].cached_tokens


def test_an_edited_turn_restores_the_last_shared_turn_boundary(loaded):
    model, tok = loaded
    (eot,) = sorted(tok.eos_token_ids)[:1]
    system = ids(30, 1) + [eot]
    cache = PromptCache(model)
    run(model, tok, system + ids(6, 2) + [eot] + ids(2, 3), cache)
    edited = system + ids(6, 4) + [eot] + ids(2, 3)
    tokens, logprobs, cached = run(model, tok, edited, cache)
    assert cached == len(system)
    fresh_tokens, fresh_logprobs, _ = run(model, tok, edited)
    assert tokens == fresh_tokens
    assert all(mx.array_equal(a, b).item() for a, b in zip(logprobs, fresh_logprobs, strict=True))
    assert cache.tokens[: len(edited)] == edited


def test_with_no_shared_boundary_the_cache_starts_afresh(loaded):
    model, tok = loaded
    cache = PromptCache(model)
    run(model, tok, ids(20, 5), cache)
    _, _, cached = run(model, tok, ids(20, 6), cache)
    assert cached == 0
