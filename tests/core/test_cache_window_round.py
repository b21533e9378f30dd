"""Sliding-window speculative rounds: verify in decode order, commit as one-token writes.

A round must leave the window exactly as one-token decoding of the kept
tokens leaves it, and each query of a verify window must attend over the
keys one-token decoding would show it, in the same order (so attention
outputs are bit-equal, not merely close).
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_loom.cache import QuantizedRotatingKVCache, RotatingKVCache
from mlx_loom.errors import CacheError

H, D, MAX = 2, 32, 8


def kv(seed: int, L: int) -> tuple[mx.array, mx.array]:
    k = mx.random.normal((1, H, L, D), key=mx.random.key(2 * seed))
    v = mx.random.normal((1, H, L, D), key=mx.random.key(2 * seed + 1))
    return k, v


def primed(make, history: list[int]):
    """A cache fed ``history`` (chunk sizes) and the same steps' keys, for replay."""
    cache = make()
    for i, n in enumerate(history):
        cache.update_and_fetch(*kv(i, n))
    return cache


def decode_step(cache, q, k, v, window=None):
    """One-token decode as a graph runs it: the mask first, then the write, then attention."""
    mask = cache.make_mask(1, window_size=window)
    return cache.append(k, v).attend(q, scale=0.2, mask=mask)


HISTORIES = [[3], [7], [8], [12], [5, 1, 1, 1, 1], [20, 1, 1, 1], [2, 9, 1]]
MAKERS = {
    "plain": lambda: RotatingKVCache(MAX, 0),
    "keep2": lambda: RotatingKVCache(MAX, 2),
    "quantized": lambda: QuantizedRotatingKVCache(MAX, 0, group_size=32, bits=8),
}


@pytest.mark.parametrize("kind", sorted(MAKERS))
@pytest.mark.parametrize("history", HISTORIES)
@pytest.mark.parametrize("width", [1, 3, 9])
def test_verify_attention_equals_one_token_decode_bit_for_bit(kind, history, width):
    make = MAKERS[kind]
    step, spec = primed(make, history), primed(make, history)
    new_k, new_v = kv(99, width)
    q = mx.random.normal((1, H, width, D), key=mx.random.key(7))
    want = []
    for t in range(width):
        sl = slice(t, t + 1)
        want.append(decode_step(step, q[:, :, sl], new_k[:, :, sl], new_v[:, :, sl]))
    spec.begin_round()
    mask = spec.make_mask(width)
    got = spec.append(new_k, new_v).attend(q, scale=0.2, mask=mask)
    for t in range(width):
        assert mx.array_equal(got[:, :, t : t + 1], want[t]).item(), t


@pytest.mark.parametrize("kind", sorted(MAKERS))
@pytest.mark.parametrize("history", HISTORIES)
@pytest.mark.parametrize("keep", [0, 1, 4, 9])
def test_commit_leaves_the_window_as_one_token_writes_of_the_kept_tokens(kind, history, keep):
    make = MAKERS[kind]
    spec, plain = primed(make, history), primed(make, history)
    new_k, new_v = kv(50, 9)
    spec.begin_round()
    spec.update_and_fetch(new_k[:, :, :4], new_v[:, :, :4])  # two forwards in one round
    spec.update_and_fetch(new_k[:, :, 4:], new_v[:, :, 4:])
    spec.commit(keep)
    for t in range(keep):
        plain.update_and_fetch(new_k[:, :, t : t + 1], new_v[:, :, t : t + 1])
    assert (spec.offset, spec._idx, spec.in_round) == (plain.offset, plain._idx, False)
    assert all(mx.array_equal(a, b).item() for a, b in zip(spec.state, plain.state, strict=True))
    nxt = kv(77, 1)
    assert all(
        mx.array_equal(a, b).item()
        for a, b in zip(spec.update_and_fetch(*nxt), plain.update_and_fetch(*nxt), strict=True)
        if not isinstance(a, tuple)
    )


def test_offset_counts_the_rounds_tokens_for_positions_and_returns_at_commit():
    cache = primed(MAKERS["plain"], [12])
    cache.begin_round()
    cache.update_and_fetch(*kv(1, 3))
    assert cache.offset == 15
    cache.commit(1)
    assert cache.offset == 13


def test_a_narrower_attention_window_is_kept_inside_a_round():
    wide = lambda: RotatingKVCache(12, 0)  # noqa: E731
    step, spec = primed(wide, [14, 1]), primed(wide, [14, 1])
    new_k, new_v = kv(5, 3)
    q = mx.random.normal((1, H, 3, D), key=mx.random.key(3))
    want = []
    for t in range(3):
        sl = slice(t, t + 1)
        want.append(decode_step(step, q[:, :, sl], new_k[:, :, sl], new_v[:, :, sl], window=5))
    spec.begin_round()
    mask = spec.make_mask(3, window_size=5)
    got = spec.append(new_k, new_v).attend(q, scale=0.2, mask=mask)
    assert all(mx.array_equal(got[:, :, t : t + 1], want[t]).item() for t in range(3))


