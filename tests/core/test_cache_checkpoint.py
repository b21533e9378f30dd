"""``checkpoint()`` / ``Checkpoint.restore()``: immutable snapshots of caches that cannot trim."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_loom.cache import (
    Checkpointable,
    KVCache,
    QuantizedRotatingKVCache,
    RecurrentCache,
    RotatingKVCache,
)
from mlx_loom.cache.forms import TurboQuantRotatingKVCache
from mlx_loom.errors import CacheError


def kv(n: int, seed: int) -> mx.array:
    return mx.random.normal((1, 2, n, 32), key=mx.random.key(seed))


WINDOWS = {
    "plain": lambda: RotatingKVCache(6, 0),
    "affine": lambda: QuantizedRotatingKVCache(6, 0, group_size=32, bits=8),
    "turboquant": lambda: TurboQuantRotatingKVCache(6, 0, bits=4),
}


def arrays(cache) -> list[mx.array]:
    """Copies of the cache's state arrays (its own objects change with in-place writes)."""
    out = [a + 0 for a in cache.state]
    mx.eval(out)
    return out


@pytest.mark.parametrize("kind", WINDOWS)
def test_a_window_checkpoint_survives_in_place_writes_of_the_cache_and_of_its_restorations(kind):
    cache = WINDOWS[kind]()
    cache.update_and_fetch(kv(9, 1), kv(9, 2))  # filled: it cannot trim any more
    for t in range(3):  # one-token writes go into the buffer in place
        cache.update_and_fetch(kv(1, 10 + t), kv(1, 20 + t))
    assert not cache.is_trimmable()
    snap = cache.checkpoint()
    before, meta = arrays(cache), tuple(cache.meta_state)
    cache.update_and_fetch(kv(1, 30), kv(1, 31))  # writes a slot of the live buffer in place
    restored = snap.restore()
    assert type(restored) is type(cache) and tuple(restored.meta_state) == meta
    assert all(mx.array_equal(a, b).item() for a, b in zip(arrays(restored), before, strict=True))
    restored.update_and_fetch(kv(1, 40), kv(1, 41))  # and so does the restored one
    again = snap.restore()
    assert all(mx.array_equal(a, b).item() for a, b in zip(arrays(again), before, strict=True))
    # The restored window continues as the original did from that point.
    twin = snap.restore()
    twin.update_and_fetch(kv(1, 30), kv(1, 31))
    after = arrays(cache)
    assert all(mx.array_equal(a, b).item() for a, b in zip(arrays(twin), after, strict=True))


def test_a_recurrent_checkpoint_is_the_state_at_that_point():
    cache = RecurrentCache()
    cache.update(conv_state=mx.ones((1, 3, 8)), recurrent_state=mx.ones((1, 2, 4, 4)), n=5)
    snap = cache.checkpoint()
    assert snap.offset == 5 and snap.nbytes == cache.nbytes
    cache.update(conv_state=mx.zeros((1, 3, 8)), recurrent_state=mx.zeros((1, 2, 4, 4)), n=1)
    restored = snap.restore()
    assert restored.offset == 5
    assert mx.array_equal(restored.recurrent_state, mx.ones((1, 2, 4, 4))).item()
    assert mx.array_equal(restored.conv_state, mx.ones((1, 3, 8))).item()


def test_only_caches_that_may_not_trim_offer_checkpoints():
    assert isinstance(RotatingKVCache(4), Checkpointable)
    assert isinstance(RecurrentCache(), Checkpointable)
    assert not isinstance(KVCache(), Checkpointable)  # it trims instead


def test_a_checkpoint_inside_a_speculative_round_is_refused():
    cache = RotatingKVCache(6, 0)
    cache.update_and_fetch(kv(7, 1), kv(7, 2))
    cache.begin_round()
    with pytest.raises(CacheError, match="speculative round is open"):
        cache.checkpoint()


def test_a_batch_of_recurrent_rows_is_refused():
    cache = RecurrentCache(left_padding=[0, 1])
    cache.update(conv_state=mx.ones((2, 3, 8)), recurrent_state=mx.ones((2, 2, 4, 4)), n=2)
    with pytest.raises(CacheError, match="single-row"):
        cache.checkpoint()
