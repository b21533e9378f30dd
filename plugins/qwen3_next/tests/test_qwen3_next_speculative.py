"""Speculative rounds through the whole model: a commit equals a fresh forward over the kept tokens.

Delta-net layers roll back with RecurrentCache.begin_round/commit; attention
layers trim their KV caches by the rejected count, as the speculative loop does.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_loom.cache.recurrent import RecurrentCache
from mlx_loom.errors import CacheNotTrimmable

PROMPT = [1, 5, 7, 9, 11, 200, 3, 4, 8, 100, 42, 17]
WINDOW = [23, 99, 4, 180, 61]


def _verify_round(model, cache, window, keep):
    for c in cache:
        if isinstance(c, RecurrentCache):
            c.begin_round()
    logits = model(mx.array([window]), cache=cache)
    for c in cache:
        if isinstance(c, RecurrentCache):
            c.commit(keep)
        else:
            c.trim(len(window) - keep)
    return logits


@pytest.mark.parametrize("kind", ["qwen3_next-fp32", "qwen3_next-q4", "qwen3_5-fp32"])
@pytest.mark.parametrize("keep", [0, 2, 5])
def test_commit_leaves_every_layer_as_a_fresh_forward_over_the_kept_tokens(kind, keep, loaders):
    model = loaders(kind)[0]
    spec, fresh = model.make_cache(), model.make_cache()
    model(mx.array([PROMPT]), cache=spec)
    _verify_round(model, spec, WINDOW, keep)
    model(mx.array([PROMPT]), cache=fresh)
    if keep:
        model(mx.array([WINDOW[:keep]]), cache=fresh)
    for a, b in zip(spec, fresh, strict=True):
        if isinstance(a, RecurrentCache):
            assert mx.array_equal(a.recurrent_state, b.recurrent_state)
            assert mx.array_equal(a.conv_state, b.conv_state)
        assert a.offset == b.offset
    nxt = mx.array([[77]])
    assert mx.array_equal(model(nxt, cache=spec), model(nxt, cache=fresh))


def test_the_verify_logits_of_a_round_equal_a_plain_forward(loaders):
    model = loaders("qwen3_next-fp32")[0]
    spec, plain = model.make_cache(), model.make_cache()
    model(mx.array([PROMPT]), cache=spec)
    model(mx.array([PROMPT]), cache=plain)
    verify = _verify_round(model, spec, WINDOW, 3)
    assert mx.array_equal(verify, model(mx.array([WINDOW]), cache=plain))


def test_greedy_speculation_with_a_draft_gives_the_plain_greedy_tokens(loaders):
    """Draft = the model itself on a perturbed token stream; accepted prefix + correction."""
    model = loaders("qwen3_5-fp32")[0]
    plain = model.make_cache()
    logits = model(mx.array([PROMPT]), cache=plain)
    want = []
    for _ in range(12):
        t = mx.argmax(logits[:, -1], -1)
        want.append(t.item())
        logits = model(t[:, None], cache=plain)

    cache = model.make_cache()
    logits = model(mx.array([PROMPT]), cache=cache)
    got = [mx.argmax(logits[:, -1], -1).item()]
    while len(got) < 12:
        draft = [(want[len(got) + i] if i % 2 == 0 else 3) for i in range(3) if len(got) + i < 12]
        verify = _verify_round_partial(model, cache, [got[-1], *draft])
        got.extend(verify)
    assert got[:12] == want


def _verify_round_partial(model, cache, tokens):
    """Verify [last, *draft]; keep last + accepted drafts; return the new tokens."""
    for c in cache:
        if isinstance(c, RecurrentCache):
            c.begin_round()
    logits = model(mx.array([tokens]), cache=cache)
    preds = mx.argmax(logits[0], -1).tolist()
    accepted = 0
    while accepted < len(tokens) - 1 and preds[accepted] == tokens[accepted + 1]:
        accepted += 1
    keep = 1 + accepted
    for c in cache:
        if isinstance(c, RecurrentCache):
            c.commit(keep)
        else:
            c.trim(len(tokens) - keep)
    return tokens[1:keep] + [preds[accepted]]


def test_the_models_recurrent_caches_refuse_trim(loaders):
    model = loaders("qwen3_next-fp32")[0]
    cache = model.make_cache()
    model(mx.array([PROMPT]), cache=cache)
    kinds = [type(c).__name__ for c in cache]
    assert kinds == ["RecurrentCache", "KVCache", "RecurrentCache", "KVCache"]
    with pytest.raises(CacheNotTrimmable):
        cache[0].trim(1)
