"""Batch caches (per-row left padding) match mlx-lm's ``BatchKVCache`` and
``BatchRotatingKVCache`` bit for bit, including the per-row operations."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models import base as lm_base
from mlx_lm.models import cache as lm_cache

from mlx_loom.cache import (
    BatchKVCache,
    BatchRotatingKVCache,
    KVCache,
    RotatingKVCache,
    maybe_quantize_kv_cache,
)
from mlx_loom.errors import CacheError, CacheNotTrimmable, CapabilityRefused

H, D, MAX = 2, 32, 6


def kv(step: int, L: int, B: int = 3) -> tuple[mx.array, mx.array]:
    k = mx.random.normal((B, H, L, D), key=mx.random.key(2 * step))
    v = mx.random.normal((B, H, L, D), key=mx.random.key(2 * step + 1))
    return k, v


def same(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and mx.array_equal(a, b).item()


def assert_same_cache(ours, theirs) -> None:
    assert (ours.keys is None) == (theirs.keys is None)
    if ours.keys is not None:
        ko, vo = ours.keys_and_values()
        kt, vt = theirs.keys_and_values()
        assert same(ko, kt) and same(vo, vt)
    assert ours.offset.tolist() == theirs.offset.tolist()
    assert ours.left_padding.tolist() == theirs.left_padding.tolist()
    assert ours._idx == theirs._idx


def step_both(ours, theirs, step: int, L: int, B: int = 3, windows=(None,)) -> None:
    """One forward's worth of cache traffic: masks, update, attention, compared."""
    for window in windows:
        mo = ours.make_mask(L, window_size=window)
        mt = theirs.make_mask(L, window_size=window)
        assert same(mo, mt), (step, window)
    q = mx.random.normal((B, 2 * H, L, D), key=mx.random.key(1000 + step))
    mask = ours.make_mask(L)
    k, v = kv(step, L, B)
    view = ours.append(k, v)
    kt, vt = theirs.update_and_fetch(k, v)
    assert same(view.keys, kt) and same(view.values, vt), step
    out = view.attend(q, scale=0.25, mask=mask)
    ref = lm_base.scaled_dot_product_attention(q, kt, vt, theirs, scale=0.25, mask=mask)
    assert same(out, ref)
    assert_same_cache(ours, theirs)


# --- BatchKVCache -----------------------------------------------------------


def test_batch_kv_prefill_and_decode_equal_mlx_lm():
    ours, theirs = BatchKVCache([1, 3, 0]), lm_cache.BatchKVCache([1, 3, 0])
    for step, L in enumerate([4, 1, 1, 1, 3, 1]):
        step_both(ours, theirs, step, L, windows=(None, 3))


def test_batch_kv_right_padded_prefill_then_finalize_equals_mlx_lm():
    ours, theirs = BatchKVCache([0, 0, 0]), lm_cache.BatchKVCache([0, 0, 0])
    for c in (ours, theirs):
        c.prepare(lengths=[5, 3, 4], right_padding=[0, 2, 1])
    step_both(ours, theirs, 0, 5)
    ours.finalize()
    theirs.finalize()
    assert_same_cache(ours, theirs)
    for step in range(1, 4):
        step_both(ours, theirs, step, 1)


def test_batch_kv_left_padding_declared_in_prepare_equals_mlx_lm():
    ours, theirs = BatchKVCache([0, 0, 0]), lm_cache.BatchKVCache([0, 0, 0])
    ours.prepare(left_padding=[2, 0, 1])
    theirs.prepare(left_padding=[2, 0, 1])
    step_both(ours, theirs, 0, 4)


def test_batch_kv_left_padding_after_content_is_refused():
    cache = BatchKVCache([0, 0, 0])
    cache.update_and_fetch(*kv(0, 2))
    with pytest.raises(CacheError, match="empty cache"):
        cache.prepare(left_padding=[1, 0, 0])


def test_batch_kv_filter_extend_extract_equal_mlx_lm():
    ours, theirs = BatchKVCache([1, 3, 0]), lm_cache.BatchKVCache([1, 3, 0])
    for step, L in enumerate([4, 1, 1]):
        step_both(ours, theirs, step, L)
    ours.filter([2, 1])
    theirs.filter([2, 1])
    assert_same_cache(ours, theirs)  # the shared padding column was dropped
    other_o, other_t = BatchKVCache([0, 2]), lm_cache.BatchKVCache([0, 2])
    step_both(other_o, other_t, 10, 3, B=2)
    ours.extend(other_o)
    theirs.extend(other_t)
    assert_same_cache(ours, theirs)
    for step in range(20, 23):
        step_both(ours, theirs, step, 1, B=4)
    for row in range(4):
        eo, et = ours.extract(row), theirs.extract(row)
        assert isinstance(eo, KVCache) and eo.offset == et.offset
        assert same(eo.keys, et.keys) and same(eo.values, et.values)


