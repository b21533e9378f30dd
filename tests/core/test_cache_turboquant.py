"""TurboQuant KV: the codec's arithmetic, its cache kinds, their batches and their state.

TurboQuant is lossy, so there is no bit-equal oracle for its attention; what
is exact is tested exactly (slot bookkeeping against the plain kinds,
deferred-V against un-rotating every value, batch rows against the row
alone, state round trips), and what is lossy is bounded by its theory
(Lloyd–Max distortion, int8 rounding).
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import pytest

from mlx_loom.cache import (
    BatchTurboQuantKVCache,
    KVCache,
    RotatingKVCache,
    StackedTurboQuantRotatingKVCache,
    TurboQuantKVCache,
    TurboQuantRotatingKVCache,
    load_prompt_cache,
    maybe_quantize_kv_cache,
    save_prompt_cache,
)
from mlx_loom.cache.turboquant import LLOYD_MAX_LEVELS, TurboQuantCodec, lloyd_max_gaussian
from mlx_loom.errors import CacheError, CapabilityRefused, RequestError

H, D, MAX = 2, 64, 8
SCHEDULE = [5] + [1] * 12 + [3] + [1] * 6


def kv(step: int, L: int, B: int = 1, d: int = D) -> tuple[mx.array, mx.array]:
    k = mx.random.normal((B, H, L, d), key=mx.random.key(2 * step))
    v = mx.random.normal((B, H, L, d), key=mx.random.key(2 * step + 1))
    return k, v


def same(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and mx.array_equal(a, b).item()


def same_stored(x, y) -> bool:
    return len(x) == len(y) and all(same(a, b) for a, b in zip(x, y, strict=True))


def rel(a: mx.array, b: mx.array) -> float:
    return (mx.linalg.norm(a - b) / mx.linalg.norm(b)).item()


# --- the codec ------------------------------------------------------------------------


def test_lloyd_max_tables_are_the_published_gaussian_quantizers():
    # Max (1960), Table I: the positive levels for 8 and 16 levels.
    published = {
        3: (0.2451, 0.7560, 1.3440, 2.1520),
        4: (0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6181, 2.0690, 2.7326),
    }
    for bits, levels in published.items():
        ours = LLOYD_MAX_LEVELS[bits][2 ** (bits - 1) :]
        assert all(abs(a - b) < 2e-4 for a, b in zip(ours, levels, strict=True)), bits


def test_written_out_levels_are_what_the_lloyd_iteration_computes():
    for bits, levels in LLOYD_MAX_LEVELS.items():
        computed = lloyd_max_gaussian(2**bits)
        assert all(abs(a - b) < 1e-5 for a, b in zip(computed, levels, strict=True)), bits


@pytest.mark.parametrize("d", [16, 64, 128])
def test_rotation_is_orthonormal_and_its_own_inverse(d):
    codec = TurboQuantCodec(4, owner="test")
    x = mx.random.normal((2, 3, 5, d), key=mx.random.key(1))
    y = codec.rotate(x)
    assert mx.allclose(mx.linalg.norm(y, axis=-1), mx.linalg.norm(x, axis=-1), atol=1e-5)
    assert mx.abs(codec.unrotate(y) - x).max().item() < 1e-5


@pytest.mark.parametrize(("bits", "distortion"), [(3, 0.03454), (4, 0.009497)])
def test_value_error_is_the_lloyd_max_distortion(bits, distortion):
    # Rotated coordinates are ~N(0, 1) after dividing by the RMS: the relative
    # squared error is then the quantizer's distortion (Max's table), +-15%.
    codec = TurboQuantCodec(bits, owner="test")
    v = mx.random.normal((1, 4, 256, D), key=mx.random.key(2))
    back = codec.unrotate(codec.decode_values_rotated(codec.encode_values(v), D))
    err = (mx.sum((back - v) ** 2) / mx.sum(v**2)).item()
    assert 0.85 * distortion < err < 1.15 * distortion


def test_values_cost_bits_per_coordinate_plus_one_scale():
    codec = TurboQuantCodec(3, owner="test")
    packed, rms = codec.encode_values(mx.ones((1, 1, 1, 128)))
    assert packed.dtype == mx.uint32 and packed.shape[-1] * 32 == 3 * 128
    assert rms.shape[-1] == 1


def test_keys_are_int8_with_an_error_below_half_a_step():
    codec = TurboQuantCodec(4, owner="test")
    k = mx.random.normal((1, H, 9, D), key=mx.random.key(3)) * 5
    q, scale = codec.encode_keys(k)
    assert q.dtype == mx.int8 and scale.shape == (1, H, 9, 1)
    step = mx.max(mx.abs(k), axis=-1, keepdims=True) / 127
    assert (mx.abs(codec.decode_keys((q, scale)) - k) <= step / 2 + 1e-6).all().item()


def test_an_all_zero_vector_stays_zero():
    codec = TurboQuantCodec(4, owner="test")
    z = mx.zeros((1, 1, 2, D))
    assert mx.array_equal(codec.decode_keys(codec.encode_keys(z)), z).item()
    assert mx.array_equal(codec.decode_values_rotated(codec.encode_values(z), D), z).item()


@pytest.mark.parametrize("bad", [2, 8, True, "4"])
def test_a_width_other_than_3_or_4_is_refused(bad):
    with pytest.raises(CacheError, match="TurboQuant value width"):
        TurboQuantKVCache(bits=bad)


@pytest.mark.parametrize("d", [36, 44, 1])
def test_a_head_size_without_a_fast_hadamard_transform_is_refused(d):
    cache = TurboQuantKVCache(bits=4)
    with pytest.raises(CapabilityRefused, match="Walsh"):
        cache.append(*kv(0, 2, d=d))


#: Head sizes real models use that are not powers of two: 12 * 2^k and 20 * 2^k
#: (24, 48, 96, 192; 80, 160), and 28 * 2^k.
FACTORED = [12, 24, 48, 96, 192, 20, 40, 80, 160, 28, 56]


@pytest.mark.parametrize("d", [*FACTORED, 32, 64])
def test_rotation_is_a_signed_hadamard_matrix_and_unrotate_its_inverse(d):
    # The matrix the rotation applies, read off the identity: sqrt(D) R must be
    # a Hadamard matrix (entries +-1, rows orthogonal: M M^T = D I), and
    # un-rotating must apply its transpose (MLX's 20 and 28 are not symmetric,
    # so applying the transform again would not invert it).
    codec = TurboQuantCodec(4, owner="test")
    M = codec.rotate(mx.eye(d)) * d**0.5
    assert mx.allclose(mx.abs(M), mx.ones((d, d)), atol=1e-5).item()
    assert mx.allclose(M @ M.T, d * mx.eye(d), atol=1e-3).item()
    x = mx.random.normal((2, 3, 5, d), key=mx.random.key(1))
    y = codec.rotate(x)
    assert mx.allclose(y, x @ M * d**-0.5, atol=1e-4).item()
    assert mx.allclose(codec.unrotate(y), y @ M.T * d**-0.5, atol=1e-4).item()
    assert mx.abs(codec.unrotate(y) - x).max().item() < 1e-4


@pytest.mark.parametrize("d", [24, 80, 96])
def test_a_factored_head_size_attends_close_to_the_plain_cache(d):
    plain, tq = KVCache(), TurboQuantKVCache(bits=4)
    for step, L in enumerate([7, 1, 1]):
        k, v = kv(step, L, d=d)
        q = mx.random.normal((1, 2 * H, L, d), key=mx.random.key(50 + step))
        mask = "causal" if L > 1 else None
        a = plain.append(k, v).attend(q, scale=d**-0.5, mask=mask)
        b = tq.append(k, v).attend(q, scale=d**-0.5, mask=mask)
        assert rel(b, a) < 0.15, step


# --- attention ------------------------------------------------------------------------


def test_deferred_v_equals_un_rotating_every_value_first():
    cache = TurboQuantKVCache(bits=4)
    view = None
    for step, L in enumerate([6, 1, 1]):
        view = cache.append(*kv(step, L))
    q = mx.random.normal((1, 2 * H, 1, D), key=mx.random.key(9))
    out = view.attend(q, scale=D**-0.5, mask=None)
    codec = view.codec
    keys = codec.decode_keys(view.keys)
    values = codec.unrotate(codec.decode_values_rotated(view.values, D))
    ref = mx.fast.scaled_dot_product_attention(q, keys, values, scale=D**-0.5, mask=None)
    assert mx.abs(out - ref).max().item() < 1e-5


@pytest.mark.parametrize(("bits", "bound"), [(3, 0.25), (4, 0.15)])
def test_attention_stays_close_to_the_plain_cache(bits, bound):
    plain, tq = KVCache(), TurboQuantKVCache(bits=bits)
    for step, L in enumerate([7, 1, 1]):
        k, v = kv(step, L)
        q = mx.random.normal((1, 2 * H, L, D), key=mx.random.key(50 + step))
        mask = "causal" if L > 1 else None
        a = plain.append(k, v).attend(q, scale=D**-0.5, mask=mask)
        b = tq.append(k, v).attend(q, scale=D**-0.5, mask=mask)
        assert rel(b, a) < bound, step


def test_attention_sinks_are_supported():
    view = TurboQuantKVCache(bits=4).append(*kv(0, 4))
    q = mx.random.normal((1, 2 * H, 4, D), key=mx.random.key(4))
    with_sinks = view.attend(q, scale=0.1, mask="causal", sinks=mx.full((2 * H,), 3.0))
    without = view.attend(q, scale=0.1, mask="causal")
    assert with_sinks.shape == without.shape and not mx.allclose(with_sinks, without).item()


# --- the cache kinds ----------------------------------------------------------------


@pytest.mark.parametrize("keep", [0, 2])
def test_window_holds_the_encoding_of_the_plain_window_slot_for_slot(keep):
    ours, plain = TurboQuantRotatingKVCache(MAX, keep, bits=3), RotatingKVCache(MAX, keep)
    codec = ours._codec
    for step, L in enumerate(SCHEDULE):
        assert mx.array_equal(ours.make_mask(L, window_size=4), plain.make_mask(L, window_size=4))
        view = ours.append(*kv(step, L))
        kp, vp = plain.update_and_fetch(*kv(step, L))
        assert same_stored(view.keys, codec.encode_keys(kp)), step
        assert same_stored(view.values, codec.encode_values(vp)), step
        assert (ours.offset, ours._idx) == (plain.offset, plain._idx)


def test_full_cache_equals_converting_the_plain_cache():
    plain = KVCache()
    for step, L in enumerate([5, 1, 1]):
        plain.update_and_fetch(*kv(step, L))
    direct = TurboQuantKVCache(bits=4)
    for step, L in enumerate([5, 1, 1]):
        direct.update_and_fetch(*kv(step, L))
    converted = plain.to_turboquant(bits=4)
    assert converted.offset == direct.offset == 7
    assert same_stored(converted.state, direct.state)


def test_trim_drops_the_last_tokens():
    cache = TurboQuantKVCache(bits=4)
    cache.update_and_fetch(*kv(0, 6))
    assert cache.trim(2) == 2 and cache.offset == 4
    assert cache.state[0].shape[2] == 4


@pytest.mark.parametrize(
    "make",
    [
        lambda: TurboQuantKVCache(bits=3),
        lambda: TurboQuantRotatingKVCache(MAX, 1, bits=4),
    ],
)
def test_state_round_trips_through_a_prompt_cache_file(make, tmp_path):
    cache = make()
    for step, L in enumerate([5, 1, 1, 1, 1, 1]):
        cache.update_and_fetch(*kv(step, L))
    path = tmp_path / "c.safetensors"
    save_prompt_cache(path, [cache], {"note": "x"})
    (back,), meta = load_prompt_cache(path)
    assert type(back) is type(cache) and meta == {"note": "x"}
    assert back.meta_state == cache.meta_state and back.bits == cache.bits
    assert same_stored(back.state, cache.state)
    q = mx.random.normal((1, 2 * H, 1, D), key=mx.random.key(5))
    k, v = kv(40, 1)
    mask = cache.make_mask(1)
    a = cache.append(k, v).attend(q, scale=0.1, mask=mask)
    b = back.append(k, v).attend(q, scale=0.1, mask=mask)
    assert same(a, b)


def test_a_state_with_a_bad_width_is_refused():
    cache = TurboQuantKVCache(bits=4)
    cache.update_and_fetch(*kv(0, 2))
    with pytest.raises(CacheError, match="TurboQuant value width"):
        TurboQuantKVCache.from_state(cache.state, ("turboquant", "5"))


def test_padded_batches_are_refused():
    with pytest.raises(CapabilityRefused, match="padded batches"):
        TurboQuantKVCache.merge([TurboQuantKVCache()])
    with pytest.raises(CapabilityRefused, match="padded batches"):
        TurboQuantRotatingKVCache(4).empty_batch([0])


# --- batches: each row as alone ----------------------------------------------------


def _filled(make, lengths: list[int], seed: int):
    cache = make()
    for j, L in enumerate(lengths):
        cache.update_and_fetch(*kv(seed * 100 + j, L))
    return cache


@pytest.mark.parametrize(
    ("make", "batch"),
    [
        (lambda: TurboQuantKVCache(bits=4), BatchTurboQuantKVCache),
        (lambda: TurboQuantRotatingKVCache(MAX, bits=3), StackedTurboQuantRotatingKVCache),
    ],
)
def test_a_stacked_row_decodes_bit_for_bit_as_alone(make, batch):
    histories = [[5, 1], [9], [2, 1, 1]]
    alone = [_filled(make, h, i) for i, h in enumerate(histories)]
    stacked = type(alone[0]).stack([_filled(make, h, i) for i, h in enumerate(histories)])
    assert isinstance(stacked, batch)
    for step in range(4):
        k, v = kv(70 + step, 1, B=3)
        q = mx.random.normal((3, 2 * H, 1, D), key=mx.random.key(80 + step))
        mask = stacked.make_mask(1)  # before the append, as a graph builds it
        out = stacked.append(k, v).attend(q, scale=0.1, mask=mask)
        for i, cache in enumerate(alone):
            mask = cache.make_mask(1)
            ref = cache.append(k[i : i + 1], v[i : i + 1]).attend(
                q[i : i + 1], scale=0.1, mask=mask
            )
            assert same(out[i : i + 1], ref), (step, i)
    back = stacked.extract(1)
    assert same_stored(back.state, alone[1].state)


def test_rows_of_different_widths_do_not_stack():
    with pytest.raises(CacheError, match="widths"):
        TurboQuantKVCache.stack(
            [_filled(partial(TurboQuantKVCache, bits=b), [3], 0) for b in (3, 4)]
        )


# --- selection ----------------------------------------------------------------------


def test_kv_codec_turboquant_converts_full_and_window_caches_once_due():
    caches = [KVCache(), RotatingKVCache(MAX)]
    for c in caches:
        c.update_and_fetch(*kv(0, 3))
    options = dict(kv_bits=3, kv_group_size=64, quantized_kv_start=4, kv_codec="turboquant")
    maybe_quantize_kv_cache(caches, **options)
    assert [type(c) for c in caches] == [KVCache, RotatingKVCache]
    for c in caches:
        c.update_and_fetch(*kv(1, 1))
    maybe_quantize_kv_cache(caches, **options)
    assert isinstance(caches[0], TurboQuantKVCache)
    assert isinstance(caches[1], TurboQuantRotatingKVCache)
    assert {c.bits for c in caches} == {3}


def test_kv_codec_without_kv_bits_uses_four_bits():
    caches = [KVCache()]
    caches[0].update_and_fetch(*kv(0, 2))
    maybe_quantize_kv_cache(
        caches, kv_bits=None, kv_group_size=64, quantized_kv_start=0, kv_codec="turboquant"
    )
    assert isinstance(caches[0], TurboQuantKVCache) and caches[0].bits == 4


@pytest.mark.parametrize(
    ("codec", "bits", "match"),
    [("turboquant", 8, "not a width"), ("nope", 4, "not a KV cache codec"), (3, 4, "codec")],
)
def test_an_unknown_codec_or_width_is_a_request_error(codec, bits, match):
    with pytest.raises(RequestError, match=match):
        maybe_quantize_kv_cache(
            [KVCache()], kv_bits=bits, kv_group_size=64, quantized_kv_start=0, kv_codec=codec
        )
