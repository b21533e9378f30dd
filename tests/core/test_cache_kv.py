"""The full KV cache matches mlx-lm's ``KVCache`` bit for bit, and its masks too."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models import base as lm_base
from mlx_lm.models import cache as lm_cache

from mlx_loom.cache import (
    STANDARD_KINDS,
    AttentionCache,
    BatchKVCache,
    BatchQuantizedKVCache,
    BatchRotatingKVCache,
    BatchRows,
    BatchTurboQuantKVCache,
    KVCache,
    QuantizedKVCache,
    QuantizedRotatingKVCache,
    RotatingKVCache,
    Stackable,
    StackedQuantizedRotatingKVCache,
    StackedRotatingKVCache,
    StackedTurboQuantRotatingKVCache,
    TurboQuantKVCache,
    TurboQuantRotatingKVCache,
    create_attention_mask,
    create_causal_mask,
)
from mlx_loom.errors import CacheError

H, D = 2, 32
SCHEDULE = [5, 3, 1, 1, 260, 1, 1, 7, 1]  # prefill chunks, decode, a chunk across a step


def kv(step: int, L: int, B: int = 1, dtype=mx.float32) -> tuple[mx.array, mx.array]:
    k = mx.random.normal((B, H, L, D), key=mx.random.key(2 * step)).astype(dtype)
    v = mx.random.normal((B, H, L, D), key=mx.random.key(2 * step + 1)).astype(dtype)
    return k, v


def same_mask(a, b) -> bool:
    if a is None:
        return b is None
    if isinstance(a, str):
        return isinstance(b, str) and a == b
    return isinstance(b, mx.array) and a.shape == b.shape and mx.array_equal(a, b).item()


def same(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and mx.array_equal(a, b).item()


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_fetched_keys_values_and_offsets_equal_mlx_lm_over_many_steps(dtype):
    ours, theirs = KVCache(), lm_cache.KVCache()
    for step, L in enumerate(SCHEDULE):
        k, v = kv(step, L, dtype=dtype)
        ko, vo = ours.update_and_fetch(k, v)
        kt, vt = theirs.update_and_fetch(k, v)
        assert same(ko, kt) and same(vo, vt)
        assert ours.offset == theirs.offset
        assert ours.keys.shape == theirs.keys.shape  # same growth in 256-slot steps


def test_masks_equal_mlx_lm_for_every_query_count_and_window():
    ours, theirs = KVCache(), lm_cache.KVCache()
    for step, L in enumerate([6, 1, 4]):
        for N in (1, 3):
            for window in (None, 4):
                for return_array in (False, True):
                    mo = ours.make_mask(N, window_size=window, return_array=return_array)
                    mt = theirs.make_mask(N, window_size=window, return_array=return_array)
                    assert same_mask(mo, mt), (step, N, window, return_array)
        ours.update_and_fetch(*kv(step, L))
        theirs.update_and_fetch(*kv(step, L))


def test_attention_output_equals_mlx_lm_with_grouped_heads():
    ours, theirs = KVCache(), lm_cache.KVCache()
    for step, L in enumerate([7, 1, 1]):
        q = mx.random.normal((1, 2 * H, L, D), key=mx.random.key(100 + step))
        k, v = kv(step, L)
        h = mx.zeros((1, L, 8))
        mo = create_attention_mask(h, ours)
        mt = lm_base.create_attention_mask(h, theirs)
        view = ours.append(k, v)
        kt, vt = theirs.update_and_fetch(k, v)
        out = view.attend(q, scale=D**-0.5, mask=mo)
        ref = lm_base.scaled_dot_product_attention(q, kt, vt, theirs, scale=D**-0.5, mask=mt)
        assert same(out, ref)


def test_trim_drops_tokens_like_mlx_lm_and_later_updates_still_match():
    ours, theirs = KVCache(), lm_cache.KVCache()
    for step, L in enumerate([9, 1]):
        ours.update_and_fetch(*kv(step, L))
        theirs.update_and_fetch(*kv(step, L))
    assert ours.is_trimmable()
    assert ours.trim(3) == theirs.trim(3) == 3
    assert ours.trim(100) == theirs.trim(100) == 7  # clamps to the tokens held
    for step, L in enumerate([4, 1, 300], start=10):
        ko, vo = ours.update_and_fetch(*kv(step, L))
        kt, vt = theirs.update_and_fetch(*kv(step, L))
        assert same(ko, kt) and same(vo, vt) and ours.offset == theirs.offset


def test_trim_rejects_a_negative_count():
    cache = KVCache()
    cache.update_and_fetch(*kv(0, 3))
    with pytest.raises(CacheError, match="KVCache.trim"):
        cache.trim(-1)


def test_state_round_trip_recreates_the_cache_and_its_future():
    cache = KVCache()
    for step, L in enumerate([5, 1, 1]):
        cache.update_and_fetch(*kv(step, L))
    cache.trim(1)
    copy = KVCache.from_state(cache.state, cache.meta_state)
    assert copy.offset == cache.offset == 6
    for step, L in enumerate([1, 4], start=20):
        ka, va = cache.update_and_fetch(*kv(step, L))
        kb, vb = copy.update_and_fetch(*kv(step, L))
        assert same(ka, kb) and same(va, vb)


def test_empty_state_round_trips_to_an_empty_cache():
    copy = KVCache.from_state(KVCache().state, KVCache().meta_state)
    assert copy.empty() and copy.offset == 0 and copy.nbytes == 0


def test_from_state_names_a_wrong_array_count():
    with pytest.raises(CacheError, match="KVCache.from_state"):
        KVCache.from_state([mx.zeros((1,))], ())


def test_size_empty_and_nbytes_follow_the_contents():
    cache = KVCache()
    assert cache.empty() and cache.size() == 0 and cache.nbytes == 0
    cache.update_and_fetch(*kv(0, 3))
    assert not cache.empty() and cache.size() == 3
    assert cache.nbytes == 2 * 1 * H * 256 * D * 4  # one 256-slot float32 step each


def test_to_quantized_equals_mlx_lm_and_keeps_decoding_the_same():
    ours, theirs = KVCache(), lm_cache.KVCache()
    ours.update_and_fetch(*kv(0, 9))
    theirs.update_and_fetch(*kv(0, 9))
    qo, qt = ours.to_quantized(group_size=32, bits=4), theirs.to_quantized(group_size=32, bits=4)
    assert isinstance(qo, QuantizedKVCache) and qo.offset == qt.offset == 9
    for step in range(1, 4):
        ko, vo = qo.update_and_fetch(*kv(step, 1))
        kt, vt = qt.update_and_fetch(*kv(step, 1))
        assert all(same(a, b) for a, b in zip((*ko, *vo), (*kt, *vt), strict=True))


def test_empty_batch_is_an_empty_batch_cache_with_the_given_padding():
    batch = KVCache().empty_batch([2, 0])
    assert isinstance(batch, BatchKVCache) and batch.empty()
    assert batch.left_padding.tolist() == [2, 0] and batch.offset.tolist() == [-2, 0]


@pytest.mark.parametrize("offset", [0, 5])
@pytest.mark.parametrize("window", [None, 3])
def test_create_causal_mask_equals_mlx_lm_with_padding(offset, window):
    left, right = [0, 2, 1], [1, 0, 0]
    ours = create_causal_mask(4, offset, window, left_padding=left, right_padding=right)
    ref = lm_base.create_causal_mask(
        4, offset, window, right_padding=mx.array(right), left_padding=mx.array(left)
    )
    assert same(ours, ref)


@pytest.mark.parametrize("N", [1, 4, 9])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("return_array", [False, True])
def test_create_attention_mask_without_a_cache_equals_mlx_lm(N, window, return_array):
    h = mx.zeros((1, N, 8))
    ours = create_attention_mask(h, None, window_size=window, return_array=return_array)
    ref = lm_base.create_attention_mask(h, None, window_size=window, return_array=return_array)
    assert same_mask(ours, ref)


def test_every_standard_kind_satisfies_the_cache_protocols():
    examples = {
        "KVCache": KVCache(),
        "BatchKVCache": BatchKVCache([0]),
        "RotatingKVCache": RotatingKVCache(4),
        "QuantizedKVCache": QuantizedKVCache(),
        "QuantizedRotatingKVCache": QuantizedRotatingKVCache(4),
        "BatchRotatingKVCache": BatchRotatingKVCache(4, [0]),
        "BatchQuantizedKVCache": BatchQuantizedKVCache([0]),
        "StackedRotatingKVCache": StackedRotatingKVCache(4, 1),
        "StackedQuantizedRotatingKVCache": StackedQuantizedRotatingKVCache(4, 1),
        "TurboQuantKVCache": TurboQuantKVCache(),
        "TurboQuantRotatingKVCache": TurboQuantRotatingKVCache(4),
        "BatchTurboQuantKVCache": BatchTurboQuantKVCache([0]),
        "StackedTurboQuantRotatingKVCache": StackedTurboQuantRotatingKVCache(4, 1),
    }
    # Thirteen kinds, five layouts: every codec form is a layout with a codec.
    assert {cls.kind for cls in STANDARD_KINDS} == {
        "KVCache",
        "RotatingKVCache",
        "BatchKVCache",
        "BatchRotatingKVCache",
        "StackedRotatingKVCache",
    }
    assert {type(c).kind for c in examples.values()} == {cls.kind for cls in STANDARD_KINDS}
    for name, cache in examples.items():
        assert isinstance(cache, AttentionCache), name
    for name in ("BatchKVCache", "BatchRotatingKVCache", "BatchQuantizedKVCache"):
        assert isinstance(examples[name], BatchRows), name
    for name in (
        "StackedRotatingKVCache",
        "StackedQuantizedRotatingKVCache",
        "BatchTurboQuantKVCache",
        "StackedTurboQuantRotatingKVCache",
    ):
        assert isinstance(examples[name], BatchRows), name
    for single in ("KVCache", "RotatingKVCache", "QuantizedKVCache", "QuantizedRotatingKVCache"):
        assert isinstance(examples[single], Stackable), single