def test_batch_kv_extract_is_independent_of_the_batch():
    cache = BatchKVCache([0, 1])
    cache.update_and_fetch(*kv(0, 3, B=2))
    row = cache.extract(1)
    before = mx.array(row.keys)
    cache.update_and_fetch(*kv(1, 1, B=2))
    assert row.offset == 2 and same(row.keys, before)


def test_batch_kv_merge_of_single_caches_equals_mlx_lm():
    singles_o, singles_t = [], []
    for i, n in enumerate([3, 7, 1]):
        o, t = KVCache(), lm_cache.KVCache()
        k, v = kv(30 + i, n, B=1)
        o.update_and_fetch(k, v)
        t.update_and_fetch(k, v)
        singles_o.append(o)
        singles_t.append(t)
    ours, theirs = KVCache.merge(singles_o), lm_cache.KVCache.merge(singles_t)
    assert isinstance(ours, BatchKVCache)
    assert_same_cache(ours, theirs)
    for step in range(40, 43):
        step_both(ours, theirs, step, 1)


def test_batch_kv_merge_refuses_a_quantized_member():
    q = KVCache()
    q.update_and_fetch(*kv(0, 2, B=1))
    with pytest.raises(CacheError, match="quantized differently"):
        BatchKVCache.merge([KVCache(), q.to_quantized(group_size=32, bits=4)])


def test_batch_kv_trim_equals_mlx_lm():
    ours, theirs = BatchKVCache([1, 0, 2]), lm_cache.BatchKVCache([1, 0, 2])
    step_both(ours, theirs, 0, 5)
    assert ours.is_trimmable() and ours.trim(2) == theirs.trim(2) == 2
    assert_same_cache(ours, theirs)
    step_both(ours, theirs, 1, 1)


def test_batch_kv_state_round_trip():
    cache = BatchKVCache([1, 0, 2])
    cache.update_and_fetch(*kv(0, 4))
    again = BatchKVCache.from_state(cache.state, cache.meta_state)
    assert_same_cache(again, cache)
    empty = BatchKVCache.from_state(BatchKVCache([1, 2]).state, BatchKVCache([1, 2]).meta_state)
    assert empty.empty() and empty.left_padding.tolist() == [1, 2]


def test_batch_filter_names_out_of_range_rows():
    cache = BatchKVCache([0, 1])
    with pytest.raises(CacheError, match=r"rows \[5\] are out of range for a batch of 2"):
        cache.filter([0, 5])


def test_batch_extend_refuses_another_kind():
    with pytest.raises(CacheError, match="cannot append rows of a BatchRotatingKVCache"):
        BatchKVCache([0]).extend(BatchRotatingKVCache(MAX, [0]))


def test_batch_caches_refuse_kv_quantization():
    caches = [BatchKVCache([0, 1]), BatchRotatingKVCache(MAX, [0, 1])]
    for c in caches:
        with pytest.raises(CapabilityRefused, match="batch cache"):
            c.to_quantized(group_size=32, bits=4)
    with pytest.raises(CapabilityRefused):
        maybe_quantize_kv_cache(caches, kv_bits=4, kv_group_size=32, quantized_kv_start=0)


# --- BatchRotatingKVCache ---------------------------------------------------


@pytest.mark.parametrize(
    "schedule",
    [[5] + [1] * 9 + [3] + [1] * 4, [6, 3, 2, 1, 1], [4, 4, 4, 1, 1, 2], [1] * 8 + [2]],
)
def test_batch_window_prefill_decode_past_window_and_chunks_equal_mlx_lm(schedule):
    ours = BatchRotatingKVCache(MAX, [2, 0, 1])
    theirs = lm_cache.BatchRotatingKVCache(MAX, [2, 0, 1])
    for step, L in enumerate(schedule):
        step_both(ours, theirs, step, L, windows=(None, 4))
        assert (ours._offset, ours.rotated) == (theirs._offset, theirs.rotated)


