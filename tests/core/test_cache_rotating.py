"""The sliding-window cache matches mlx-lm's ``RotatingKVCache`` and refuses inexact trims."""

from __future__ import annotations

import copy

import mlx.core as mx
import pytest
from mlx_lm.models import base as lm_base
from mlx_lm.models import cache as lm_cache

from mlx_loom.cache import (
    BatchRotatingKVCache,
    QuantizedRotatingKVCache,
    RotatingKVCache,
    create_attention_mask,
)
from mlx_loom.errors import CacheError, CacheNotTrimmable, CapabilityRefused

H, D, MAX = 2, 32, 8
# Prefill chunks, decode past the window (wrapping), a chunk after wrapping, more decode.
SCHEDULES = [
    [5] + [1] * 12 + [3] + [1] * 9,
    [13] + [1] * 10 + [2, 1, 1],
    [1] * 20,
    [3, 4, 6, 1, 1, 9],
]


def kv(step: int, L: int) -> tuple[mx.array, mx.array]:
    k = mx.random.normal((1, H, L, D), key=mx.random.key(2 * step))
    v = mx.random.normal((1, H, L, D), key=mx.random.key(2 * step + 1))
    return k, v


def same(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and mx.array_equal(a, b).item()


def same_mask(a, b) -> bool:
    if a is None:
        return b is None
    if isinstance(a, str):
        return isinstance(b, str) and a == b
    return isinstance(b, mx.array) and same(a, b)


def feed(cache, schedule, start=0):
    for step, L in enumerate(schedule, start=start):
        cache.update_and_fetch(*kv(step, L))


@pytest.mark.parametrize("keep", [0, 2])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_keys_values_offsets_and_masks_equal_mlx_lm_past_the_window(keep, schedule):
    ours, theirs = RotatingKVCache(MAX, keep=keep), lm_cache.RotatingKVCache(MAX, keep=keep)
    for step, L in enumerate(schedule):
        for window in (None, 4):
            for ret in (False, True):
                mo = ours.make_mask(L, window_size=window, return_array=ret)
                mt = theirs.make_mask(L, window_size=window, return_array=ret)
                assert same_mask(mo, mt), (step, L, window, ret)
        k, v = kv(step, L)
        ko, vo = ours.update_and_fetch(k, v)
        kt, vt = theirs.update_and_fetch(k, v)
        assert same(ko, kt) and same(vo, vt), step
        assert (ours.offset, ours._idx, ours.size()) == (theirs.offset, theirs._idx, theirs.size())


def test_attention_outputs_equal_mlx_lm_through_the_window():
    ours, theirs = RotatingKVCache(MAX), lm_cache.RotatingKVCache(MAX)
    for step, L in enumerate(SCHEDULES[0]):
        q = mx.random.normal((1, 2 * H, L, D), key=mx.random.key(500 + step))
        h = mx.zeros((1, L, 4))
        mo = create_attention_mask(h, ours, window_size=6)
        mt = lm_base.create_attention_mask(h, theirs, window_size=6)
        view = ours.append(*kv(step, L))
        kt, vt = theirs.update_and_fetch(*kv(step, L))
        out = view.attend(q, scale=0.25, mask=mo)
        ref = lm_base.scaled_dot_product_attention(q, kt, vt, theirs, scale=0.25, mask=mt)
        assert same(out, ref), step


def test_trim_before_the_window_fills_matches_mlx_lm():
    ours, theirs = RotatingKVCache(MAX, keep=1), lm_cache.RotatingKVCache(MAX, keep=1)
    feed(ours, [4, 1, 1])
    feed(theirs, [4, 1, 1])
    assert ours.is_trimmable() and theirs.is_trimmable()
    assert ours.trim(2) == theirs.trim(2) == 2
    for step, L in enumerate([1, 3, 1, 1, 1, 1, 1], start=30):
        ko, vo = ours.update_and_fetch(*kv(step, L))
        kt, vt = theirs.update_and_fetch(*kv(step, L))
        assert same(ko, kt) and same(vo, vt) and ours.offset == theirs.offset


def test_trim_once_the_window_has_filled_raises_and_names_the_cache():
    cache = RotatingKVCache(MAX)
    feed(cache, [5] + [1] * 6)  # offset 11 > max_size 8: tokens 0..2 are gone
    with pytest.raises(CacheNotTrimmable) as err:
        cache.trim(2)
    message = str(err.value)
    assert "RotatingKVCache" in message and "max_size=8" in message and "offset 11" in message
    assert cache.offset == 11  # nothing changed


def test_mlx_lm_silently_trims_nothing_where_we_refuse():
    # The oracle's behaviour that makes its speculative decoding wrong on
    # sliding-window models: trim_prompt_cache reports 0 and carries on.
    theirs = lm_cache.RotatingKVCache(MAX)
    feed(theirs, [5] + [1] * 6)
    assert lm_cache.trim_prompt_cache([theirs], 2) == 0
    ours = RotatingKVCache(MAX)
    feed(ours, [5] + [1] * 6)
    with pytest.raises(CacheNotTrimmable):
        ours.trim(2)


def test_trimming_zero_tokens_is_exact_even_when_full():
    cache = RotatingKVCache(MAX)
    feed(cache, [10])
    assert cache.trim(0) == 0


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_is_trimmable_agrees_with_trim_at_every_step(schedule):
    cache = RotatingKVCache(MAX, keep=2)
    for step, L in enumerate(schedule):
        cache.update_and_fetch(*kv(step, L))
        probe = copy.deepcopy(cache)
        try:
            probe.trim(1)
            trimmed = True
        except CacheNotTrimmable:
            trimmed = False
        assert trimmed == cache.is_trimmable() == (cache.offset < MAX), step


def test_quantize_is_refused_only_by_mlx_lm_ours_returns_a_quantized_window():
    cache = RotatingKVCache(MAX)
    feed(cache, [3])
    with pytest.raises(NotImplementedError):
        lm_cache.RotatingKVCache(MAX).to_quantized()
    assert isinstance(cache.to_quantized(group_size=32, bits=8), QuantizedRotatingKVCache)


def test_state_round_trip_mid_rotation_recreates_the_window_and_its_future():
    cache = RotatingKVCache(MAX, keep=1)
    feed(cache, [5] + [1] * 7)
    again = RotatingKVCache.from_state(cache.state, cache.meta_state)
    assert (again.offset, again._idx, again.keep, again.max_size) == (12, cache._idx, 1, MAX)
    for step, L in enumerate([1, 1, 4, 1], start=40):
        ka, va = cache.update_and_fetch(*kv(step, L))
        kb, vb = again.update_and_fetch(*kv(step, L))
        assert same(ka, kb) and same(va, vb)


def test_from_state_names_a_non_integer_meta_field():
    cache = RotatingKVCache(MAX)
    feed(cache, [3])
    with pytest.raises(CacheError, match="'offset'"):
        RotatingKVCache.from_state(cache.state, ("0", "8", "three", "3"))


def test_constructor_rejects_a_keep_not_smaller_than_the_window():
    with pytest.raises(CacheError, match="keep=8"):
        RotatingKVCache(8, keep=8)


def test_size_is_capped_by_the_window():
    cache = RotatingKVCache(MAX)
    feed(cache, [3])
    assert cache.size() == 3
    feed(cache, [1] * 10)
    assert cache.size() == MAX and cache.nbytes == 2 * H * MAX * D * 4


def test_empty_batch_builds_a_batch_window_and_refuses_a_kept_prefix():
    batch = RotatingKVCache(MAX).empty_batch([1, 0, 2])
    assert isinstance(batch, BatchRotatingKVCache) and batch.max_size == MAX
    assert batch.left_padding.tolist() == [1, 0, 2]
    with pytest.raises(CapabilityRefused, match="keep=2"):
        RotatingKVCache(MAX, keep=2).empty_batch([0, 0])
