"""Attention views and mixed-codec batches: each row attends exactly as alone.

The views of the plain and affine caches keep mlx-lm's op graphs (their
parity is tested with each kind); here: what graphs rely on from the
protocol, and the mixed-codec batch, whose rows must attend bit for bit as
the same rows alone while they join, leave and are extracted.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_loom.cache import (
    BatchKVCache,
    DonorView,
    KVCache,
    PlainView,
    QuantizedKVCache,
    QuantizedRotatingKVCache,
    RotatingKVCache,
    RowsView,
    TurboQuantKVCache,
    TurboQuantRotatingKVCache,
    append_kv,
)
from mlx_loom.cache.mixed import MixedRowsCache, join_rows, stack_rows
from mlx_loom.errors import CacheError, CacheNotTrimmable

H, D = 2, 64


def kv(seed: int, L: int, B: int = 1) -> tuple[mx.array, mx.array]:
    k = mx.random.normal((B, H, L, D), key=mx.random.key(2 * seed))
    v = mx.random.normal((B, H, L, D), key=mx.random.key(2 * seed + 1))
    return k, v


def same(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and mx.array_equal(a, b).item()


def filled(make, n: int, seed: int):
    cache = make()
    cache.update_and_fetch(*kv(seed, n))
    cache.update_and_fetch(*kv(seed + 50, 1))
    return cache


# --- the protocol ----------------------------------------------------------------------


def test_without_a_cache_the_view_is_the_arrays_themselves():
    k, v = kv(0, 4)
    q = mx.random.normal((1, 2 * H, 4, D), key=mx.random.key(1))
    view = append_kv(None, k, v)
    assert isinstance(view, PlainView)
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.1, mask="causal")
    assert same(view.attend(q, scale=0.1, mask="causal"), ref)


def test_a_cache_without_append_is_refused_by_name():
    class Legacy:
        def update_and_fetch(self, k, v):
            return k, v

    with pytest.raises(CacheError, match="Legacy has no append"):
        append_kv(Legacy(), *kv(0, 1))


def test_a_donor_view_attends_through_the_donors_view_unchanged():
    cache = TurboQuantKVCache(bits=4)
    view = cache.append(*kv(0, 5))
    donor = DonorView(view, offset=5)
    q = mx.random.normal((1, 2 * H, 1, D), key=mx.random.key(2))
    assert donor.view is view
    assert same(donor.attend(q, scale=0.2, mask=None), view.attend(q, scale=0.2, mask=None))


def test_a_rows_view_must_cover_each_row_once():
    view = PlainView(*kv(0, 2))
    with pytest.raises(CacheError, match="exactly once"):
        RowsView((view, view), ((0,), (0,)))


# --- mixed batches ------------------------------------------------------------------------

FULL = [
    KVCache,
    lambda: QuantizedKVCache(group_size=32, bits=4),
    lambda: TurboQuantKVCache(bits=3),
    lambda: TurboQuantKVCache(bits=4),
]
WINDOW = [
    lambda: RotatingKVCache(6),
    lambda: QuantizedRotatingKVCache(6, group_size=32, bits=8),
    lambda: TurboQuantRotatingKVCache(6, bits=4),
]


def step_rows(batch, alone: list, seed: int) -> None:
    """One decode step through the batch and through each row alone: equal outputs."""
    B = len(alone)
    k, v = kv(seed, 1, B)
    q = mx.random.normal((B, 2 * H, 1, D), key=mx.random.key(seed + 999))
    mask = batch.make_mask(1)
    out = append_kv(batch, k, v).attend(q, scale=0.125, mask=mask)
    for i, cache in enumerate(alone):
        m = cache.make_mask(1)
        ref = cache.append(k[i : i + 1], v[i : i + 1]).attend(q[i : i + 1], scale=0.125, mask=m)
        assert same(out[i : i + 1], ref), (seed, i)


@pytest.mark.parametrize("makers", [FULL, WINDOW], ids=["full", "window"])
def test_rows_of_different_codecs_attend_as_alone_through_join_filter_and_extract(makers):
    lengths = [5, 9, 3, 7]
    rows = [filled(m, n, i) for i, (m, n) in enumerate(zip(makers, lengths, strict=False))]
    alone = [filled(m, n, i) for i, (m, n) in enumerate(zip(makers, lengths, strict=False))]
    batch = stack_rows(rows)
    assert isinstance(batch, MixedRowsCache)
    for s in range(3):
        step_rows(batch, alone, 100 + s)
    # A newcomer of the first row's codec joins; two rows leave.
    newcomer, newcomer_alone = filled(makers[0], 4, 40), filled(makers[0], 4, 40)
    batch = join_rows(batch, type(newcomer).stack([newcomer]))
    alone.append(newcomer_alone)
    for s in range(2):
        step_rows(batch, alone, 200 + s)
    keep = [len(alone) - 1, 0, 2]
    batch.filter(keep)
    alone = [alone[i] for i in keep]
    for s in range(2):
        step_rows(batch, alone, 300 + s)
    for i, cache in enumerate(alone):
        back = batch.extract(i)
        assert type(back) is type(cache)
        assert all(same(a, b) for a, b in zip(back.state, cache.state, strict=True))


def test_rows_of_one_codec_still_stack_into_that_codecs_batch():
    rows = [filled(KVCache, n, i) for i, n in enumerate([3, 6])]
    assert type(stack_rows(rows)) is BatchKVCache


def test_the_mixed_batch_offsets_are_each_rows_position():
    rows = [filled(m, n, i) for i, (m, n) in enumerate(zip(FULL, [5, 9, 3, 7], strict=True))]
    assert stack_rows(rows).offset.tolist() == [6, 10, 4, 8]


def test_a_mixed_batch_refuses_what_it_cannot_do_exactly():
    batch = stack_rows([filled(m, 3, i) for i, m in enumerate(FULL[:2])])
    with pytest.raises(CacheError, match="append"):
        batch.update_and_fetch(*kv(0, 1, 2))
    with pytest.raises(CacheNotTrimmable):
        batch.trim(1)
    with pytest.raises(CacheError, match="no single state"):
        _ = batch.state
    with pytest.raises(CacheError, match="padded prefill"):
        batch.prepare(left_padding=[1, 0])
    with pytest.raises(CacheError, match="out of range"):
        batch.extract(2)
