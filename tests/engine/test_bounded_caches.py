"""max_kv_size asks each cache for its bounded form; no cache class is tested.

A full cache becomes a window of that many tokens in its own codec (plain,
affine, TurboQuant), a wider window narrows, recurrent state stays, and a
window whose kept tokens would fill the bound is refused.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_loom.cache import (
    KVCache,
    QuantizedKVCache,
    RecurrentCache,
    RotatingKVCache,
    TurboQuantKVCache,
    TurboQuantRotatingKVCache,
)
from mlx_loom.engine.caches import fresh_caches
from mlx_loom.errors import CapabilityRefused

H, D = 2, 32


def kv(step: int, L: int) -> tuple[mx.array, mx.array]:
    k = mx.random.normal((1, H, L, D), key=mx.random.key(2 * step))
    v = mx.random.normal((1, H, L, D), key=mx.random.key(2 * step + 1))
    return k, v


class Stub:
    """A model whose own caches are already in a codec (as a family may make them)."""

    def __init__(self, *caches):
        self.caches = caches

    def make_cache(self):
        return list(self.caches)


def test_turboquant_caches_are_bounded_to_turboquant_windows():
    full, wide = TurboQuantKVCache(bits=3), TurboQuantRotatingKVCache(64, bits=4)
    recurrent = RecurrentCache()
    bounded = fresh_caches(Stub(full, wide, recurrent), 16)  # type: ignore[arg-type]
    assert [type(c) for c in bounded] == [RotatingKVCache, RotatingKVCache, RecurrentCache]
    assert [(c.max_size, c.keep, c.codec, c.bits) for c in bounded[:2]] == [
        (16, 0, "turboquant", 3),
        (16, 0, "turboquant", 4),
    ]
    assert bounded[2] is recurrent


def test_a_bounded_turboquant_cache_holds_the_turboquant_form_of_the_plain_window():
    (bounded,) = fresh_caches(Stub(TurboQuantKVCache(bits=4)), 6)  # type: ignore[arg-type]
    plain = RotatingKVCache(6)
    for step, L in enumerate([4, 1, 1, 3, 1, 1]):
        bounded.update_and_fetch(*kv(step, L))
        plain.update_and_fetch(*kv(step, L))
    want = plain.to_turboquant(bits=4)
    assert bounded.meta_state == want.meta_state and bounded.size() == 6
    assert all(mx.array_equal(a, b).item() for a, b in zip(bounded.state, want.state, strict=True))


def test_plain_and_affine_caches_keep_their_codec_when_bounded():
    narrow = RotatingKVCache(8, keep=2)
    caches = fresh_caches(
        Stub(KVCache(), QuantizedKVCache(group_size=32, bits=4), narrow),  # type: ignore[arg-type]
        16,
    )
    assert [(c.max_size, c.codec, c.bits, c.group_size) for c in caches[:2]] == [
        (16, None, None, None),
        (16, "affine", 4, 32),
    ]
    assert caches[2] is narrow  # already within the bound


def test_a_window_whose_kept_tokens_fill_the_bound_is_refused():
    with pytest.raises(CapabilityRefused, match="kept leading tokens"):
        fresh_caches(Stub(TurboQuantRotatingKVCache(64, keep=8)), 8)  # type: ignore[arg-type]
