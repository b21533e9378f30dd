"""The TurboQuant cache kinds: full, sliding-window, and their decoding batches.

They reuse the slot bookkeeping of the plain kinds unchanged — every cache
algorithm only moves whole token slots, and a TurboQuant token is a few
arrays that all share the sequence axis (int8 keys and their scale, packed
value planes and their RMS) — with :class:`~mlx_loom.cache.turboquant.TurboQuantCodec`
as the storage codec. So a TurboQuant window holds, slot for slot, the
TurboQuant encoding of what the plain window holds, and a batch row holds
exactly what the row's own cache holds (each row decodes bit for bit as it
would alone, tested per family).

Like the affine kinds, padded batches (``merge`` / ``empty_batch``) are
refused: the engine prefills each prompt in its own cache and then stacks
rows (:meth:`stack`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, NoReturn

import mlx.core as mx

from mlx_loom.cache import _buffers as buf
from mlx_loom.cache.batch import BatchKVCache
from mlx_loom.cache.kv import GrowingKV, KVCache
from mlx_loom.cache.rotating import RotatingBase, RotatingKVCache
from mlx_loom.cache.stacked import StackedRotatingKVCache
from mlx_loom.cache.turboquant import (
    TURBOQUANT_BITS,
    TurboQuantCodec,
    refuse_padded_batch,
    state_bits,
)
from mlx_loom.errors import CacheError

__all__ = [
    "BatchTurboQuantKVCache",
    "StackedTurboQuantRotatingKVCache",
    "TurboQuantKVCache",
    "TurboQuantRotatingKVCache",
]


class _TurboQuantKind:
    """What every TurboQuant kind shares: the codec, its width, and joining only its equals."""

    kind: ClassVar[str]
    codec: ClassVar[str] = "turboquant"
    codec_bits: ClassVar[tuple[int, ...]] = TURBOQUANT_BITS
    codec_default_bits: ClassVar[int] = 4
    _codec: TurboQuantCodec

    @property
    def bits(self) -> int:
        return self._codec.bits

    def _same_width(self, other: Any, what: str) -> None:
        if getattr(other, "bits", None) != self.bits:
            raise CacheError(
                f"{self.kind}.{what}: rows with TurboQuant bits={getattr(other, 'bits', None)} "
                f"cannot join rows with bits={self.bits}",
                fix="batch only rows stored with the same TurboQuant width",
            )


def _widths(caches: Sequence[Any], owner: str) -> int:
    widths = {c.bits for c in caches}
    if len(widths) > 1:
        raise CacheError(
            f"{owner}.stack: the caches use different TurboQuant widths {sorted(widths)}",
            fix="stack only caches stored with the same TurboQuant bits",
        )
    return widths.pop()


class TurboQuantKVCache(_TurboQuantKind, GrowingKV):
    """Full KV cache in TurboQuant storage (int8 keys, ``bits``-wide rotated values)."""

    kind: ClassVar[str] = "TurboQuantKVCache"

    def __init__(self, bits: int = 4) -> None:
        super().__init__()
        self._codec = TurboQuantCodec(bits, owner=self.kind)

    @classmethod
    def from_plain(cls, cache: Any, *, bits: int, group_size: int | None = None) -> Any:
        """``cache`` in this codec if it is a full :class:`KVCache`; else ``None``."""
        return cache.to_turboquant(bits=bits) if type(cache) is KVCache else None

    def convert_like(self, plain: Any) -> Any:
        """``plain`` converted the way this cache was (``None``: not its plain kind)."""
        return self.from_plain(plain, bits=self.bits)

    @property
    def state(self) -> tuple[mx.array, ...]:
        """``(k_int8, k_scale, v_planes, v_rms)`` cut to ``offset``."""
        valid = self._valid()
        return () if valid is None else (*valid[0], *valid[1])

    @property
    def meta_state(self) -> tuple[str, ...]:
        """``(bits,)`` as a decimal string."""
        return (str(self.bits),)

    @classmethod
    def from_state(cls, state: Sequence[mx.array], meta_state: Sequence[str]) -> TurboQuantKVCache:
        arrays = buf.check_state_len(state, (0, 4), owner=cls.kind)
        (bits,) = state_bits(meta_state, ("bits",), owner=cls.kind)
        cache = cls(bits=bits)
        if arrays:
            cache.keys, cache.values = tuple(arrays[:2]), tuple(arrays[2:])
            cache.offset = arrays[0].shape[2]
        return cache

    def empty_batch(self, left_padding: Sequence[int]) -> NoReturn:
        refuse_padded_batch(self.kind)

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> NoReturn:
        refuse_padded_batch(cls.kind)

    @classmethod
    def stack(cls, caches: Sequence[TurboQuantKVCache]) -> BatchTurboQuantKVCache:
        """A batch whose row ``i`` decodes bit for bit as ``caches[i]`` alone."""
        return BatchTurboQuantKVCache.stack(caches)


class TurboQuantRotatingKVCache(_TurboQuantKind, RotatingBase):
    """Sliding-window KV cache in TurboQuant storage (same window rules as the plain kind)."""

    kind: ClassVar[str] = "TurboQuantRotatingKVCache"

    def __init__(self, max_size: int, keep: int = 0, *, bits: int = 4) -> None:
        super().__init__(max_size, keep)
        self._codec = TurboQuantCodec(bits, owner=self.kind)

    @classmethod
    def from_plain(cls, cache: Any, *, bits: int, group_size: int | None = None) -> Any:
        """``cache`` in this codec if it is a :class:`RotatingKVCache`; else ``None``."""
        return cache.to_turboquant(bits=bits) if type(cache) is RotatingKVCache else None

    def convert_like(self, plain: Any) -> Any:
        return self.from_plain(plain, bits=self.bits)

    @property
    def state(self) -> tuple[mx.array, ...]:
        """Four arrays (keys int8/scale, values planes/RMS) in slot order."""
        return self._stored_state()

    @property
    def meta_state(self) -> tuple[str, ...]:
        """``(keep, max_size, offset, idx, bits)`` as decimal strings."""
        return (*self._window_meta(), str(self.bits))

    @classmethod
    def from_state(
        cls, state: Sequence[mx.array], meta_state: Sequence[str]
    ) -> TurboQuantRotatingKVCache:
        arrays = buf.check_state_len(state, (0, 4), owner=cls.kind)
        keep, max_size, offset, idx, bits = state_bits(
            meta_state, ("keep", "max_size", "offset", "idx", "bits"), owner=cls.kind
        )
        cache = cls(max_size, keep, bits=bits)
        cache._restore_window(arrays, offset, idx)
        return cache

    def empty_batch(self, left_padding: Sequence[int]) -> NoReturn:
        refuse_padded_batch(self.kind)

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> NoReturn:
        refuse_padded_batch(cls.kind)

    @classmethod
    def stack(cls, caches: Sequence[TurboQuantRotatingKVCache]) -> StackedTurboQuantRotatingKVCache:
        """A batch whose row ``i`` decodes bit for bit as ``caches[i]`` alone."""
        return StackedTurboQuantRotatingKVCache.stack(caches)


class BatchTurboQuantKVCache(_TurboQuantKind, BatchKVCache):
    """:class:`~mlx_loom.cache.BatchKVCache` over TurboQuant storage (rows stacked, not padded)."""

    kind: ClassVar[str] = "BatchTurboQuantKVCache"
    _single: ClassVar[type] = TurboQuantKVCache

    def __init__(self, left_padding: Sequence[int], *, bits: int = 4) -> None:
        super().__init__(left_padding)
        self._codec = TurboQuantCodec(bits, owner=self.kind)  # type: ignore[misc]

    def _empty_single(self) -> TurboQuantKVCache:
        return TurboQuantKVCache(bits=self.bits)

    def _check_other(self, other: Any) -> None:
        super()._check_other(other)
        self._same_width(other, "extend")

    @classmethod
    def _new_like(cls, caches: Sequence[Any], pads: list[int]) -> BatchTurboQuantKVCache:
        return cls(pads, bits=_widths(caches, cls.kind))

    @property
    def meta_state(self) -> tuple[str, ...]:
        """``(idx, bits)`` as decimal strings."""
        return (str(self._idx), str(self.bits))

    @classmethod
    def from_state(
        cls, state: Sequence[mx.array], meta_state: Sequence[str]
    ) -> BatchTurboQuantKVCache:
        arrays = buf.check_state_len(state, (2, 6), owner=cls.kind)
        idx, bits = state_bits(meta_state, ("idx", "bits"), owner=cls.kind)
        cache = cls([0], bits=bits)
        cache.offset, cache.left_padding = arrays[0], arrays[1]
        cache.keys = tuple(arrays[2:4]) if len(arrays) == 6 else None
        cache.values = tuple(arrays[4:6]) if len(arrays) == 6 else None
        cache._idx = idx
        return cache

    def empty_batch(self, left_padding: Sequence[int]) -> NoReturn:
        refuse_padded_batch(self.kind)


class StackedTurboQuantRotatingKVCache(_TurboQuantKind, StackedRotatingKVCache):
    """:class:`~mlx_loom.cache.StackedRotatingKVCache` over TurboQuant storage."""

    kind: ClassVar[str] = "StackedTurboQuantRotatingKVCache"
    _single: ClassVar[type[RotatingBase]] = TurboQuantRotatingKVCache

    def __init__(self, max_size: int, rows: int = 0, *, bits: int = 4) -> None:
        super().__init__(max_size, rows)
        self._codec = TurboQuantCodec(bits, owner=self.kind)  # type: ignore[misc]

    def _empty_single(self) -> RotatingBase:
        return TurboQuantRotatingKVCache(self.max_size, 0, bits=self.bits)

    def _compatible(self, other: Any) -> None:
        super()._compatible(other)
        self._same_width(other, "extend")

    @classmethod
    def _new_like(cls, caches: Sequence[RotatingBase]) -> StackedTurboQuantRotatingKVCache:
        return cls(caches[0].max_size, len(caches), bits=_widths(caches, cls.kind))

    @property
    def meta_state(self) -> tuple[str, ...]:
        """``(max_size, counts, next slots, bits)``."""
        return (*super().meta_state, str(self.bits))

    @classmethod
    def from_state(
        cls, state: Sequence[mx.array], meta_state: Sequence[str]
    ) -> StackedTurboQuantRotatingKVCache:
        arrays = buf.check_state_len(state, (0, 4), owner=cls.kind)
        meta, counts, nexts = cls._from_meta(meta_state, 4)
        max_size, bits = state_bits((meta[0], meta[3]), ("max_size", "bits"), owner=cls.kind)
        cache = cls(max_size, len(counts), bits=bits)
        if arrays:
            cache.keys, cache.values = tuple(arrays[:2]), tuple(arrays[2:])
        cache._count, cache._next = counts, nexts
        return cache
