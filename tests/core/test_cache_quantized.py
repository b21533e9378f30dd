"""Affine-quantized caches and the quantized attention path.

``QuantizedKVCache`` and the quantized attention are compared with mlx-lm bit
for bit. mlx-lm has no quantized sliding-window cache, so
``QuantizedRotatingKVCache`` is compared with a reference we build: the plain
window cache's output (ours and mlx-lm's agree, see test_cache_rotating)
passed through ``mx.quantize``. No tolerance is needed: affine groups run along
head_dim inside one token, so quantizing each token on the way in and then
moving whole token slots yields exactly the quantized window.
"""

from __future__ import annotations

import copy

import mlx.core as mx
import pytest
from mlx_lm.models import base as lm_base
from mlx_lm.models import cache as lm_cache

from mlx_loom.cache import (
    QuantizedKVCache,
    QuantizedRotatingKVCache,
    RotatingKVCache,
    create_attention_mask,
)
from mlx_loom.errors import CacheError, CacheNotTrimmable, CapabilityRefused

H, D, MAX = 2, 64, 8
SCHEDULE = [5] + [1] * 12 + [3] + [1] * 6


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


def same_triples(x, y) -> bool:
    return len(x) == len(y) == 3 and all(same(a, b) for a, b in zip(x, y, strict=True))


@pytest.mark.parametrize(("group_size", "bits"), [(64, 4), (32, 8), (64, 8), (32, 2)])
def test_quantized_full_cache_equals_mlx_lm_over_many_steps(group_size, bits):
    ours = QuantizedKVCache(group_size=group_size, bits=bits)
    theirs = lm_cache.QuantizedKVCache(group_size=group_size, bits=bits)
    for step, L in enumerate([5, 1, 1, 260, 1, 3]):
        ko, vo = ours.update_and_fetch(*kv(step, L))
        kt, vt = theirs.update_and_fetch(*kv(step, L))
        assert same_triples(ko, kt) and same_triples(vo, vt) and ours.offset == theirs.offset
        mt = theirs.make_mask(L, window_size=None, return_array=False)
        assert same_mask(ours.make_mask(L), mt)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_attention_equals_mlx_lm_with_grouped_heads_and_masks(bits):
    ours = QuantizedKVCache(group_size=32, bits=bits)
    theirs = lm_cache.QuantizedKVCache(group_size=32, bits=bits)
    for step, L in enumerate([6, 1, 1, 4]):
        q = mx.random.normal((1, 2 * H, L, D), key=mx.random.key(900 + step))
        for ret in (False, True):  # "causal" string and boolean array masks
            h = mx.zeros((1, L, 4))
            mo = create_attention_mask(h, ours, return_array=ret)
            mt = lm_base.create_attention_mask(h, theirs, return_array=ret)
            probe_o, probe_t = copy.deepcopy(ours), copy.deepcopy(theirs)
            view = probe_o.append(*kv(step, L))
            kt, vt = probe_t.update_and_fetch(*kv(step, L))
            out = view.attend(q, scale=0.125, mask=mo)
            # mlx-lm scales its queries in place: give it its own copy.
            ref = lm_base.scaled_dot_product_attention(
                mx.array(q), kt, vt, probe_t, scale=0.125, mask=mt
            )
            assert same(out, ref), (step, ret)
        ours.update_and_fetch(*kv(step, L))
        theirs.update_and_fetch(*kv(step, L))


