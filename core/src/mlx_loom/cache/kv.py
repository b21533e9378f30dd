"""The full key/value cache: every token of the sequence, grown in steps.

The buffer grows ``step`` (256) slots at a time and is written in place, so
decoding does not reallocate per token; fetched keys/values are the first
``offset`` slots. Slot bookkeeping matches mlx-lm's ``KVCache`` (and its
``QuantizedKVCache``), which our parity tests compare against bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import mlx.core as mx

from mlx_loom.cache import _buffers as buf
from mlx_loom.cache.masks import mask_for_offset
from mlx_loom.cache.protocol import Mask
from mlx_loom.errors import CacheError

if TYPE_CHECKING:
    from mlx_loom.cache.batch import BatchKVCache
    from mlx_loom.cache.quantized import QuantizedKVCache
    from mlx_loom.cache.turboquant_caches import TurboQuantKVCache

__all__ = ["KVCache"]


class GrowingKV:
    """Slot bookkeeping shared by :class:`KVCache` and the quantized full cache.

    Subclasses set ``_codec`` (plain or affine) and ``kind``.
    """

    kind: ClassVar[str]
    step: ClassVar[int] = 256
    _codec: Any

    def __init__(self) -> None:
        self.keys: buf.Stored | None = None
        self.values: buf.Stored | None = None
        self.offset: int = 0

    # --- append and attend ----------------------------------------------

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        prev = self.offset
        L = keys.shape[2]
        if self.keys is None or prev + L > buf.seq_len(self.keys):
            n = (L + self.step - 1) // self.step * self.step
            new_k = self._codec.zeros_keys(keys, n)
            new_v = self._codec.zeros_values(values, n)
            if self.keys is None:
                self.keys, self.values = new_k, new_v
            else:
                if prev % self.step != 0:
                    # Drop the unused tail (left by a trim) before growing, as
                    # mlx-lm does, so buffer lengths match its cache.
                    self.keys = buf.take(self.keys, 0, prev)
                    self.values = buf.take(self.values, 0, prev)
                self.keys = buf.cat([self.keys, new_k])
                self.values = buf.cat([self.values, new_v])
        self.offset += L
        buf.write(self.keys, prev, self._codec.encode_keys(keys))
        buf.write(self.values, prev, self._codec.encode_values(values))
        return self.keys_and_values()

    def append(self, keys: mx.array, values: mx.array) -> Any:
        """Append this step's keys/values; return the view that attends over all of them."""
        return self._codec.view(*self.update_and_fetch(keys, values))

    def keys_and_values(self) -> tuple[Any, Any]:
        if self.keys is None:
            raise CacheError(f"{self.kind}: no keys/values yet", fix="call update_and_fetch first")
        if self.offset == buf.seq_len(self.keys):
            return self.keys, self.values
        return buf.take(self.keys, 0, self.offset), buf.take(self.values, 0, self.offset)

    def make_mask(
        self, N: int, *, window_size: int | None = None, return_array: bool = False
    ) -> Mask:
        return mask_for_offset(N, self.offset, window_size=window_size, return_array=return_array)

    # --- trim ---------------------------------------------------------------

    def is_trimmable(self) -> bool:
        """Always: every token is kept, so dropping the last ones is exact."""
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, buf.trim_count(n, owner=self.kind))
        self.offset -= n
        return n

    # --- size and state -------------------------------------------------------

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return buf.nbytes(self.keys, self.values)

    def _valid(self) -> tuple[buf.Stored, buf.Stored] | None:
        if self.keys is None:
            return None
        return self.keys_and_values()


class KVCache(GrowingKV):
    """Full KV cache for one sequence (``B`` may be > 1 only without padding)."""

    kind: ClassVar[str] = "KVCache"
    _codec = buf.PlainCodec()

    @property
    def state(self) -> tuple[mx.array, ...]:
        """``(keys, values)`` cut to ``offset`` (the unused growth tail is not state)."""
        valid = self._valid()
        return () if valid is None else valid

    @property
    def meta_state(self) -> tuple[str, ...]:
        return ()

    @classmethod
    def from_state(cls, state: Sequence[mx.array], meta_state: Sequence[str] = ()) -> KVCache:
        arrays = buf.check_state_len(state, (0, 2), owner=cls.kind)
        buf.parse_meta(meta_state, (), owner=cls.kind)
        cache = cls()
        if arrays:
            cache.keys, cache.values = arrays
            cache.offset = arrays[0].shape[2]
        return cache

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> QuantizedKVCache:
        """The same tokens, affine-quantized (as mlx-lm's ``KVCache.to_quantized``)."""
        from mlx_loom.cache.quantized import QuantizedKVCache  # subclasses this module's kinds

        q = QuantizedKVCache(group_size=group_size, bits=bits)
        q.offset = self.offset
        if self.keys is not None:
            q.keys = q._codec.quantize_stored_keys(self.keys)
            q.values = q._codec.quantize_stored_values(self.values)
        return q

    def to_turboquant(self, bits: int = 4) -> TurboQuantKVCache:
        """The same tokens in TurboQuant storage (int8 keys, ``bits``-wide rotated values)."""
        # subclasses this module's kinds
        from mlx_loom.cache.turboquant_caches import TurboQuantKVCache

        q = TurboQuantKVCache(bits=bits)
        q.offset = self.offset
        if self.keys is not None:
            q.keys = q._codec.quantize_stored_keys(self.keys)
            q.values = q._codec.quantize_stored_values(self.values)
        return q

    def empty_batch(self, left_padding: Sequence[int]) -> BatchKVCache:
        """An empty batch cache of this kind, one row per entry of ``left_padding``."""
        from mlx_loom.cache.batch import BatchKVCache  # subclasses this module's kinds

        return BatchKVCache(left_padding)

    @classmethod
    def merge(cls, caches: Sequence[KVCache]) -> BatchKVCache:
        """A left-padded batch cache holding each single-row cache as one row."""
        from mlx_loom.cache.batch import BatchKVCache  # subclasses this module's kinds

        return BatchKVCache.merge(caches)

    @classmethod
    def stack(cls, caches: Sequence[KVCache]) -> BatchKVCache:
        """A batch whose row ``i`` decodes bit for bit as ``caches[i]`` alone."""
        from mlx_loom.cache.batch import BatchKVCache  # subclasses this module's kinds

        return BatchKVCache.stack(caches)
