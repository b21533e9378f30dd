"""Stacked rows: a batch of caches whose row ``i`` decodes bit for bit as cache ``i`` alone.

Each row gets its own history first (prefill chunks of different sizes, some
past the window, some mid-rotation), then the rows are stacked and decoded
together; every step's attention output of every row must equal that row's
own cache doing the same step, bit for bit.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_loom.cache import (
    BatchKVCache,
    BatchQuantizedKVCache,
    KVCache,
    QuantizedKVCache,
    QuantizedRotatingKVCache,
    RotatingKVCache,
    StackedQuantizedRotatingKVCache,
    StackedRotatingKVCache,
)
from mlx_loom.errors import CacheError, CacheNotTrimmable, CapabilityRefused

H, D, W = 2, 32, 6
#: Per row: the chunk sizes it was fed alone before joining the batch.
HISTORIES = [[3], [9], [5, 1, 1, 1, 1], [2, 1], [6], [4, 4, 1], []]


def kv(seed: int, L: int, B: int = 1) -> tuple[mx.array, mx.array]:
    k = mx.random.normal((B, H, L, D), key=mx.random.key(2 * seed))
    v = mx.random.normal((B, H, L, D), key=mx.random.key(2 * seed + 1))
    return k, v


def fed(make, history, seed):
    cache = make()
    for j, L in enumerate(history):
        cache.update_and_fetch(*kv(seed * 100 + j, L))
    return cache


def attend(cache, k, v, q, window):
    mask = cache.make_mask(1, window_size=window)
    return cache.append(k, v).attend(q, scale=0.3, mask=mask)


def decode_together(singles, batch, steps, window, seed=500):
    for step in range(steps):
        B = len(singles)
        k, v = kv(seed + step, 1, B)
        q = mx.random.normal((B, 2 * H, 1, D), key=mx.random.key(9000 + seed + step))
        out = attend(batch, k, v, q, window)
        for i, single in enumerate(singles):
            alone = attend(single, k[i : i + 1], v[i : i + 1], q[i : i + 1], window)
            assert mx.array_equal(out[i : i + 1], alone).item(), (step, i)


KINDS = {
    "window": (lambda: RotatingKVCache(W), StackedRotatingKVCache, W),
    "quantized-window": (
        lambda: QuantizedRotatingKVCache(W, group_size=32, bits=4),
        StackedQuantizedRotatingKVCache,
        W,
    ),
    "full": (KVCache, BatchKVCache, None),
    "quantized-full": (
        lambda: QuantizedKVCache(group_size=32, bits=8),
        BatchQuantizedKVCache,
        None,
    ),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_stacked_rows_decode_exactly_as_each_row_alone(kind):
    make, batch_kind, window = KINDS[kind]
    singles = [fed(make, h, i) for i, h in enumerate(HISTORIES)]
    batch = type(singles[0]).stack([fed(make, h, i) for i, h in enumerate(HISTORIES)])
    assert isinstance(batch, batch_kind)
    decode_together(singles, batch, steps=2 * W + 1, window=window)


def test_a_mask_narrower_than_the_window_is_honoured_exactly():
    singles = [fed(lambda: RotatingKVCache(W), h, i) for i, h in enumerate(HISTORIES)]
    batch = RotatingKVCache.stack(
        [fed(lambda: RotatingKVCache(W), h, i) for i, h in enumerate(HISTORIES)]
    )
    decode_together(singles, batch, steps=W + 2, window=4)


@pytest.mark.parametrize("kind", ["window", "quantized-window", "full"])
def test_rows_leave_and_join_without_disturbing_the_others(kind):
    make, _, window = KINDS[kind]
    singles = [fed(make, h, i) for i, h in enumerate(HISTORIES[:4])]
    batch = type(singles[0]).stack([fed(make, h, i) for i, h in enumerate(HISTORIES[:4])])
    decode_together(singles, batch, steps=3, window=window, seed=10)
    batch.filter([3, 0])
    singles = [singles[3], singles[0]]
    decode_together(singles, batch, steps=2, window=window, seed=20)
    newcomers = [fed(make, h, 40 + i) for i, h in enumerate(HISTORIES[4:])]
    batch.extend(
        type(newcomers[0]).stack([fed(make, h, 40 + i) for i, h in enumerate(HISTORIES[4:])])
    )
    decode_together(singles + newcomers, batch, steps=W + 1, window=window, seed=30)


@pytest.mark.parametrize("kind", ["window", "quantized-window", "full", "quantized-full"])
def test_an_extracted_row_continues_exactly_as_the_row_alone(kind):
    make, _, window = KINDS[kind]
    singles = [fed(make, h, i) for i, h in enumerate(HISTORIES)]
    batch = type(singles[0]).stack([fed(make, h, i) for i, h in enumerate(HISTORIES)])
    decode_together(singles, batch, steps=W - 1, window=window, seed=60)
    for row, single in enumerate(singles):
        out = batch.extract(row)
        assert type(out) is type(single) and out.offset == single.offset
        decode_together([single], out, steps=W + 1, window=window, seed=70 + 10 * row)


def test_stacking_refuses_windows_that_keep_leading_tokens():
    with pytest.raises(CapabilityRefused, match="keeps leading tokens"):
        RotatingKVCache.stack([RotatingKVCache(W, keep=2)])


def test_stacking_refuses_mixed_windows_and_kinds():
    with pytest.raises(CacheError, match="different max_size"):
        RotatingKVCache.stack([RotatingKVCache(4), RotatingKVCache(6)])
    with pytest.raises(CacheError, match="quantized differently"):
        StackedRotatingKVCache.stack([RotatingKVCache(4), QuantizedRotatingKVCache(4)])
    with pytest.raises(CacheError, match="quantized differently"):
        QuantizedKVCache.stack([QuantizedKVCache(bits=4), QuantizedKVCache(bits=8)])


def test_a_stacked_window_appends_one_token_per_row_only():
    batch = RotatingKVCache.stack([fed(lambda: RotatingKVCache(W), [3], 0)])
    with pytest.raises(CacheError, match="appending 2 tokens at once"):
        batch.update_and_fetch(*kv(1, 2))
    with pytest.raises(CacheError, match="padded prefill is not supported"):
        batch.prepare(right_padding=[1], lengths=[1])


def test_a_stacked_window_refuses_to_trim():
    batch = RotatingKVCache.stack([fed(lambda: RotatingKVCache(W), [3], 0)])
    assert not batch.is_trimmable() and batch.trim(0) == 0
    with pytest.raises(CacheNotTrimmable, match="extract"):
        batch.trim(1)


@pytest.mark.parametrize("kind", ["window", "quantized-window", "quantized-full"])
def test_stacked_state_round_trips(kind):
    make, batch_kind, window = KINDS[kind]
    batch = type(make()).stack([fed(make, h, i) for i, h in enumerate(HISTORIES[:3])])
    again = batch_kind.from_state(batch.state, batch.meta_state)
    k, v = kv(3, 1, 3)
    q = mx.random.normal((3, 2 * H, 1, D), key=mx.random.key(1))
    assert mx.array_equal(attend(batch, k, v, q, window), attend(again, k, v, q, window)).item()


@pytest.mark.parametrize("kind", ["window", "quantized-window", "full", "quantized-full"])
def test_a_row_put_in_a_rows_place_decodes_exactly_as_the_row_alone(kind):
    """put_row writes a newcomer over a (parked) row in place; it and every other row
    then decode exactly as alone. A row that cannot fit, or of another kind, is
    refused by takes_row, and put_row refuses it too."""
    make, _, window = KINDS[kind]
    histories = [[9], [5, 1, 1, 1, 1], [6], [4, 4, 1]]
    singles = [fed(make, h, i) for i, h in enumerate(histories)]
    batch = type(singles[0]).stack([fed(make, h, i) for i, h in enumerate(histories)])
    decode_together(singles, batch, steps=3, window=window, seed=80)
    newcomer, copy = fed(make, [2, 1], 90), fed(make, [2, 1], 90)
    assert batch.takes_row(newcomer)
    batch.put_row(1, newcomer)  # row 1's owner left: its place is taken
    singles[1] = copy
    decode_together(singles, batch, steps=2 * W + 1, window=window, seed=85)
    if window is None:  # a full batch takes no row longer than its rows
        assert not batch.takes_row(fed(make, [40], 95))
        with pytest.raises(CacheError, match="put_row"):
            batch.put_row(0, fed(make, [40], 95))
    assert not batch.takes_row(object())
