"""The cache kinds of one codec and layout, by their names from before caches took a codec.

Each name builds the layout with its codec: ``QuantizedKVCache(group_size=64,
bits=4)`` is ``KVCache(codec=AffineCodec(64, 4))``, and
``isinstance(cache, QuantizedKVCache)`` asks whether a cache is that layout in
that codec. They stay because plugins construct caches by these names (a
family that quantizes its own caches) and mlx-lm calls its kinds so;
prompt-cache files that name them still load through the kind alias table of
:mod:`mlx_loom.cache.persist`. They are not classes: there is no class per
layout and codec.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from mlx_loom.cache._buffers import AffineCodec
from mlx_loom.cache.batch import BatchKVCache
from mlx_loom.cache.kv import KVCache
from mlx_loom.cache.rotating import RotatingKVCache
from mlx_loom.cache.stacked import StackedRotatingKVCache
from mlx_loom.cache.turboquant import TurboQuantCodec

__all__ = [
    "BatchQuantizedKVCache",
    "CacheForm",
    "BatchTurboQuantKVCache",
    "QuantizedKVCache",
    "QuantizedRotatingKVCache",
    "StackedQuantizedRotatingKVCache",
    "StackedTurboQuantRotatingKVCache",
    "TurboQuantKVCache",
    "TurboQuantRotatingKVCache",
]

T = TypeVar("T")


class CacheForm(Generic[T]):
    """A layout in one codec, under the name its own class once had."""

    def __init__(self, build: Callable[..., T], layout: type[T], codec: type) -> None:
        self._build = build
        self.layout = layout
        self.codec = codec
        self.__name__ = build.__name__.lstrip("_")
        self.__doc__ = build.__doc__

    def __call__(self, *args: Any, **kwargs: Any) -> T:
        return self._build(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        # The layout's class methods (stack, merge, from_state) and attributes.
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.layout, name)

    def __instancecheck__(self, obj: Any) -> bool:
        return type(obj) is self.layout and type(getattr(obj, "storage", None)) is self.codec

    def __repr__(self) -> str:
        return f"<{self.__name__}: {self.layout.__name__}(codec={self.codec.__name__}(...))>"


def _QuantizedKVCache(group_size: int = 64, bits: int = 8) -> KVCache:
    """A full cache stored affine-quantized (mlx-lm's ``QuantizedKVCache``)."""
    return KVCache(codec=AffineCodec(group_size, bits, owner="QuantizedKVCache"))


def _QuantizedRotatingKVCache(
    max_size: int, keep: int = 0, *, group_size: int = 64, bits: int = 8
) -> RotatingKVCache:
    """A sliding window stored affine-quantized."""
    codec = AffineCodec(group_size, bits, owner="QuantizedRotatingKVCache")
    return RotatingKVCache(max_size, keep, codec=codec)


def _TurboQuantKVCache(bits: int = 4) -> KVCache:
    """A full cache in TurboQuant storage."""
    return KVCache(codec=TurboQuantCodec(bits, owner="TurboQuantKVCache"))


def _TurboQuantRotatingKVCache(max_size: int, keep: int = 0, *, bits: int = 4) -> RotatingKVCache:
    """A sliding window in TurboQuant storage."""
    codec = TurboQuantCodec(bits, owner="TurboQuantRotatingKVCache")
    return RotatingKVCache(max_size, keep, codec=codec)


def _BatchQuantizedKVCache(
    left_padding: Sequence[int], *, group_size: int = 64, bits: int = 8
) -> BatchKVCache:
    """A batch of full caches stored affine-quantized."""
    codec = AffineCodec(group_size, bits, owner="BatchQuantizedKVCache")
    return BatchKVCache(left_padding, codec=codec)


def _BatchTurboQuantKVCache(left_padding: Sequence[int], *, bits: int = 4) -> BatchKVCache:
    """A batch of full caches in TurboQuant storage."""
    return BatchKVCache(left_padding, codec=TurboQuantCodec(bits, owner="BatchTurboQuantKVCache"))


def _StackedQuantizedRotatingKVCache(
    max_size: int, rows: int = 0, *, group_size: int = 64, bits: int = 8
) -> StackedRotatingKVCache:
    """Stacked window rows stored affine-quantized."""
    codec = AffineCodec(group_size, bits, owner="StackedQuantizedRotatingKVCache")
    return StackedRotatingKVCache(max_size, rows, codec=codec)


def _StackedTurboQuantRotatingKVCache(
    max_size: int, rows: int = 0, *, bits: int = 4
) -> StackedRotatingKVCache:
    """Stacked window rows in TurboQuant storage."""
    codec = TurboQuantCodec(bits, owner="StackedTurboQuantRotatingKVCache")
    return StackedRotatingKVCache(max_size, rows, codec=codec)


# The names are class names in mlx-lm and in the plugin API, so they keep
# their capitals.
QuantizedKVCache = CacheForm(_QuantizedKVCache, KVCache, AffineCodec)
QuantizedRotatingKVCache = CacheForm(_QuantizedRotatingKVCache, RotatingKVCache, AffineCodec)
TurboQuantKVCache = CacheForm(_TurboQuantKVCache, KVCache, TurboQuantCodec)
TurboQuantRotatingKVCache = CacheForm(_TurboQuantRotatingKVCache, RotatingKVCache, TurboQuantCodec)
BatchQuantizedKVCache = CacheForm(_BatchQuantizedKVCache, BatchKVCache, AffineCodec)
BatchTurboQuantKVCache = CacheForm(_BatchTurboQuantKVCache, BatchKVCache, TurboQuantCodec)
StackedQuantizedRotatingKVCache = CacheForm(
    _StackedQuantizedRotatingKVCache, StackedRotatingKVCache, AffineCodec
)
StackedTurboQuantRotatingKVCache = CacheForm(
    _StackedTurboQuantRotatingKVCache, StackedRotatingKVCache, TurboQuantCodec
)
