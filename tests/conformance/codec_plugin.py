"""A third-party KV codec plugin: half-precision keys/values with their own view.

It registers one cache kind through ``loom_cache_kinds`` and touches no
family: a request's ``kv_codec="test-half"`` converts a family's full caches
into it, and the family's graph attends through the view it returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import mlx.core as mx

from mlx_loom.cache import KVCache
from mlx_loom.cache._buffers import PlainCodec
from mlx_loom.plugin import PLUGIN_API_VERSION, hookimpl


@dataclass(frozen=True)
class HalfView:
    """Upcasts the stored halves to the queries' dtype; counts its calls."""

    keys: mx.array
    values: mx.array
    calls: ClassVar[list[int]] = []

    def attend(self, queries, *, scale, mask, sinks=None):
        HalfView.calls.append(self.keys.shape[2])
        k, v = self.keys.astype(queries.dtype), self.values.astype(queries.dtype)
        return mx.fast.scaled_dot_product_attention(
            queries, k, v, scale=scale, mask=mask, sinks=sinks
        )


class HalfCodec(PlainCodec):
    def encode(self, x: mx.array) -> mx.array:
        return x.astype(mx.float16)

    def zeros(self, like: mx.array, n: int) -> mx.array:
        B, H, _, D = like.shape
        return mx.zeros((B, H, n, D), mx.float16)

    def view(self, keys: Any, values: Any) -> HalfView:
        return HalfView(keys, values)


class HalfKVCache(KVCache):
    """A full cache storing float16 keys/values (codec ``test-half``)."""

    kind: ClassVar[str] = "HalfKVCache"
    codec: ClassVar[str] = "test-half"
    codec_bits: ClassVar[tuple[int, ...]] = (16,)
    codec_default_bits: ClassVar[int] = 16
    _codec = HalfCodec()
    stack = None  # rows of this kind decode alone

    @classmethod
    def from_plain(cls, cache: Any, *, bits: int, group_size: int = 64) -> HalfKVCache | None:
        if type(cache) is not KVCache:
            return None
        half = cls()
        half.offset = cache.offset
        if cache.keys is not None:
            half.keys = half._codec.encode(cache.keys)
            half.values = half._codec.encode(cache.values)
        return half

    def convert_like(self, plain: Any) -> HalfKVCache | None:
        return self.from_plain(plain, bits=16)


class ScrambledView(HalfView):
    def attend(self, queries, *, scale, mask, sinks=None):
        return mx.zeros_like(super().attend(queries, scale=scale, mask=mask, sinks=sinks))


class ScrambledCodec(HalfCodec):
    def view(self, keys: Any, values: Any) -> ScrambledView:
        return ScrambledView(keys, values)


class ScrambledKVCache(HalfKVCache):
    """A broken codec: its view returns zeros (the kit must catch it)."""

    kind: ClassVar[str] = "ScrambledKVCache"
    codec: ClassVar[str] = "test-scrambled"
    _codec = ScrambledCodec()


class CodecPlugin:
    """Registers codec cache kinds, nothing else."""

    def __init__(self, kinds=(HalfKVCache,)) -> None:
        self.kinds = list(kinds)

    @hookimpl
    def loom_plugin_api_version(self):
        return PLUGIN_API_VERSION

    @hookimpl
    def loom_cache_kinds(self):
        return self.kinds
