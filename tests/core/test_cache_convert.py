"""KV quantization switches on where mlx-lm's ``maybe_quantize_kv_cache`` does."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import maybe_quantize_kv_cache as lm_maybe_quantize
from mlx_lm.models import cache as lm_cache

from mlx_loom.cache import (
    KVCache,
    QuantizedKVCache,
    QuantizedRotatingKVCache,
    RotatingKVCache,
    maybe_quantize_kv_cache,
)
from mlx_loom.errors import RequestError

H, D = 2, 64


def kv(step: int, L: int) -> tuple[mx.array, mx.array]:
    k = mx.random.normal((1, H, L, D), key=mx.random.key(2 * step))
    v = mx.random.normal((1, H, L, D), key=mx.random.key(2 * step + 1))
    return k, v


def test_full_caches_convert_once_their_offset_reaches_the_start_like_mlx_lm():
    ours, theirs = [KVCache(), KVCache()], [lm_cache.KVCache(), lm_cache.KVCache()]
    for step in range(6):
        L = 4 if step == 0 else 1
        for i in range(2):
            if i == 1 and step > 2:
                continue  # the second cache stops short of the start
            ours[i].update_and_fetch(*kv(step, L))
            theirs[i].update_and_fetch(*kv(step, L))
        maybe_quantize_kv_cache(ours, kv_bits=4, kv_group_size=64, quantized_kv_start=8)
        lm_maybe_quantize(theirs, quantized_kv_start=8, kv_group_size=64, kv_bits=4)
        for o, t in zip(ours, theirs, strict=True):
            # mlx-lm has a class per codec; ours is the layout with an affine codec.
            ours_name = "QuantizedKVCache" if isinstance(o, QuantizedKVCache) else type(o).__name__
            assert ours_name == type(t).__name__ and o.offset == t.offset
    assert isinstance(ours[0], QuantizedKVCache) and type(ours[1]) is KVCache
    assert ours[1].codec is None
    ko, vo = ours[0].update_and_fetch(*kv(50, 1))
    kt, vt = theirs[0].update_and_fetch(*kv(50, 1))
    assert all(mx.array_equal(a, b).item() for a, b in zip((*ko, *vo), (*kt, *vt), strict=True))


def test_conversion_happens_exactly_at_the_start_offset():
    caches = [KVCache()]
    caches[0].update_and_fetch(*kv(0, 7))
    maybe_quantize_kv_cache(caches, kv_bits=8, kv_group_size=32, quantized_kv_start=8)
    assert type(caches[0]) is KVCache
    caches[0].update_and_fetch(*kv(1, 1))
    maybe_quantize_kv_cache(caches, kv_bits=8, kv_group_size=32, quantized_kv_start=8)
    assert isinstance(caches[0], QuantizedKVCache) and caches[0].bits == 8


def test_rotating_caches_become_quantized_windows():
    caches = [RotatingKVCache(8)]
    caches[0].update_and_fetch(*kv(0, 5))
    maybe_quantize_kv_cache(caches, kv_bits=4, kv_group_size=64, quantized_kv_start=0)
    assert isinstance(caches[0], QuantizedRotatingKVCache) and caches[0].max_size == 8


def test_without_kv_bits_nothing_changes():
    cache = KVCache()
    caches = [cache]
    maybe_quantize_kv_cache(caches, kv_bits=None, kv_group_size=64, quantized_kv_start=0)
    assert caches[0] is cache


def test_already_quantized_caches_are_left_alone():
    q = QuantizedKVCache(group_size=64, bits=4)
    caches = [q]
    maybe_quantize_kv_cache(caches, kv_bits=8, kv_group_size=64, quantized_kv_start=0)
    assert caches[0] is q


@pytest.mark.parametrize("bits", [1, 7, 16, True, "4"])
def test_unsupported_kv_bits_are_a_request_error_naming_kv_bits(bits):
    with pytest.raises(RequestError, match="kv_bits="):
        maybe_quantize_kv_cache([], kv_bits=bits, kv_group_size=64, quantized_kv_start=0)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_every_width_mx_quantize_supports_is_accepted(bits):
    caches = [KVCache()]
    caches[0].update_and_fetch(*kv(0, 2))
    maybe_quantize_kv_cache(caches, kv_bits=bits, kv_group_size=32, quantized_kv_start=0)
    assert caches[0].bits == bits


@pytest.mark.parametrize("group", [16, 48, 256])
def test_unsupported_group_sizes_are_a_request_error_naming_kv_group_size(group):
    with pytest.raises(RequestError, match="kv_group_size="):
        maybe_quantize_kv_cache([], kv_bits=4, kv_group_size=group, quantized_kv_start=0)


def test_a_negative_start_is_a_request_error():
    with pytest.raises(RequestError, match="quantized_kv_start="):
        maybe_quantize_kv_cache([], kv_bits=4, kv_group_size=64, quantized_kv_start=-1)
