"""The shared prefix store: longest usable prefix, put back after each request, LRU bounds."""

from __future__ import annotations

import mlx.core as mx

from mlx_loom.cache import KVCache
from mlx_loom.engine import Engine, EngineSettings, PrefixStore

from .conftest import alone, assert_same_run, drive, ids, request


def turn(engine, model, prompt, max_tokens=6):
    """One request through ``engine``; its run (and the tokens its caches ended holding)."""
    run = drive(engine, {0: [("r", request(model, prompt=prompt, max_tokens=max_tokens))]})["r"]
    return run, prompt + run.tokens


def store_engine(model, **settings):
    return Engine(model, EngineSettings(prompt_cache_size=settings.pop("size", 4), **settings))


def test_a_follow_up_reuses_the_conversation_and_matches_a_fresh_run(loaded):
    model, _ = loaded("llama")
    engine = store_engine(model)
    first, history = turn(engine, model, ids(9, 1))
    follow_up = history + ids(5, 2)
    run, _ = turn(engine, model, follow_up, max_tokens=8)
    # Everything the caches held was reused: the prompt and all generated tokens
    # but the last (never fed).
    assert run.events[0].cached_tokens == len(history) - 1
    assert_same_run(run, alone(model, request(model, prompt=follow_up, max_tokens=8)), "reused")


def test_two_alternating_conversations_both_keep_their_caches(loaded):
    model, _ = loaded("llama")
    engine = store_engine(model)
    _, a = turn(engine, model, ids(7, 1))
    _, b = turn(engine, model, ids(7, 2))
    run_a, _ = turn(engine, model, a + ids(3, 3))
    run_b, _ = turn(engine, model, b + ids(3, 4))
    assert run_a.events[0].cached_tokens > 7 and run_b.events[0].cached_tokens > 7
    assert engine.stats().prefix_hits == 2


def test_the_least_recently_used_entry_is_evicted_first(loaded):
    model, _ = loaded("llama")
    engine = store_engine(model, size=2)
    _, a = turn(engine, model, ids(7, 1))
    _, b = turn(engine, model, ids(7, 2))
    turn(engine, model, b + ids(2, 9))  # b is now the most recently used
    _, c = turn(engine, model, ids(7, 3))  # the store is full: a goes
    assert engine.stats().prefix_entries == 2
    assert turn(engine, model, a + ids(2, 5))[0].events[0].cached_tokens == 0
    assert turn(engine, model, c + ids(2, 6))[0].events[0].cached_tokens > 0


def test_entries_are_evicted_to_fit_the_byte_bound(loaded):
    model, _ = loaded("llama")
    probe = store_engine(model)
    turn(probe, model, ids(7, 1))
    one = probe.stats().prefix_bytes
    engine = store_engine(model, prompt_cache_bytes=one + one // 2)
    _, a = turn(engine, model, ids(7, 1))
    turn(engine, model, ids(7, 2))
    stats = engine.stats()
    assert stats.prefix_entries == 1 and stats.prefix_bytes <= one + one // 2
    assert turn(engine, model, a + ids(2, 5))[0].events[0].cached_tokens == 0


def test_a_trimmable_entry_serves_a_diverging_prompt_up_to_the_divergence(loaded):
    model, _ = loaded("llama")
    engine = store_engine(model)
    shared = ids(8, 1)
    turn(engine, model, shared + ids(4, 2))
    other = shared + ids(4, 3)
    run, _ = turn(engine, model, other)
    assert run.events[0].cached_tokens == len(shared)
    assert_same_run(run, alone(model, request(model, prompt=other, max_tokens=6)), "trimmed")


def test_a_recurrent_cache_is_reused_from_its_checkpoints_only(loaded):
    model, _ = loaded("qwen3_next")
    engine = store_engine(model)
    shared = ids(8, 1)
    prompt = shared + ids(4, 2)
    _, held = turn(engine, model, prompt)
    diverging = shared + ids(4, 3)
    run, _ = turn(engine, model, diverging)
    assert run.events[0].cached_tokens == 0  # a recurrent state cannot be trimmed back
    # The entry's own end holds decoded tokens, which a prefill from nothing does
    # not repeat bit for bit; the regenerated prompt is served from its checkpoint.
    extending = held + ids(3, 4)
    run, _ = turn(engine, model, extending)
    assert run.events[0].cached_tokens == 0
    run, _ = turn(engine, model, prompt)
    assert run.events[0].cached_tokens == len(prompt) - 1
    assert_same_run(run, alone(model, request(model, prompt=prompt, max_tokens=6)), "restored")


def test_handed_out_caches_never_change_the_stored_entry():
    store = PrefixStore(max_entries=4)
    cache = KVCache()
    k = mx.random.normal((1, 1, 5, 8), key=mx.random.key(0))
    cache.update_and_fetch(k, k)
    store.insert("layout", [1, 2, 3, 4, 5], [cache])
    got, reused = store.fetch("layout", [1, 2, 3, 9, 9])
    assert reused == 3 and got[0].offset == 3
    got[0].update_and_fetch(k[:, :, :2] * 0, k[:, :, :2] * 0)
    again, _ = store.fetch("layout", [1, 2, 3, 4, 5, 6])
    assert mx.array_equal(again[0].keys_and_values()[0], k).item()


def test_a_longer_trimmable_entry_replaces_its_prefixes():
    store = PrefixStore(max_entries=4)

    def kv(n):
        c = KVCache()
        c.update_and_fetch(mx.zeros((1, 1, n, 8)), mx.zeros((1, 1, n, 8)))
        return c

    store.insert("layout", [1, 2, 3], [kv(3)])
    store.insert("layout", [1, 2, 3, 4, 5], [kv(5)])
    assert len(store) == 1
    assert store.fetch("layout", [1, 2, 3, 7])[1] == 3
    assert store.fetch("another layout", [1, 2, 3, 7]) is None