@pytest.mark.parametrize("groups", [1, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("causal", [False, True])
def test_quantized_attention_with_sinks_is_the_fused_kernel_over_the_dequantized_cache(
    groups, causal
):
    # gpt-oss's learned per-head sink logits: the same softmax as the fused
    # kernel's, over keys/values that are the quantized cache's own.
    cache = QuantizedKVCache(group_size=32, bits=8)
    view = cache.append(*kv(0, 5))
    q = mx.random.normal((1, groups * H, 5, D), key=mx.random.key(77))
    sinks = mx.random.normal((groups * H,), key=mx.random.key(78)) * 2
    mask = "causal" if causal else None
    out = view.attend(q, scale=0.125, mask=mask, sinks=sinks)
    keys, values = (mx.dequantize(*t, group_size=32, bits=8) for t in (view.keys, view.values))
    ref = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.125, mask=mask, sinks=sinks)
    assert out.shape == ref.shape and mx.allclose(out, ref, atol=1e-5).item()
    # The sinks take a share of the attention: without them the output differs.
    assert not mx.allclose(out, view.attend(q, scale=0.125, mask=mask), atol=1e-3).item()


@pytest.mark.parametrize("keep", [0, 2])
@pytest.mark.parametrize(("group_size", "bits"), [(64, 4), (32, 8)])
def test_quantized_window_equals_quantizing_the_plain_window(keep, group_size, bits):
    ours = QuantizedRotatingKVCache(MAX, keep, group_size=group_size, bits=bits)
    plain = lm_cache.RotatingKVCache(MAX, keep=keep)
    for step, L in enumerate(SCHEDULE):
        for window in (None, 4):
            mo = ours.make_mask(L, window_size=window)
            mp = plain.make_mask(L, window_size=window)
            assert same_mask(mo, mp)
        ko, vo = ours.update_and_fetch(*kv(step, L))
        kp, vp = plain.update_and_fetch(*kv(step, L))
        ref_k = tuple(mx.quantize(kp, group_size=group_size, bits=bits))
        ref_v = tuple(mx.quantize(vp, group_size=group_size, bits=bits))
        assert same_triples(ko, ref_k) and same_triples(vo, ref_v), step
        assert (ours.offset, ours._idx) == (plain.offset, plain._idx)


def test_quantized_window_attention_equals_quantized_attention_over_the_reference_window():
    ours = QuantizedRotatingKVCache(MAX, group_size=32, bits=8)
    plain = lm_cache.RotatingKVCache(MAX)
    for step, L in enumerate(SCHEDULE):
        q = mx.random.normal((1, 2 * H, L, D), key=mx.random.key(700 + step))
        mask = create_attention_mask(mx.zeros((1, L, 4)), ours, window_size=6)
        view = ours.append(*kv(step, L))
        kp, vp = plain.update_and_fetch(*kv(step, L))
        out = view.attend(q, scale=0.125, mask=mask)
        ref = lm_base.quantized_scaled_dot_product_attention(
            mx.array(q),
            mx.quantize(kp, group_size=32, bits=8),
            mx.quantize(vp, group_size=32, bits=8),
            scale=0.125,
            mask=mask,
            group_size=32,
            bits=8,
        )
        assert same(out, ref), step


def test_rotating_to_quantized_mid_window_keeps_matching_the_reference():
    plain_ours = RotatingKVCache(MAX)
    plain_ref = lm_cache.RotatingKVCache(MAX)
    for step, L in enumerate([5, 1, 1, 1, 1, 1]):  # wrapped: offset 10 > 8
        plain_ours.update_and_fetch(*kv(step, L))
        plain_ref.update_and_fetch(*kv(step, L))
    q = plain_ours.to_quantized(group_size=64, bits=4)
    assert isinstance(q, QuantizedRotatingKVCache) and (q.offset, q.max_size) == (10, MAX)
    for step, L in enumerate([1, 1, 3, 1], start=50):
        ko, _ = q.update_and_fetch(*kv(step, L))
        kp, _ = plain_ref.update_and_fetch(*kv(step, L))
        assert same_triples(ko, tuple(mx.quantize(kp, group_size=64, bits=4)))


def test_quantized_window_refuses_to_trim_once_full():
    cache = QuantizedRotatingKVCache(MAX, group_size=32, bits=4)
    for step in range(9):
        cache.update_and_fetch(*kv(step, 1))
    assert not cache.is_trimmable()
    with pytest.raises(CacheNotTrimmable, match=r"RotatingKVCache\(max_size=8"):
        cache.trim(1)


def test_quantized_window_trims_before_it_fills():
    cache = QuantizedRotatingKVCache(MAX, group_size=32, bits=4)
    cache.update_and_fetch(*kv(0, 5))
    assert cache.is_trimmable() and cache.trim(2) == 2 and cache.offset == 3


def test_quantized_state_round_trips():
    full = QuantizedKVCache(group_size=32, bits=4)
    window = QuantizedRotatingKVCache(MAX, 1, group_size=64, bits=8)
    for step, L in enumerate([5, 1, 1, 1, 1, 1]):
        full.update_and_fetch(*kv(step, L))
        window.update_and_fetch(*kv(step, L))
    for cache in (full, window):
        again = type(cache).from_state(cache.state, cache.meta_state)
        assert (again.bits, again.group_size, again.offset) == (
            cache.bits,
            cache.group_size,
            cache.offset,
        )
        for step in range(60, 63):
            ka, _ = cache.update_and_fetch(*kv(step, 1))
            kb, _ = again.update_and_fetch(*kv(step, 1))
            assert same_triples(ka, kb)


def test_unsupported_bits_and_group_sizes_are_refused_by_name():
    with pytest.raises(CacheError, match="bits=7"):
        QuantizedKVCache(group_size=64, bits=7)
    with pytest.raises(CacheError, match="group_size=48"):
        QuantizedRotatingKVCache(MAX, group_size=48, bits=4)


def test_a_head_dim_the_group_size_does_not_divide_is_refused():
    cache = QuantizedKVCache(group_size=128, bits=4)
    with pytest.raises(CacheError, match="head_dim 64"):
        cache.update_and_fetch(*kv(0, 2))


def test_batching_quantized_caches_is_refused():
    for cache in (QuantizedKVCache(), QuantizedRotatingKVCache(MAX)):
        with pytest.raises(CapabilityRefused, match="batching"):
            cache.empty_batch([0, 1])
        with pytest.raises(CapabilityRefused):
            type(cache).merge([cache, cache])


def test_quantized_nbytes_counts_packed_scales_and_biases():
    cache = QuantizedKVCache(group_size=32, bits=4)
    cache.update_and_fetch(*kv(0, 1))
    per_token = D * 4 // 32 * 4 + 2 * (D // 32) * 4  # uint32 words + fp32 scales/biases
    assert cache.nbytes == 2 * H * 256 * per_token