def test_batch_window_right_padded_prefill_in_chunks_equals_mlx_lm():
    ours = BatchRotatingKVCache(MAX, [0, 0, 0])
    theirs = lm_cache.BatchRotatingKVCache(MAX, [0, 0, 0])
    for c in (ours, theirs):
        c.prepare(lengths=[9, 4, 7], right_padding=[0, 5, 2])
    step_both(ours, theirs, 0, 5)
    step_both(ours, theirs, 1, 4)
    ours.finalize()
    theirs.finalize()
    assert_same_cache(ours, theirs)
    for step in range(2, 9):
        step_both(ours, theirs, step, 1)


def test_batch_window_decode_before_finalize_is_refused():
    cache = BatchRotatingKVCache(MAX, [0, 0, 0])
    cache.prepare(lengths=[3, 2, 1], right_padding=[0, 1, 2])
    cache.update_and_fetch(*kv(0, 3))
    with pytest.raises(CacheError, match="finalize"):
        cache.update_and_fetch(*kv(1, 1))


def test_batch_window_row_operations_equal_mlx_lm():
    ours = BatchRotatingKVCache(MAX, [2, 0, 1])
    theirs = lm_cache.BatchRotatingKVCache(MAX, [2, 0, 1])
    for step, L in enumerate([5, 1, 1, 1, 1]):  # rotated
        step_both(ours, theirs, step, L)
    ours.filter([0, 2])
    theirs.filter([0, 2])
    assert_same_cache(ours, theirs)
    other_o = BatchRotatingKVCache(MAX, [1, 0])
    other_t = lm_cache.BatchRotatingKVCache(MAX, [1, 0])
    step_both(other_o, other_t, 10, 3, B=2)  # not rotated: extend reorders in time
    ours.extend(other_o)
    theirs.extend(other_t)
    assert_same_cache(ours, theirs)
    assert (ours._offset, ours.rotated) == (theirs._offset, theirs.rotated)
    for step in range(20, 27):
        step_both(ours, theirs, step, 1, B=4)
    for row in range(4):
        eo, et = ours.extract(row), theirs.extract(row)
        assert isinstance(eo, RotatingKVCache) and (eo.offset, eo._idx) == (et.offset, et._idx)
        assert same(eo.keys, et.keys) and same(eo.values, et.values)


def test_batch_window_merge_of_single_windows_equals_mlx_lm():
    singles_o, singles_t = [], []
    for i, sched in enumerate([[3], [5, 1, 1, 1, 1], [2, 1]]):
        o, t = RotatingKVCache(MAX), lm_cache.RotatingKVCache(MAX)
        for j, L in enumerate(sched):
            k, v = kv(50 + 10 * i + j, L, B=1)
            o.update_and_fetch(k, v)
            t.update_and_fetch(k, v)
        singles_o.append(o)
        singles_t.append(t)
    ours, theirs = RotatingKVCache.merge(singles_o), lm_cache.RotatingKVCache.merge(singles_t)
    assert isinstance(ours, BatchRotatingKVCache)
    assert_same_cache(ours, theirs)
    for step in range(80, 88):
        step_both(ours, theirs, step, 1)


def test_batch_window_merge_refuses_mixed_windows():
    with pytest.raises(CacheError, match="different max_size"):
        BatchRotatingKVCache.merge([RotatingKVCache(4), RotatingKVCache(6)])


def test_batch_window_trims_before_full_and_refuses_after():
    ours = BatchRotatingKVCache(MAX, [1, 0, 0])
    theirs = lm_cache.BatchRotatingKVCache(MAX, [1, 0, 0])
    step_both(ours, theirs, 0, 4)
    assert ours.trim(1) == theirs.trim(1) == 1
    assert_same_cache(ours, theirs)
    for step in range(1, 5):
        step_both(ours, theirs, step, 1)
    assert not ours.is_trimmable()
    with pytest.raises(CacheNotTrimmable, match=r"BatchRotatingKVCache\(max_size=6\)"):
        ours.trim(1)


def test_batch_window_state_round_trip_mid_rotation():
    cache = BatchRotatingKVCache(MAX, [2, 0, 1])
    for step, L in enumerate([5, 1, 1, 1]):
        cache.update_and_fetch(*kv(step, L))
    again = BatchRotatingKVCache.from_state(cache.state, cache.meta_state)
    assert (again.rotated, again._offset, again.max_size) == (True, 8, MAX)
    for step in range(10, 13):
        ka, _ = cache.update_and_fetch(*kv(step, 1))
        kb, _ = again.update_and_fetch(*kv(step, 1))
        assert same(ka, kb)
        assert same(cache.make_mask(1), again.make_mask(1))