def test_trim_inside_a_round_is_refused_and_names_commit():
    cache = primed(MAKERS["plain"], [3])
    cache.begin_round()
    cache.update_and_fetch(*kv(1, 2))
    with pytest.raises(CacheError, match="commit"):
        cache.trim(1)


def test_commit_outside_the_round_or_beyond_its_tokens_is_refused():
    cache = primed(MAKERS["plain"], [12])
    with pytest.raises(CacheError, match="no open round"):
        cache.commit(0)
    cache.begin_round()
    cache.update_and_fetch(*kv(1, 2))
    with pytest.raises(CacheError, match="outside the round"):
        cache.commit(3)


def test_a_second_begin_round_is_refused():
    cache = primed(MAKERS["plain"], [4])
    cache.begin_round()
    with pytest.raises(CacheError, match="already|open"):
        cache.begin_round()


# --- batches: each row keeps its own count -------------------------------------------


def stacked_rows(histories, maker):
    singles = [primed(maker, h) for h in histories]
    twins = [primed(maker, h) for h in histories]
    return singles, type(singles[0]).stack(twins)


@pytest.mark.parametrize("kind", ["plain", "quantized"])
def test_a_stacked_window_verifies_every_row_in_its_own_decode_order(kind):
    histories = [[3], [12], [5, 1, 1, 1, 1], [20, 1, 1, 1]]
    singles, batch = stacked_rows(histories, MAKERS[kind])
    width = 4
    new_k, new_v = kv(31, width)
    new_k, new_v = mx.repeat(new_k, 4, axis=0), mx.repeat(new_v, 4, axis=0)
    q = mx.random.normal((4, H, width, D), key=mx.random.key(8))
    batch.begin_round()
    mask = batch.make_mask(width)
    got = batch.append(new_k, new_v).attend(q, scale=0.2, mask=mask)
    for i, single in enumerate(singles):
        for t in range(width):
            sl = slice(t, t + 1)
            want = decode_step(single, q[i : i + 1, :, sl], new_k[:1, :, sl], new_v[:1, :, sl])
            assert mx.array_equal(got[i : i + 1, :, sl], want).item(), (i, t)


@pytest.mark.parametrize("kind", ["plain", "quantized"])
def test_a_stacked_commit_keeps_each_rows_own_count(kind):
    histories = [[3], [12], [5, 1, 1, 1, 1], [20, 1, 1, 1]]
    keeps = [0, 3, 1, 4]
    singles, batch = stacked_rows(histories, MAKERS[kind])
    new_k, new_v = kv(41, 4)
    batch.begin_round()
    batch.update_and_fetch(mx.repeat(new_k, 4, axis=0), mx.repeat(new_v, 4, axis=0))
    batch.commit(keeps)
    for i, (single, keep) in enumerate(zip(singles, keeps, strict=True)):
        for t in range(keep):
            single.update_and_fetch(new_k[:, :, t : t + 1], new_v[:, :, t : t + 1])
        row = batch.extract(i)
        assert (row.offset, row._idx) == (single.offset, single._idx % MAX or MAX)
        nxt = kv(90 + i, 1)
        a, b = row.update_and_fetch(*nxt), single.update_and_fetch(*nxt)
        pairs = zip(buf_leaves(a), buf_leaves(b), strict=True)
        assert all(mx.array_equal(x, y).item() for x, y in pairs)


def buf_leaves(pair):
    out = []
    for x in pair:
        out.extend(x if isinstance(x, tuple) else [x])
    return out


def test_a_batch_kv_commit_keeps_each_rows_own_count():
    from mlx_loom.cache import KVCache

    lengths, keeps = [5, 9, 2], [4, 0, 2]
    singles = []
    for i, n in enumerate(lengths):
        c = KVCache()
        c.update_and_fetch(*kv(i, n))
        singles.append(c)
    twins = [KVCache.from_state([a[...] for a in c.state], ()) for c in singles]
    batch = KVCache.stack(twins)
    new_k, new_v = kv(60, 4)
    batch.begin_round()
    batch.update_and_fetch(mx.repeat(new_k, 3, axis=0), mx.repeat(new_v, 3, axis=0))
    batch.commit(keeps)
    q = mx.random.normal((3, H, 1, D), key=mx.random.key(4))
    nk, nv = kv(70, 1)
    mask = batch.make_mask(1)
    got = batch.append(mx.repeat(nk, 3, axis=0), mx.repeat(nv, 3, axis=0)).attend(
        q, scale=0.2, mask=mask
    )
    for i, (single, keep) in enumerate(zip(singles, keeps, strict=True)):
        if keep:
            single.update_and_fetch(new_k[:, :, :keep], new_v[:, :, :keep])
        assert batch.offset[i].item() == single.offset + 1
        qi = q[i : i + 1]
        want = single.append(nk, nv).attend(qi, scale=0.2, mask=None)
        assert mx.array_equal(got[i : i + 1], want).item(), i
