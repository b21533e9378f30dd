"""The sliding-window (rotating) key/value cache.

It keeps the first ``keep`` tokens plus the most recent ones, at most
``max_size`` slots in all. Single-token decode writes in place and wraps the
write index (the buffer is then *rotated*: not in time order); a multi-token
chunk first restores time order and then keeps ``max_size - 1`` old tokens so
every query of the chunk sees a full window. The slot bookkeeping matches
mlx-lm's ``RotatingKVCache`` bit for bit (parity-tested), with one deliberate
difference: :meth:`trim` refuses, with :class:`CacheNotTrimmable`, once the
window is full, where mlx-lm silently trims nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import mlx.core as mx

from mlx_loom.cache import _buffers as buf
from mlx_loom.cache import window_round as rnd
from mlx_loom.cache.checkpoint import Checkpoint, refuse_open_round
from mlx_loom.cache.masks import create_causal_mask
from mlx_loom.cache.protocol import Mask
from mlx_loom.cache.storage import CodecLayout, split_meta
from mlx_loom.cache.turboquant import TurboQuantCodec
from mlx_loom.errors import CacheError, CacheNotTrimmable, CapabilityRefused

if TYPE_CHECKING:
    from mlx_loom.cache.batch import BatchRotatingKVCache
    from mlx_loom.cache.stacked import StackedRotatingKVCache

__all__ = ["RotatingKVCache"]


def check_window(max_size: Any, keep: Any, *, owner: str) -> None:
    if isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < 1:
        raise CacheError(
            f"{owner}: max_size={max_size!r} must be a positive int",
            fix="pass the sliding window length in tokens",
        )
    if isinstance(keep, bool) or not isinstance(keep, int) or not 0 <= keep < max_size:
        raise CacheError(
            f"{owner}: keep={keep!r} must be an int in [0, max_size={max_size})",
            fix="keep fewer leading tokens than the window holds",
        )


class RotatingKVCache(CodecLayout):
    """Sliding-window KV cache of ``max_size`` slots keeping ``keep`` leading tokens.

    ``codec`` is the storage codec (default plain); slots move the same way
    whatever they hold, so a window in a codec holds, slot for slot, the
    codec's form of what the plain window holds.
    """

    kind: ClassVar[str] = "RotatingKVCache"
    step: ClassVar[int] = 256

    def __init__(self, max_size: int, keep: int = 0, *, codec: Any = None) -> None:
        check_window(max_size, keep, owner=self.kind)
        self._take_codec(codec)
        self.max_size = max_size
        self.keep = keep
        self.keys: buf.Stored | None = None
        self.values: buf.Stored | None = None
        self.offset: int = 0
        # Next write slot; equals the buffer length while it is in time order.
        self._idx: int = 0
        self._round: rnd.WindowRound | None = None

    # --- slot moves -----------------------------------------------------------

    def _drop_oldest(self, v: buf.Stored, n: int, append: buf.Stored | None = None) -> buf.Stored:
        """Drop ``n`` slots after the ``keep`` prefix, then append ``append``."""
        parts = [buf.take(v, 0, self.keep), buf.take(v, n + self.keep, None)] if n > 0 else [v]
        if append is not None:
            parts.append(append)
        return buf.cat(parts)

    def _time_ordered(self, v: buf.Stored) -> buf.Stored:
        """The buffer in time order, unused tail slots cut off."""
        if self._idx == buf.seq_len(v):
            return v
        if self._idx < self.offset:  # wrapped: oldest non-kept slots start at _idx
            return buf.cat(
                [
                    buf.take(v, 0, self.keep),
                    buf.take(v, self._idx, None),
                    buf.take(v, self.keep, self._idx),
                ]
            )
        return buf.take(v, 0, self._idx)

    def _append_chunk(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        new_k, new_v = self._codec.encode_keys(keys), self._codec.encode_values(values)
        if self.keys is None or self.values is None:
            self.keys, self.values = new_k, new_v
        else:
            self.keys = self._time_ordered(self.keys)
            self.values = self._time_ordered(self.values)
            self._idx = buf.seq_len(self.keys)
            # Keep max_size - 1 old tokens: with the chunk's own tokens every
            # query then sees a full window (the mask enforces the window).
            drop = self._idx - self.max_size + 1
            self.keys = self._drop_oldest(self.keys, drop, new_k)
            self.values = self._drop_oldest(self.values, drop, new_v)
        self.offset += keys.shape[2]
        self._idx = buf.seq_len(self.keys)
        return self.keys, self.values

    def prepare_write(self, keys: mx.array, values: mx.array) -> None:
        """The slot housekeeping before a one-token write: grow, drop the excess, wrap.

        ``keys``/``values`` give the new slots' shapes and dtype (the step's
        keys and values, or plain buffers). Idempotent: after it, the write index is the slot the
        token goes to, which is what the compiled decode step needs to know
        before its forward (:mod:`mlx_loom.cpu.compiled_step`).
        """
        prev = self.offset
        if (
            self.keys is None
            or self.values is None
            or (prev >= buf.seq_len(self.keys) and buf.seq_len(self.keys) < self.max_size)
        ):
            n = min(self.step, self.max_size - prev)
            new_k, new_v = self._codec.zeros_keys(keys, n), self._codec.zeros_values(values, n)
            if self.keys is None or self.values is None:
                self.keys, self.values = new_k, new_v
            else:
                self.keys = buf.cat([self.keys, new_k])
                self.values = buf.cat([self.values, new_v])
            self._idx = prev
        # A chunk may have left more than max_size slots: drop the oldest.
        excess = buf.seq_len(self.keys) - self.max_size
        if excess > 0:
            self.keys = self._drop_oldest(self.keys, excess)
            self.values = self._drop_oldest(self.values, excess)
            self._idx = self.max_size
        if self._idx == self.max_size:  # wrap past the kept prefix
            self._idx = self.keep

    @property
    def write_slot(self) -> int:
        """The slot the next one-token write goes to, once :meth:`prepare_write` ran."""
        return self._idx

    def written(self, keys: buf.Stored, values: buf.Stored) -> None:
        """Take buffers holding one more token, written at :attr:`write_slot` elsewhere
        (the compiled decode step writes inside its traced forward)."""
        self.keys, self.values = keys, values
        self.offset += 1
        self._idx += 1

    def _write_in_place(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        S = keys.shape[2]
        self.prepare_write(keys, values)
        assert self.keys is not None and self.values is not None
        buf.write(self.keys, self._idx, self._codec.encode_keys(keys))
        buf.write(self.values, self._idx, self._codec.encode_values(values))
        self.offset += S
        self._idx += S
        return self.keys_and_values()

    # --- append and attend ----------------------------------------------

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        if self._round is not None:
            return self._round_append(keys, values)
        if keys.shape[2] == 1:
            return self._write_in_place(keys, values)
        return self._append_chunk(keys, values)

    def append(self, keys: mx.array, values: mx.array) -> Any:
        """Append this step's keys/values; return the view that attends over the window."""
        return self._codec.view(*self.update_and_fetch(keys, values))

    def keys_and_values(self) -> tuple[Any, Any]:
        if self.keys is None or self.values is None:
            raise CacheError(f"{self.kind}: no keys/values yet", fix="call update_and_fetch first")
        if self.offset < buf.seq_len(self.keys):
            return buf.take(self.keys, 0, self.offset), buf.take(self.values, 0, self.offset)
        return self.keys, self.values

    def make_mask(
        self, N: int, *, window_size: int | None = None, return_array: bool = False
    ) -> Mask:
        if self._round is not None:
            return self._round_mask(N, window_size)
        if N > 1:
            window_size = window_size or self.max_size
            offset = min(self.max_size - 1, self.offset)
            if offset + N > window_size or return_array:
                return create_causal_mask(N, offset, window_size=window_size)
            return "causal"
        if window_size is None:
            return None
        # A window narrower than the buffer needs a mask on the rotated slots.
        if self.offset >= window_size and self.max_size > window_size:
            idx = 0 if self._idx >= self.max_size else self._idx
            n = self.offset + 1 if self.offset < self.max_size else self.max_size
            mask = mx.arange(n) >= (n - window_size)
            return mx.roll(mask, idx + 1)
        return None

    # --- speculative rounds ---------------------------------------------------

    @property
    def in_round(self) -> bool:
        return self._round is not None

    def begin_round(self) -> None:
        """Open a round: until :meth:`commit`, forwards attend without overwriting a slot."""
        if self._round is not None:
            raise CacheError(
                f"{self.kind}.begin_round called while a round is open",
                fix="commit(keep) the open round before beginning another",
            )
        before = (self.keys, self.values, self._idx)
        if (
            self.keys is not None
            and self.values is not None
            and buf.seq_len(self.keys) > self.max_size
        ):
            # What the next one-token write would do first (drop the oldest
            # slots a chunk left beyond the window); pure data movement, into
            # new arrays, so the window as it was can come back at commit(0).
            excess = buf.seq_len(self.keys) - self.max_size
            self.keys = self._drop_oldest(self.keys, excess)
            self.values = self._drop_oldest(self.values, excess)
            self._idx = self.max_size
        self._round = rnd.WindowRound(self.offset, before)

    def commit(self, keep: int | Sequence[int]) -> None:
        """Keep the round's first ``keep`` tokens, written as one-token decoding writes them."""
        r = self._round
        if r is None:
            raise CacheError(
                f"{self.kind}.commit called with no open round",
                fix="call begin_round() before verifying a window",
            )
        if not isinstance(keep, int):
            counts = list(keep)
            if len(counts) != 1:
                raise CacheError(
                    f"{self.kind}.commit got {len(counts)} keep counts for 1 row",
                    fix="pass one keep count per row, or a single int",
                )
            keep = int(counts[0])
        if isinstance(keep, bool) or not 0 <= keep <= r.pending:
            raise CacheError(
                f"{self.kind}.commit(keep={keep!r}) is outside the round's {r.pending} token(s)",
                fix=f"keep between 0 and {r.pending} tokens",
            )
        self._round = None
        self.offset = r.offset
        if keep == 0:
            self.keys, self.values, self._idx = r.before
            return
        keys = mx.concatenate(r.keys, axis=2)
        values = mx.concatenate(r.values, axis=2)
        for t in range(keep):
            self._write_in_place(keys[:, :, t : t + 1], values[:, :, t : t + 1])

    def _layout(self, count: int) -> rnd.Layout:
        r = self._round
        assert r is not None
        return rnd.decode_layout(
            length=0 if self.keys is None else buf.seq_len(self.keys),
            idx=self._idx,
            offset=r.offset,
            max_size=self.max_size,
            keep=self.keep,
            step=self.step,
            count=count,
        )

    def _round_window(self, window_size: int | None) -> int | None:
        return window_size if window_size is not None and window_size < self.max_size else None

    def _round_mask(self, N: int, window_size: int | None) -> mx.array:
        r = self._round
        assert r is not None
        first = r.pending
        layout = self._layout(first + N)
        old = 0 if self.keys is None else buf.seq_len(self.keys)
        _, entries = rnd.combined_order(layout, old)
        return rnd.combined_mask(
            layout,
            entries,
            first=first,
            n=N,
            offset=r.offset,
            window=self._round_window(window_size),
        )

    def _round_append(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        r = self._round
        assert r is not None
        r.keys.append(keys)
        r.values.append(values)
        self.offset += keys.shape[2]
        layout = self._layout(r.pending)
        old = 0 if self.keys is None else buf.seq_len(self.keys)
        index, _ = rnd.combined_order(layout, old)
        new_k = self._codec.encode_keys(mx.concatenate(r.keys, axis=2))
        new_v = self._codec.encode_values(mx.concatenate(r.values, axis=2))
        if self.keys is None or self.values is None:
            src_k, src_v = new_k, new_v
        else:
            src_k, src_v = buf.cat([self.keys, new_k]), buf.cat([self.values, new_v])
        return rnd.gather(src_k, index), rnd.gather(src_v, index)

    # --- trim -----------------------------------------------------------------

    def is_trimmable(self) -> bool:
        """True while the window has never filled, so no token was dropped.

        Once ``offset`` reaches ``max_size`` the buffer may have wrapped or
        dropped tokens that a trimmed sequence would need again; we then
        refuse rather than return a wrong window.
        """
        return self.offset < self.max_size

    def trim(self, n: int) -> int:
        n = min(self.offset, buf.trim_count(n, owner=self.kind))
        if n == 0:
            return 0
        if self._round is not None:
            raise CacheError(
                f"{self.kind}.trim called while a speculative round is open",
                fix="roll the round back with commit(keep) instead",
            )
        if not self.is_trimmable():
            raise CacheNotTrimmable(
                f"{self.kind}(max_size={self.max_size}, keep={self.keep}) cannot trim {n} "
                f"token(s) at offset {self.offset}: the window is full, so older tokens were "
                "already overwritten or dropped and the trimmed window would be wrong",
                fix="roll a speculative window back with begin_round()/commit(keep), which "
                "needs no trim, or keep prompts within the window",
            )
        self.offset -= n
        self._idx -= n
        return n

    # --- checkpoints ---------------------------------------------------------

    def checkpoint(self) -> Checkpoint:
        """This window (its slots, offset and write index) as an immutable snapshot.

        A window that has filled cannot be trimmed back, so the prefix store
        keeps these at chosen positions instead; :meth:`Checkpoint.restore`
        gives a new window that decodes exactly as this one would.
        """
        refuse_open_round(self, self._round is not None)
        kind: Any = self  # each window kind names its own state and meta_state
        return Checkpoint.of(self, kind.state, kind.meta_state, self.offset)

    # --- size and state -------------------------------------------------------

    def size(self) -> int:
        return min(self.offset, self.max_size)

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return buf.nbytes(self.keys, self.values)

    def _stored_state(self) -> tuple[mx.array, ...]:
        if self.keys is None:
            return ()
        k, v = self.keys_and_values()
        return (*buf.leaves(k), *buf.leaves(v))

    def _window_meta(self) -> tuple[str, ...]:
        return (str(self.keep), str(self.max_size), str(self.offset), str(self._idx))

    def _restore_window(self, arrays: tuple[mx.array, ...], offset: int, idx: int) -> None:
        # Positions that no saved window can have would index past the buffer
        # on the next write: slots in use never exceed tokens seen, and the
        # write index never passes the slots in use.
        slots = arrays[0].shape[2] if arrays and arrays[0].ndim == 4 else 0
        if not idx <= slots <= offset or any(a.ndim != 4 or a.shape[2] != slots for a in arrays):
            raise CacheError(
                f"{self.kind}.from_state: offset={offset}, idx={idx} and arrays of shapes "
                f"{[tuple(a.shape) for a in arrays]} do not describe a window "
                "(need idx <= slots <= offset, every array [B, H, slots, D])",
                fix="recreate the cache state with this version of mlx-loom",
            )
        if arrays:
            half = len(arrays) // 2
            k, v = arrays[:half], arrays[half:]
            self.keys = k[0] if half == 1 else tuple(k)
            self.values = v[0] if half == 1 else tuple(v)
        self.offset = offset
        self._idx = idx


    # --- state ----------------------------------------------------------------

    @property
    def state(self) -> tuple[mx.array, ...]:
        """The stored keys then values (each an array, or the codec's arrays) in slot order."""
        return self._stored_state()

    @property
    def meta_state(self) -> tuple[str, ...]:
        """``(keep, max_size, offset, idx)`` as decimal strings, then the codec's part."""
        return (*self._window_meta(), *self._codec_meta())

    @classmethod
    def from_state(cls, state: Sequence[mx.array], meta_state: Sequence[str]) -> RotatingKVCache:
        own, codec = split_meta(meta_state, 4, owner=cls.kind)
        keep, max_size, offset, idx = buf.parse_meta(
            own, ("keep", "max_size", "offset", "idx"), owner=cls.kind
        )
        cache = cls(max_size, keep, codec=codec)
        arrays = buf.check_state_len(state, (0, 2 * cache._codec.leaves), owner=cls.kind)
        cache._restore_window(arrays, offset, idx)
        return cache

    # --- codecs, bounds and batches -------------------------------------------------

    def to_codec(self, codec: Any) -> RotatingKVCache:
        """The same window stored in ``codec``, slot for slot (this cache must be plain)."""
        q = RotatingKVCache(self.max_size, self.keep, codec=codec)
        q.offset, q._idx = self.offset, self._idx
        if self.keys is not None and self.values is not None:
            q.keys = codec.quantize_stored_keys(self.keys)
            q.values = codec.quantize_stored_values(self.values)
        return q

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> RotatingKVCache:
        """The same window, affine-quantized slot for slot (mlx-lm cannot do this)."""
        return self.to_codec(buf.AffineCodec(group_size, bits, owner=self.kind))

    def to_turboquant(self, bits: int = 4) -> RotatingKVCache:
        """The same window in TurboQuant storage, slot for slot."""
        return self.to_codec(TurboQuantCodec(bits, owner=self.kind))

    def bounded(self, max_tokens: int) -> RotatingKVCache:
        """A fresh window of at most ``max_tokens`` slots, same ``keep`` and codec.

        This cache itself when its window is already that narrow; refused
        (:class:`CapabilityRefused`) when the kept leading tokens would fill it.
        """
        if self.keep >= min(max_tokens, self.max_size):
            raise CapabilityRefused(
                f"max_kv_size={max_tokens} cannot bound a {self.kind}(max_size={self.max_size}, "
                f"keep={self.keep}): its kept leading tokens would fill the window",
                fix="Drop max_kv_size for this model, or raise it above the kept tokens.",
            )
        if self.max_size <= max_tokens:
            return self
        return RotatingKVCache(max_tokens, self.keep, codec=self._codec)

    def _check_batchable(self) -> None:
        if self.keep != 0:
            raise CapabilityRefused(
                f"{self.kind}(max_size={self.max_size}, keep={self.keep}): batching a "
                "sliding-window cache that keeps leading tokens is not supported",
                fix="generate this model one sequence at a time, or use keep=0",
            )

    def empty_batch(self, left_padding: Sequence[int]) -> BatchRotatingKVCache:
        """An empty batch window cache with this ``max_size`` (plain storage only)."""
        from mlx_loom.cache.batch import BatchRotatingKVCache  # subclasses this module's kinds

        if self.codec is not None:
            buf.refuse_padded_batch(self.kind, codec=self.codec, option="kv_bits / kv_codec")
        self._check_batchable()
        return BatchRotatingKVCache(self.max_size, left_padding)

    @classmethod
    def merge(cls, caches: Sequence[RotatingKVCache]) -> BatchRotatingKVCache:
        """mlx-lm's batch layout: rows re-aligned on one shared write index (plain only)."""
        from mlx_loom.cache.batch import BatchRotatingKVCache  # subclasses this module's kinds

        for c in caches:
            if isinstance(c, RotatingKVCache) and c.codec is not None:
                buf.refuse_padded_batch(c.kind, codec=c.codec, option="kv_bits / kv_codec")
        return BatchRotatingKVCache.merge(caches)

    @classmethod
    def stack(cls, caches: Sequence[RotatingKVCache]) -> StackedRotatingKVCache:
        """A batch whose row ``i`` decodes bit for bit as ``caches[i]`` alone.

        Unlike :meth:`merge`, each row keeps its own slot order (see
        :mod:`mlx_loom.cache.stacked` for why that matters).
        """
        from mlx_loom.cache.stacked import StackedRotatingKVCache  # subclasses this module's kinds

        return StackedRotatingKVCache.stack(caches)
