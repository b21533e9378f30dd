"""The full key/value cache: every token of the sequence, grown in steps.

The buffer grows ``step`` (256) slots at a time and is written in place, so
decoding does not reallocate per token; fetched keys/values are the first
``offset`` slots. Slots hold what the cache's storage codec makes of a token
(plain, affine, TurboQuant, a plugin's; see :mod:`mlx_loom.cache.storage`).
Slot bookkeeping matches mlx-lm's ``KVCache`` (and, stored affine, its
``QuantizedKVCache``), which our parity tests compare against bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import mlx.core as mx

from mlx_loom.cache import _buffers as buf
from mlx_loom.cache.masks import mask_for_offset
from mlx_loom.cache.protocol import Mask
from mlx_loom.cache.rotating import RotatingKVCache
from mlx_loom.cache.storage import CodecLayout, split_meta
from mlx_loom.cache.turboquant import TurboQuantCodec
from mlx_loom.errors import CacheError

if TYPE_CHECKING:
    from mlx_loom.cache.batch import BatchKVCache

__all__ = ["KVCache"]


class KVCache(CodecLayout):
    """Full KV cache for one sequence (``B`` may be > 1 only without padding).

    ``codec`` is the storage codec (default plain): ``KVCache(codec=AffineCodec(64, 4))``
    is mlx-lm's ``QuantizedKVCache``.
    """

    kind: ClassVar[str] = "KVCache"
    step: ClassVar[int] = 256

    def __init__(self, *, codec: Any = None) -> None:
        self._take_codec(codec)
        self.keys: buf.Stored | None = None
        self.values: buf.Stored | None = None
        self.offset: int = 0

    # --- append and attend ----------------------------------------------

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        prev = self.offset
        L = keys.shape[2]
        if self.keys is None or self.values is None or prev + L > buf.seq_len(self.keys):
            n = (L + self.step - 1) // self.step * self.step
            new_k = self._codec.zeros_keys(keys, n)
            new_v = self._codec.zeros_values(values, n)
            if self.keys is None or self.values is None:
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
        if self.keys is None or self.values is None:
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

    # --- state ---------------------------------------------------------------

    @property
    def state(self) -> tuple[mx.array, ...]:
        """The stored keys then values (an array each, or the codec's arrays), cut to ``offset``."""
        if self.keys is None:
            return ()
        k, v = self.keys_and_values()
        return (*buf.leaves(k), *buf.leaves(v))

    @property
    def meta_state(self) -> tuple[str, ...]:
        """Nothing for plain storage; else the codec's name and fields."""
        return self._codec_meta()

    @classmethod
    def from_state(cls, state: Sequence[mx.array], meta_state: Sequence[str] = ()) -> KVCache:
        _, codec = split_meta(meta_state, 0, owner=cls.kind)
        cache = cls(codec=codec)
        n = cache._codec.leaves
        arrays = buf.check_state_len(state, (0, 2 * n), owner=cls.kind)
        if arrays:
            cache.keys, cache.values = _halves(arrays, n)
            cache.offset = arrays[0].shape[2]
        return cache

    # --- codecs, bounds and batches -------------------------------------------------

    def to_codec(self, codec: Any) -> KVCache:
        """The same tokens stored in ``codec`` (this cache must be plain)."""
        q = KVCache(codec=codec)
        q.offset = self.offset
        if self.keys is not None and self.values is not None:
            q.keys = codec.quantize_stored_keys(self.keys)
            q.values = codec.quantize_stored_values(self.values)
        return q

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> KVCache:
        """The same tokens, affine-quantized (as mlx-lm's ``KVCache.to_quantized``)."""
        return self.to_codec(buf.AffineCodec(group_size, bits, owner=self.kind))

    def to_turboquant(self, bits: int = 4) -> KVCache:
        """The same tokens in TurboQuant storage (int8 keys, ``bits``-wide rotated values)."""
        return self.to_codec(TurboQuantCodec(bits, owner=self.kind))

    def bounded(self, max_tokens: int) -> RotatingKVCache:
        """A fresh cache of this layer holding at most ``max_tokens``: a window, same codec.

        ``keep=0``: no leading tokens are pinned, so rows stay batchable.
        """
        return RotatingKVCache(max_tokens, 0, codec=self._codec)

    def empty_batch(self, left_padding: Sequence[int]) -> BatchKVCache:
        """An empty batch cache of this kind, one row per entry of ``left_padding``."""
        from mlx_loom.cache.batch import BatchKVCache  # subclasses this module's kinds

        if self.codec is not None:
            buf.refuse_padded_batch(self.kind, codec=self.codec, option="kv_bits / kv_codec")
        return BatchKVCache(left_padding)

    @classmethod
    def merge(cls, caches: Sequence[KVCache]) -> BatchKVCache:
        """A left-padded batch cache holding each single-row cache as one row (plain only)."""
        from mlx_loom.cache.batch import BatchKVCache  # subclasses this module's kinds

        for c in caches:
            if isinstance(c, KVCache) and c.codec is not None:
                buf.refuse_padded_batch(c.kind, codec=c.codec, option="kv_bits / kv_codec")
        return BatchKVCache.merge(caches)

    @classmethod
    def stack(cls, caches: Sequence[KVCache]) -> BatchKVCache:
        """A batch whose row ``i`` decodes bit for bit as ``caches[i]`` alone."""
        from mlx_loom.cache.batch import BatchKVCache  # subclasses this module's kinds

        return BatchKVCache.stack(caches)


def _halves(arrays: tuple[mx.array, ...], leaves: int) -> tuple[buf.Stored, buf.Stored]:
    """Stored keys and values from a state of ``2 * leaves`` arrays."""
    if leaves == 1:
        return arrays[0], arrays[1]
    return tuple(arrays[:leaves]), tuple(arrays[leaves:])


