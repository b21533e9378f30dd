"""Affine-quantized key/value caches: full and sliding-window.

Keys and values are stored as ``mx.quantize`` triples ``(packed, scales,
biases)``; ``append`` returns an :class:`~mlx_loom.cache.AffineView`, which
attends with ``mx.quantized_matmul``. Quantization groups run along
head_dim, one token at a time, so quantizing on the way in and then moving
slots gives exactly the quantized form of what the plain cache would return:
the quantized window cache is bit-equal to ``mx.quantize`` of the plain window
cache's output (tested). mlx-lm has the full kind (``QuantizedKVCache``, parity
tested) but refuses the window kind ("RotatingKVCache Quantization NYI").

Padded batches of quantized caches (``empty_batch``/``merge``, mlx-lm's
left-padded prefill layout) are refused (:class:`CapabilityRefused`): they
roll and pad rows, and we have no mlx-lm oracle to prove a quantized version
against. :meth:`stack` batches rows that were prefilled alone, keeping each
row's slots exactly as its own cache holds them
(:class:`~mlx_loom.cache.BatchQuantizedKVCache`,
:class:`~mlx_loom.cache.StackedQuantizedRotatingKVCache`), so a row decodes
bit for bit as it would alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn

import mlx.core as mx

from mlx_loom.cache import _buffers as buf
from mlx_loom.cache.kv import GrowingKV, KVCache
from mlx_loom.cache.rotating import RotatingBase, RotatingKVCache

if TYPE_CHECKING:
    from mlx_loom.cache.batch import BatchQuantizedKVCache
    from mlx_loom.cache.stacked import StackedQuantizedRotatingKVCache

__all__ = ["QuantizedKVCache", "QuantizedRotatingKVCache"]


def _refuse_batch(kind: str) -> NoReturn:
    buf.refuse_padded_batch(kind, codec="affine-quantized", option="kv_bits")


class QuantizedKVCache(GrowingKV):
    """Full KV cache whose keys/values are affine-quantized (``bits`` wide per ``group_size``)."""

    kind: ClassVar[str] = "QuantizedKVCache"
    codec: ClassVar[str] = "affine"
    codec_bits: ClassVar[tuple[int, ...]] = buf.KV_BITS
    codec_default_bits: ClassVar[int] = 8

    def __init__(self, group_size: int = 64, bits: int = 8) -> None:
        super().__init__()
        self._codec = buf.AffineCodec(group_size, bits, owner=self.kind)

    @classmethod
    def from_plain(cls, cache: Any, *, bits: int, group_size: int = 64) -> Any:
        """``cache`` affine-quantized if it is a full :class:`KVCache`; else ``None``."""
        if type(cache) is not KVCache:
            return None
        return cache.to_quantized(group_size=group_size, bits=bits)

    def convert_like(self, plain: Any) -> Any:
        """``plain`` converted the way this cache was (``None``: not its plain kind)."""
        return self.from_plain(plain, bits=self.bits, group_size=self.group_size)

    @property
    def group_size(self) -> int:
        return self._codec.group_size

    @property
    def bits(self) -> int:
        return self._codec.bits

    @property
    def state(self) -> tuple[mx.array, ...]:
        """``(k_packed, k_scales, k_biases, v_packed, v_scales, v_biases)`` cut to ``offset``."""
        valid = self._valid()
        return () if valid is None else (*valid[0], *valid[1])

    @property
    def meta_state(self) -> tuple[str, ...]:
        """``(group_size, bits)`` as decimal strings."""
        return (str(self.group_size), str(self.bits))

    @classmethod
    def from_state(cls, state: Sequence[mx.array], meta_state: Sequence[str]) -> QuantizedKVCache:
        arrays = buf.check_state_len(state, (0, 6), owner=cls.kind)
        group_size, bits = buf.parse_meta(meta_state, ("group_size", "bits"), owner=cls.kind)
        cache = cls(group_size=group_size, bits=bits)
        if arrays:
            cache.keys, cache.values = tuple(arrays[:3]), tuple(arrays[3:])
            cache.offset = arrays[0].shape[2]
        return cache

    def empty_batch(self, left_padding: Sequence[int]) -> NoReturn:
        _refuse_batch(self.kind)

    @classmethod
    def merge(cls, caches: Sequence[QuantizedKVCache]) -> NoReturn:
        _refuse_batch(cls.kind)

    @classmethod
    def stack(cls, caches: Sequence[QuantizedKVCache]) -> BatchQuantizedKVCache:
        """A batch whose row ``i`` decodes bit for bit as ``caches[i]`` alone."""
        from mlx_loom.cache.batch import BatchQuantizedKVCache  # subclasses this module's kinds

        return BatchQuantizedKVCache.stack(caches)


class QuantizedRotatingKVCache(RotatingBase):
    """Sliding-window KV cache whose stored keys/values are affine-quantized.

    Same window semantics, masks, offsets and trim rule as
    :class:`~mlx_loom.cache.rotating.RotatingKVCache`.
    """

    kind: ClassVar[str] = "QuantizedRotatingKVCache"
    codec: ClassVar[str] = "affine"
    codec_bits: ClassVar[tuple[int, ...]] = buf.KV_BITS
    codec_default_bits: ClassVar[int] = 8

    def __init__(
        self, max_size: int, keep: int = 0, *, group_size: int = 64, bits: int = 8
    ) -> None:
        super().__init__(max_size, keep)
        self._codec = buf.AffineCodec(group_size, bits, owner=self.kind)

    @classmethod
    def from_plain(cls, cache: Any, *, bits: int, group_size: int = 64) -> Any:
        """``cache`` affine-quantized slot for slot if it is a :class:`RotatingKVCache`."""
        if type(cache) is not RotatingKVCache:
            return None
        return cache.to_quantized(group_size=group_size, bits=bits)

    def convert_like(self, plain: Any) -> Any:
        return self.from_plain(plain, bits=self.bits, group_size=self.group_size)

    @property
    def group_size(self) -> int:
        return self._codec.group_size

    @property
    def bits(self) -> int:
        return self._codec.bits

    @property
    def state(self) -> tuple[mx.array, ...]:
        """Six arrays (keys then values, each packed/scales/biases) in slot order."""
        return self._stored_state()

    @property
    def meta_state(self) -> tuple[str, ...]:
        """``(keep, max_size, offset, idx, group_size, bits)`` as decimal strings."""
        return (*self._window_meta(), str(self.group_size), str(self.bits))

    @classmethod
    def from_state(
        cls, state: Sequence[mx.array], meta_state: Sequence[str]
    ) -> QuantizedRotatingKVCache:
        arrays = buf.check_state_len(state, (0, 6), owner=cls.kind)
        keep, max_size, offset, idx, group_size, bits = buf.parse_meta(
            meta_state,
            ("keep", "max_size", "offset", "idx", "group_size", "bits"),
            owner=cls.kind,
        )
        cache = cls(max_size, keep, group_size=group_size, bits=bits)
        cache._restore_window(arrays, offset, idx)
        return cache

    def empty_batch(self, left_padding: Sequence[int]) -> NoReturn:
        _refuse_batch(self.kind)

    @classmethod
    def merge(cls, caches: Sequence[QuantizedRotatingKVCache]) -> NoReturn:
        _refuse_batch(cls.kind)

    @classmethod
    def stack(cls, caches: Sequence[QuantizedRotatingKVCache]) -> StackedQuantizedRotatingKVCache:
        """A batch whose row ``i`` decodes bit for bit as ``caches[i]`` alone."""
        # subclasses this module's kinds
        from mlx_loom.cache.stacked import StackedQuantizedRotatingKVCache

        return StackedQuantizedRotatingKVCache.stack(caches)
