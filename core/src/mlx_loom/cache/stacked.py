"""Sliding-window caches of several rows, each row in its own slot order.

A single-row :class:`~mlx_loom.cache.RotatingKVCache` writes its newest token
at a write index that wraps around the window, so the order of its slots is
a rotation of time order that depends on the row's own history (prompt
length, chunking, decode steps). Attention reduces over the slots in slot
order, and floating-point sums depend on their order: a batch layout that
re-aligns rows on a shared write index (mlx-lm's ``BatchRotatingKVCache``,
kept as :class:`~mlx_loom.cache.BatchRotatingKVCache`) therefore changes
each row's logits slightly (measured: up to 2.5e-6 on a tiny Gemma 4, 1.8e-7
on a tiny sliding Llama).

Here each row keeps exactly the slots its own cache would hold, in the same
order, and writes at its own index. Slots a row has not filled yet are
masked; on the CPU backend a masked slot adds an exact zero to the softmax
and to the value sum, so a row decodes bit for bit as it would alone (tested
per family). The price is a per-row scatter for each write instead of one
slice update, which is small next to the attention it feeds.

The kind supports what a decoding batch needs — one-token appends,
:meth:`filter`, :meth:`extend`, :meth:`extract`, :meth:`stack` — for
windows that keep no leading tokens (``keep == 0``). Prefill chunks are
refused: prompts are prefilled in a row's own cache before it joins a batch.

Speculative verify windows run in a round (:meth:`begin_round` /
:meth:`commit` with one keep count per row), exactly as a single window's
(:mod:`mlx_loom.cache.window_round`): each row attends over its own slots
and the round's tokens in its own one-token decode order (rows padded to
one length with masked entries), and commit writes each row's kept tokens
as one-token writes at that row's own index.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, cast

import mlx.core as mx

from mlx_loom.cache import _buffers as buf
from mlx_loom.cache import window_round as rnd
from mlx_loom.cache.protocol import Mask
from mlx_loom.cache.rotating import RotatingKVCache, check_window
from mlx_loom.cache.storage import CodecLayout, common_codec, split_meta
from mlx_loom.errors import CacheError, CacheNotTrimmable, CapabilityRefused

__all__ = ["StackedRotatingKVCache"]


def _row_slots(cache: RotatingKVCache) -> tuple[buf.Stored | None, buf.Stored | None, int, int]:
    """``(keys, values, count, next_write)`` of a single-row window, normalised.

    After a prefill chunk a window may hold more than ``max_size`` slots (in
    time order); its next one-token write first drops the oldest excess and
    then wraps to slot 0. Normalising that here — keep the newest
    ``max_size`` slots, next write at 0 — gives the layout the row will have
    after that write, so the batch can write every row the same way.
    """
    W = cache.max_size
    if cache.keys is None or cache.values is None:
        return None, None, 0, 0
    count = cache.offset
    length = buf.seq_len(cache.keys)
    if count < W:  # never full: time order, next write at the end
        return (
            buf.take(cache.keys, 0, count),
            buf.take(cache.values, 0, count),
            count,
            count,
        )
    if length > W:
        return (
            buf.take(cache.keys, length - W, None),
            buf.take(cache.values, length - W, None),
            count,
            0,
        )
    return cache.keys, cache.values, count, cache._idx % W


class StackedRotatingKVCache(CodecLayout):
    """Sliding-window KV cache (``keep == 0``) for several rows, each in its own slot order.

    ``codec`` is the storage codec its rows share (default plain).
    """

    kind: ClassVar[str] = "StackedRotatingKVCache"
    step: ClassVar[int] = 256
    _single: ClassVar[type[RotatingKVCache]] = RotatingKVCache

    def __init__(self, max_size: int, rows: int = 0, *, codec: Any = None) -> None:
        check_window(max_size, 0, owner=self.kind)
        self._take_codec(codec)
        self.max_size = max_size
        self.keys: buf.Stored | None = None
        self.values: buf.Stored | None = None
        # Per row: tokens written so far, and the slot the next token goes to.
        self._count: list[int] = [0] * rows
        self._next: list[int] = [0] * rows
        self._offset_array: mx.array | None = None
        #: The round's tokens, one entry per forward (``None``: no round open).
        self._round: tuple[list[mx.array], list[mx.array]] | None = None

    # --- geometry -------------------------------------------------------------

    @property
    def batch_size(self) -> int:
        return len(self._count)

    @property
    def offset(self) -> mx.array:
        """Tokens seen per row (``[B]`` int32): each row's RoPE position."""
        if self._offset_array is None:
            pending = self._pending()
            self._offset_array = mx.array([c + pending for c in self._count], dtype=mx.int32)
        return self._offset_array

    def _pending(self) -> int:
        return 0 if self._round is None else sum(k.shape[2] for k in self._round[0])

    def _slots(self) -> int:
        return 0 if self.keys is None else buf.seq_len(self.keys)

    def _slots_after_write(self) -> int:
        """Slots the buffer has once the next one-token write has grown it (if needed)."""
        need = max(self._next, default=0) + 1
        if need <= self._slots():
            return self._slots()
        return min(self.max_size, -(-need // self.step) * self.step)

    # --- append and attend --------------------------------------------------

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        if self._round is not None:
            return self._round_append(keys, values)
        B, _, L, _ = keys.shape
        if L != 1:
            raise CacheError(
                f"{self.kind}: appending {L} tokens at once is not supported (one per row)",
                fix="prefill prompts in each row's own cache, then stack the rows",
            )
        if B != self.batch_size:
            raise CacheError(
                f"{self.kind}: got keys for {B} rows; the batch has {self.batch_size}",
                fix="pass one row of keys/values per batch row",
            )
        self._grow_for_write(keys, values)
        where = mx.array(self._next, dtype=mx.int32)[:, None, None, None]
        stored_k, stored_v = self._stored()
        self.keys = _scatter(stored_k, where, self._codec.encode_keys(keys))
        self.values = _scatter(stored_v, where, self._codec.encode_values(values))
        W = self.max_size
        self._count = [c + 1 for c in self._count]
        self._next = [(n + 1) % W for n in self._next]
        self._offset_array = None
        return self.keys, self.values

    def append(self, keys: mx.array, values: mx.array) -> Any:
        """Append one token per row; return the view that attends over every row's window."""
        return self._codec.view(*self.update_and_fetch(keys, values))

    # --- one token written by a compiled step (mlx_loom.cpu.compiled_step) -----

    def takes_traced_token(self) -> bool:
        """Whether a traced one-token step may write this batch: plain storage, already
        written, no speculative round open."""
        return bool(
            self.plain
            and isinstance(self.keys, mx.array)
            and isinstance(self.values, mx.array)
            and self._round is None
            and self.batch_size > 0
        )

    def prepare_traced_write(self) -> tuple[mx.array, mx.array]:
        """Grow the buffers as the next one-token write would, and return each row's
        tokens so far and the slot its token goes to (int32 ``[B]``): what a
        traced step needs to write and mask exactly as :meth:`update_and_fetch`
        and :meth:`make_mask` do."""
        keys, values = self._stored()
        self._grow_for_write(cast(mx.array, keys), cast(mx.array, values))
        return (
            mx.array(self._count, dtype=mx.int32),
            mx.array(self._next, dtype=mx.int32),
        )

    def traced_written(self, keys: mx.array, values: mx.array) -> None:
        """Take the buffers a traced step returned after writing one token per row."""
        self.keys, self.values = keys, values
        W = self.max_size
        self._count = [c + 1 for c in self._count]
        self._next = [(n + 1) % W for n in self._next]
        self._offset_array = None

    # --- a row replaced in place (a parked row's place taken) ------------------

    def takes_row(self, single: Any) -> bool:
        """Whether :meth:`put_row` can write ``single`` over a row of this batch in
        place: a written window of the same size and codec, keeping no leading
        tokens, whose slots fit the batch's buffer, no round open."""
        if type(single) is not self._single or self._round is not None:
            return False
        if single.max_size != self.max_size or single.keep != 0 or single.in_round:
            return False
        if single.codec_key != self.codec_key or self.keys is None:
            return False
        keys, _, count, _ = _row_slots(single)
        return keys is not None and count > 0 and buf.seq_len(keys) <= self._slots()

    def put_row(self, row: int, single: RotatingKVCache) -> None:
        """Make row ``row`` hold ``single``'s slots in its own order, as :meth:`stack`
        lays a row out; the buffers are written in place."""
        if not self.takes_row(single):
            raise CacheError(
                f"{self.kind}.put_row: this {type(single).__name__} cannot take a row's place",
                fix="check takes_row() first; stack or extend otherwise",
            )
        row = _check_rows([row], self.batch_size, owner=f"{self.kind}.put_row")[0]
        keys, values, count, nxt = _row_slots(single)
        assert keys is not None and values is not None
        S = self._slots()
        stored_k, stored_v = self._stored()
        for batch, one in ((stored_k, keys), (stored_v, values)):
            for b, a in zip(buf.leaves(batch), buf.leaves(one), strict=True):
                b[row : row + 1] = mx.pad(a, [(0, 0), (0, 0), (0, S - a.shape[2]), (0, 0)])
        self._count[row], self._next[row] = count, nxt
        self._offset_array = None

    # --- speculative rounds -------------------------------------------------------

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
        self._round = ([], [])
        self._offset_array = None

    def _row_layout(self, row: int, count: int) -> rnd.Layout:
        """Row ``row``'s one-token decode layout for ``count`` new tokens."""
        W, n, nxt = self.max_size, self._count[row], self._next[row]
        return rnd.decode_layout(
            length=min(n, W),
            idx=(nxt or W) if n >= W else n,
            offset=n,
            max_size=W,
            keep=0,
            step=self.step,
            count=count,
        )

    def _round_orders(self, total: int) -> list[tuple[rnd.Layout, list[int], list[Any]]]:
        out = []
        for i in range(self.batch_size):
            layout = self._row_layout(i, total)
            index, entries = rnd.combined_order(
                layout, min(self._count[i], self.max_size), self._slots()
            )
            out.append((layout, index, entries))
        return out

    def make_mask(
        self, N: int, *, window_size: int | None = None, return_array: bool = False
    ) -> Mask:
        if self._round is not None:
            first = self._pending()
            orders = self._round_orders(first + N)
            width = max(len(index) for _, index, _ in orders)
            narrower = window_size is not None and window_size < self.max_size
            window = window_size if narrower else None
            rows = []
            for i, (layout, _, entries) in enumerate(orders):
                m = rnd.combined_mask(
                    layout, entries, first=first, n=N, offset=self._count[i], window=window
                )
                rows.append(mx.pad(m, [(0, 0), (0, width - m.shape[1])], constant_values=False))
            return mx.stack(rows)[:, None]
        return self._decode_mask(N, window_size)

    def _round_append(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        r = self._round
        assert r is not None
        r[0].append(keys)
        r[1].append(values)
        self._offset_array = None
        total = self._pending()
        orders = self._round_orders(total)
        width = max(len(index) for _, index, _ in orders)
        index = mx.array([ix + [0] * (width - len(ix)) for _, ix, _ in orders], dtype=mx.int32)
        where = index[:, None, :, None]
        new_k = self._codec.encode_keys(mx.concatenate(r[0], axis=2))
        new_v = self._codec.encode_values(mx.concatenate(r[1], axis=2))
        src_k = new_k if self.keys is None else buf.cat([self.keys, new_k])
        src_v = new_v if self.values is None else buf.cat([self.values, new_v])
        pick = lambda a: mx.take_along_axis(a, where, axis=2)  # noqa: E731
        return buf.apply(pick, src_k), buf.apply(pick, src_v)

    def commit(self, keep: int | Sequence[int]) -> None:
        """Keep the round's first ``keep[i]`` tokens in row ``i``, written as one-token decode."""
        r = self._round
        if r is None:
            raise CacheError(
                f"{self.kind}.commit called with no open round",
                fix="call begin_round() before verifying a window",
            )
        total = self._pending()
        counts = [keep] * self.batch_size if isinstance(keep, int) else [int(k) for k in keep]
        if len(counts) != self.batch_size or any(not 0 <= k <= total for k in counts):
            raise CacheError(
                f"{self.kind}.commit(keep={keep!r}) does not give each of {self.batch_size} "
                f"rows a count within the round's {total} token(s)",
                fix="pass one keep count per row, each between 0 and the window",
            )
        self._round = None
        self._offset_array = None
        if not any(counts):
            return
        keys = mx.concatenate(r[0], axis=2)
        values = mx.concatenate(r[1], axis=2)
        for t in range(max(counts)):
            writing = [k > t for k in counts]
            self._write_rows(keys[:, :, t : t + 1], values[:, :, t : t + 1], writing)

    def _grow_for_write(self, keys: mx.array, values: mx.array) -> None:
        """Add the empty slots the next one-token write needs (none once the window is full)."""
        slots = self._slots_after_write()
        if slots <= self._slots():
            return
        grow = slots - self._slots()
        new_k = self._codec.zeros_keys(keys, grow)
        new_v = self._codec.zeros_values(values, grow)
        if self.keys is None or self.values is None:
            self.keys, self.values = new_k, new_v
        else:
            self.keys = buf.cat([self.keys, new_k])
            self.values = buf.cat([self.values, new_v])

    def _write_rows(self, keys: mx.array, values: mx.array, writing: list[bool]) -> None:
        """One-token writes for the rows in ``writing``; the other rows keep every slot."""
        if all(writing):
            self.update_and_fetch(keys, values)
            return
        self._grow_for_write(keys, values)
        where = mx.array(self._next, dtype=mx.int32)[:, None, None, None]
        on = mx.array(writing)[:, None, None, None]

        def merged(stored: buf.Stored, new: buf.Stored) -> buf.Stored:
            def one(b: mx.array, n: mx.array) -> mx.array:
                old = mx.take_along_axis(b, where, axis=2)
                return mx.put_along_axis(b, where, mx.where(on, n, old), axis=2)

            pairs = zip(buf.leaves(stored), buf.leaves(new), strict=True)
            return buf.rebuild(stored, [one(b, n) for b, n in pairs])

        stored_k, stored_v = self._stored()
        self.keys = merged(stored_k, self._codec.encode_keys(keys))
        self.values = merged(stored_v, self._codec.encode_values(values))
        W = self.max_size
        self._count = [c + w for c, w in zip(self._count, writing, strict=True)]
        self._next = [(n + 1) % W if w else n for n, w in zip(self._next, writing, strict=True)]
        self._offset_array = None

    def _positions(self, window: int) -> mx.array:
        """``[B, S]`` bool: which slots the row's next token attends to (after its write)."""
        S = self._slots_after_write()
        W = self.max_size
        slot = mx.arange(S)[None]
        newest = mx.array(self._count, dtype=mx.int32)[:, None]  # position being written
        after = mx.array([(n + 1) % W for n in self._next], dtype=mx.int32)[:, None]
        wrapped = newest >= W  # the write lands in a full window
        # Full window: slot s holds the token (after - 1 - s) mod W steps older
        # than the newest; otherwise slots are in time order.
        age = mx.where(wrapped, (after - 1 - slot) % W, newest - slot)
        return (age >= 0) & (age < min(window, W)) & (slot < W)

    def _decode_mask(self, N: int, window_size: int | None) -> Mask:
        if N != 1:
            raise CacheError(
                f"{self.kind}: a mask for {N} new tokens per row is not supported (one per row)",
                fix="prefill prompts in each row's own cache, then stack the rows",
            )
        window = window_size or self.max_size
        return self._positions(window)[:, None, None, :]

    # --- padding: none ---------------------------------------------------------

    def prepare(
        self,
        *,
        left_padding: Sequence[int] | None = None,
        lengths: Sequence[int] | None = None,
        right_padding: Sequence[int] | None = None,
    ) -> None:
        """Rows here are never padded: any padding declared is refused."""
        declared = [p for p in (left_padding, right_padding) if p is not None and any(p)]
        if declared or lengths is not None:
            raise CacheError(
                f"{self.kind}: padded prefill is not supported; each row holds only its own tokens",
                fix="prefill each prompt in its own single-row cache, then stack() the rows",
            )

    def finalize(self) -> None:
        """Nothing to fold away: rows are never padded."""

    # --- trim -----------------------------------------------------------------

    def is_trimmable(self) -> bool:
        return False

    def trim(self, n: int) -> int:
        n = buf.trim_count(n, owner=self.kind)
        if n == 0:
            return 0
        raise CacheNotTrimmable(
            f"{self.kind} cannot trim {n} token(s): its rows rotate independently",
            fix="extract() the row and trim the single-row window cache",
        )

    # --- rows -----------------------------------------------------------------

    def filter(self, rows: Sequence[int]) -> None:
        idx = _check_rows(rows, self.batch_size, owner=f"{self.kind}.filter")
        if self.keys is not None and self.values is not None:
            take = mx.array(idx, dtype=mx.int32)
            self.keys = buf.apply(lambda a: a[take], self.keys)
            self.values = buf.apply(lambda a: a[take], self.values)
        self._count = [self._count[i] for i in idx]
        self._next = [self._next[i] for i in idx]
        self._offset_array = None

    def _compatible(self, other: Any) -> None:
        if type(other) is not type(self):
            raise CacheError(
                f"{self.kind}.extend: cannot append rows of a {type(other).__name__}",
                fix=f"extend a {self.kind} only with another {self.kind}",
            )
        if other.max_size != self.max_size:
            raise CacheError(
                f"{self.kind}.extend: max_size {other.max_size} differs from {self.max_size}",
                fix="extend only with a batch cache of the same window",
            )
        self._check_codec(other, "extend")

    def extend(self, other: StackedRotatingKVCache) -> None:
        self._compatible(other)
        if other.keys is not None or self.keys is not None:
            S = max(self._slots(), other._slots())
            ref_k, ref_v = (self if self.keys is not None else other)._stored()
            self.keys = _cat_rows([_padded(c.keys, ref_k, c.batch_size, S) for c in (self, other)])
            self.values = _cat_rows(
                [_padded(c.values, ref_v, c.batch_size, S) for c in (self, other)]
            )
        self._count = self._count + other._count
        self._next = self._next + other._next
        self._offset_array = None

    def _empty_single(self) -> RotatingKVCache:
        return self._single(self.max_size, 0, codec=self._codec)

    def extract(self, row: int) -> RotatingKVCache:
        """Row ``row`` as a single-row window cache that continues exactly as the row would."""
        if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < self.batch_size:
            raise CacheError(
                f"{self.kind}.extract: row={row!r} is out of range for a batch of "
                f"{self.batch_size}",
                fix=f"pass a row index in [0, {self.batch_size})",
            )
        cache = self._empty_single()
        count, nxt = self._count[row], self._next[row]
        if self.keys is None or self.values is None or count == 0:
            return cache
        W = self.max_size
        keep = W if count >= W else count
        cut = lambda a: mx.contiguous(a[row : row + 1, :, :keep])  # noqa: E731
        cache.keys = buf.apply(cut, self.keys)
        cache.values = buf.apply(cut, self.values)
        cache.offset = count
        # A single window that just filled its last slot reports idx == max_size
        # (it wraps on the next write); one mid-rotation reports its write slot.
        cache._idx = (nxt or W) if count >= W else count
        return cache

    @classmethod
    def _new_like(cls, caches: Sequence[RotatingKVCache]) -> StackedRotatingKVCache:
        codec = common_codec(caches, owner=f"{cls.kind}.stack")
        return cls(caches[0].max_size, len(caches), codec=codec)

    @classmethod
    def stack(cls, caches: Sequence[RotatingKVCache]) -> StackedRotatingKVCache:
        """The batch whose row ``i`` decodes exactly as ``caches[i]`` alone."""
        if not caches:
            raise CacheError(f"{cls.kind}.stack: no caches given", fix="pass at least one cache")
        for i, c in enumerate(caches):
            if type(c) is not cls._single:
                raise CacheError(
                    f"{cls.kind}.stack: caches[{i}] is a {type(c).__name__}, not a "
                    f"{cls._single.__name__}",
                    fix=f"stack only single-row {cls._single.__name__}s into a {cls.kind}",
                )
            if c.keep != 0:
                raise CapabilityRefused(
                    f"{type(c).__name__}(max_size={c.max_size}, keep={c.keep}): batching a "
                    "sliding-window cache that keeps leading tokens is not supported",
                    fix="generate this model one sequence at a time, or use keep=0",
                )
        sizes = {c.max_size for c in caches}
        if len(sizes) > 1:
            raise CacheError(
                f"{cls.kind}.stack: caches have different max_size values {sorted(sizes)}",
                fix="stack only caches of the same layer (same window)",
            )
        out = cls._new_like(caches)
        rows = [_row_slots(c) for c in caches]
        filled = [(k, v) for k, v, _, _ in rows if k is not None and v is not None]
        if filled:
            S = max(max(buf.seq_len(k) for k, _ in filled), max(r[3] for r in rows) + 1)
            S = min(S, out.max_size)
            ref_k, ref_v = filled[0]
            out.keys = _cat_rows([_padded(r[0], ref_k, 1, S) for r in rows])
            out.values = _cat_rows([_padded(r[1], ref_v, 1, S) for r in rows])
        out._count = [r[2] for r in rows]
        out._next = [r[3] for r in rows]
        return out

    # --- size and state -------------------------------------------------------

    def size(self) -> int:
        return min(max(self._count, default=0), self.max_size)

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return buf.nbytes(self.keys, self.values)

    @property
    def state(self) -> tuple[mx.array, ...]:
        """The stored keys then values (each an array, or a quantized triple)."""
        if self.keys is None:
            return ()
        return (*buf.leaves(self.keys), *buf.leaves(self.values))

    @property
    def meta_state(self) -> tuple[str, ...]:
        """``(max_size, counts, next slots)`` (counts and slots comma-separated), then the codec."""
        return (
            str(self.max_size),
            ",".join(map(str, self._count)),
            ",".join(map(str, self._next)),
            *self._codec_meta(),
        )

    @classmethod
    def _from_meta(cls, meta_state: Sequence[str]) -> tuple[Any, list[int], list[int], Any]:
        meta_state, codec = split_meta(meta_state, 3, owner=cls.kind)
        try:
            counts = [int(x) for x in meta_state[1].split(",") if x]
            nexts = [int(x) for x in meta_state[2].split(",") if x]
        except ValueError:
            raise CacheError(
                f"{cls.kind}.from_state: per-row counts {meta_state[1]!r} / next slots "
                f"{meta_state[2]!r} are not comma-separated integers",
                fix="recreate the cache state with this version of mlx-loom",
            ) from None
        if len(counts) != len(nexts):
            raise CacheError(
                f"{cls.kind}.from_state: {len(counts)} row counts but {len(nexts)} next slots",
                fix="recreate the cache state with this version of mlx-loom",
            )
        return meta_state, counts, nexts, codec

    @classmethod
    def from_state(
        cls, state: Sequence[mx.array], meta_state: Sequence[str]
    ) -> StackedRotatingKVCache:
        meta, counts, nexts, codec = cls._from_meta(meta_state)
        (max_size,) = buf.parse_meta(meta[:1], ("max_size",), owner=cls.kind)
        cache = cls(max_size, len(counts), codec=codec)
        n = cache._codec.leaves
        arrays = buf.check_state_len(state, (0, 2 * n), owner=cls.kind)
        if arrays:
            cache.keys = arrays[0] if n == 1 else tuple(arrays[:n])
            cache.values = arrays[1] if n == 1 else tuple(arrays[n:])
        cache._count, cache._next = counts, nexts
        return cache

    def __repr__(self) -> str:
        return f"{self.kind}(max_size={self.max_size}, rows={self.batch_size})"


# --- helpers ----------------------------------------------------------------------


def _scatter(buffer: buf.Stored, where: mx.array, new: buf.Stored) -> buf.Stored:
    """Write each row's one new slot at that row's own index (``where`` is ``[B,1,1,1]``)."""
    pairs = zip(buf.leaves(buffer), buf.leaves(new), strict=True)
    return buf.rebuild(buffer, [mx.put_along_axis(b, where, n, axis=2) for b, n in pairs])


def _padded(x: buf.Stored | None, like: buf.Stored, rows: int, slots: int) -> buf.Stored:
    """``x`` with zero slots appended up to ``slots`` (zeros shaped like ``like`` if empty)."""
    if x is None:
        return buf.apply(lambda a: mx.zeros((rows, a.shape[1], slots, a.shape[3]), a.dtype), like)
    extra = slots - buf.seq_len(x)
    if extra <= 0:
        return x
    return buf.apply(lambda a: mx.pad(a, [(0, 0), (0, 0), (0, extra), (0, 0)]), x)


def _cat_rows(parts: Sequence[buf.Stored]) -> buf.Stored:
    """Concatenate stored buffers along the batch axis."""
    groups = zip(*(buf.leaves(p) for p in parts), strict=True)
    return buf.rebuild(parts[0], [mx.concatenate(list(g)) for g in groups])


def _check_rows(rows: Sequence[int], size: int, *, owner: str) -> list[int]:
    try:
        idx = [int(r) for r in rows]
        ok = all(not isinstance(r, bool) and int(r) == r for r in rows)
    except (TypeError, ValueError):
        ok, idx = False, []
    if not ok:
        raise CacheError(
            f"{owner}: rows={rows!r} must be a sequence of ints", fix="pass row indices"
        )
    bad = [r for r in idx if not 0 <= r < size]
    if bad:
        raise CacheError(
            f"{owner}: rows {bad} are out of range for a batch of {size}",
            fix=f"pass row indices in [0, {size})",
        )
    return idx
