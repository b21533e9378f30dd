"""Every KV layout takes every storage codec: plain, affine, TurboQuant, a plugin's.

The layouts move whole slots and never look inside them, so a window or a
stacked batch in a codec nobody wrote a class for holds, slot for slot, what
the codec makes of the plain cache's slots, and each stacked row attends bit
for bit as the row alone.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest

from mlx_loom.cache import (
    AffineCodec,
    KVCache,
    PlainCodec,
    RotatingKVCache,
    StackedRotatingKVCache,
    TurboQuantCodec,
    append_kv,
    save_prompt_cache,
)
from mlx_loom.errors import CacheError

H, D, W = 2, 32, 6


class HalfCodec(PlainCodec):
    """A plugin's codec: float16 keys and values, attended in the queries' dtype."""

    def encode(self, x: mx.array) -> mx.array:
        return x.astype(mx.float16)

    def zeros(self, like: mx.array, n: int) -> mx.array:
        B, heads, _, d = like.shape
        return mx.zeros((B, heads, n, d), mx.float16)

    def view(self, keys: Any, values: Any) -> Any:
        class HalfView:
            def attend(self, q, *, scale, mask, sinks=None):
                k, v = keys.astype(q.dtype), values.astype(q.dtype)
                return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)

        return HalfView()


CODECS = {
    "plain": PlainCodec,
    "affine": lambda: AffineCodec(32, 4),
    "turboquant": lambda: TurboQuantCodec(3),
    "plugin": HalfCodec,
}
LAYOUTS = {
    "full": lambda codec: KVCache(codec=codec),
    "window": lambda codec: RotatingKVCache(W, codec=codec),
}


def kv(seed: int, L: int, B: int = 1) -> tuple[mx.array, mx.array]:
    k = mx.random.normal((B, H, L, D), key=mx.random.key(seed))
    v = mx.random.normal((B, H, L, D), key=mx.random.key(seed + 1))
    return k, v


def fed(make: Any, history: list[int], seed: int) -> Any:
    cache = make()
    for i, L in enumerate(history):
        cache.update_and_fetch(*kv(100 * seed + 2 * i, L))
    return cache


def attend(cache: Any, k: mx.array, v: mx.array, q: mx.array) -> mx.array:
    mask = cache.make_mask(1)
    return append_kv(cache, k, v).attend(q, scale=D**-0.5, mask=mask)


@pytest.mark.parametrize("codec", list(CODECS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_layout_in_a_codec_holds_the_codec_form_of_the_plain_slots(layout, codec):
    make = CODECS[codec]
    plain = fed(lambda: LAYOUTS[layout](None), [5, 1, 3, 1, 1], 0)
    coded = fed(lambda: LAYOUTS[layout](make()), [5, 1, 3, 1, 1], 0)
    want = plain.to_codec(make())
    assert coded.offset == want.offset == plain.offset
    got_k, got_v = coded.keys_and_values()
    want_k, want_v = want.keys_and_values()
    leaves = lambda x: list(x) if isinstance(x, tuple) else [x]  # noqa: E731
    for a, b in zip(leaves(got_k) + leaves(got_v), leaves(want_k) + leaves(want_v), strict=True):
        assert a.dtype == b.dtype and mx.array_equal(a, b).item()


@pytest.mark.parametrize("codec", list(CODECS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_stacked_rows_of_a_codec_attend_bit_for_bit_as_alone(layout, codec):
    make = CODECS[codec]
    histories = [[4, 1], [7, 1, 1], [2]]
    rows = [fed(lambda: LAYOUTS[layout](make()), h, i) for i, h in enumerate(histories)]
    batch = type(rows[0]).stack(rows)
    assert batch.codec_key == rows[0].codec_key
    k, v = kv(900, 1, B=3)
    q = mx.random.normal((3, 2 * H, 1, D), key=mx.random.key(950))
    out = attend(batch, k, v, q)
    for i in range(3):
        single = fed(lambda: LAYOUTS[layout](make()), histories[i], i)
        alone = attend(single, k[i : i + 1], v[i : i + 1], q[i : i + 1])
        assert mx.array_equal(out[i : i + 1], alone).item(), i


def test_rows_of_different_codecs_do_not_stack_into_one_layout():
    a = fed(lambda: RotatingKVCache(W, codec=AffineCodec(32, 4)), [3], 0)
    b = fed(lambda: RotatingKVCache(W, codec=AffineCodec(32, 8)), [3], 1)
    with pytest.raises(CacheError, match="quantized differently"):
        StackedRotatingKVCache.stack([a, b])


def test_windows_in_a_codec_batch_by_stacking_not_by_padded_merge():
    from mlx_loom.cache import BatchRotatingKVCache

    coded = fed(lambda: RotatingKVCache(W, codec=TurboQuantCodec(4)), [3], 0)
    with pytest.raises(CacheError, match=r"caches\[1\] is a turboquant 4, not a plain"):
        BatchRotatingKVCache.merge([fed(lambda: RotatingKVCache(W), [3], 1), coded])


def test_a_cache_in_an_unnamed_plugin_codec_is_not_saved_as_plain(tmp_path):
    cache = fed(lambda: RotatingKVCache(W, codec=HalfCodec()), [3], 0)
    with pytest.raises(CacheError, match="HalfCodec has no name"):
        save_prompt_cache(tmp_path / "half.safetensors", [cache])
