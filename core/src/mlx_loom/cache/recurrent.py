"""The recurrent-state cache: a short convolution tail plus a recurrent state, per row.

Linear-attention layers (gated delta nets, Mamba-style SSMs) carry two things
between forwards instead of keys and values:

* ``conv_state`` ``[B, K-1, C]`` — the last ``K-1`` inputs of a causal
  depthwise convolution of width ``K`` (the "tail" the next chunk convolves with);
* ``recurrent_state`` ``[B, ...]`` — the recurrence's state (fp32 by convention).

Both summarise *every* token seen, which is why this cache cannot be trimmed:
dropping tokens would need the state from before them. Two mechanisms replace
trimming:

**Padding that never touches the state.** :meth:`prepare` declares left
padding and/or per-row lengths (right padding) for the next forwards;
:meth:`make_mask` returns the ``[B, N]`` validity mask the layer applies (pads
are zeroed before the convolution and the recurrence keeps its state on them),
and :meth:`tail_ends` says where each row's convolution tail ends. A padded row
ends in exactly the state it would have alone.

**Speculative rounds.** :meth:`begin_round` snapshots the cache; the layer then
verifies a window of ``S`` tokens and, because a round is open, calls
:meth:`record` with what it fed the recurrence: the convolution's (masked)
input ``[B, S, C]``, the recurrence's inputs (a tuple of ``[B, S, ...]``
arrays), the padding mask, and the *state-only replay kernel* that consumes
them. :meth:`commit(keep)` restores the snapshot and recomputes:

* the tail as the last ``K-1`` rows of ``snapshot_tail ++ conv_input[:keep]``
  (pure data movement, so it is bit-identical to a fresh forward's tail);
* the state as ``replay(*inputs, snapshot_state, mask, lengths)`` — the same
  recurrence over the same inputs from the same state, stopping after each
  row's kept tokens, so it is bit-identical to a fresh forward over the kept
  tokens. One ``keep`` for every row slices the inputs (``lengths`` is
  ``None``); a per-row ``keep`` is passed as ``lengths`` (a backend's replay
  kernel stops there; the ops replay masks the steps after it, and the
  recurrence keeps its state on masked steps).

The cache records only while a round is open, so ordinary decoding stores
nothing extra. It needs no knowledge of the recurrence beyond "a function of
(inputs, state, mask) returning the state", so any linear-attention family can
use it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, cast

import mlx.core as mx

from mlx_loom.cache._buffers import parse_count
from mlx_loom.cache.checkpoint import Checkpoint, refuse_open_round
from mlx_loom.errors import CacheError, CacheNotTrimmable

__all__ = ["RecurrentCache", "ReplayFn"]

#: ``replay(*inputs, state, mask, lengths) -> state``: the state after running
#: the recurrence over ``inputs`` (each ``[B, T, ...]``) from ``state``; ``mask``
#: is ``None`` or ``[B, T]`` bool (False steps leave the state unchanged, the
#: padding of the verify forward); ``lengths`` is ``None`` (all ``T`` steps) or
#: ``[B]`` int32, the kept steps per row (steps from ``lengths[b]`` on are not run).
ReplayFn = Callable[..., mx.array]


@dataclass
class _Round:
    """What a speculative round needs to roll back: the snapshot and the window."""

    conv_state: mx.array | None
    recurrent_state: mx.array | None
    offset: int | mx.array
    left_padding: mx.array | None
    lengths: mx.array | None
    conv_inputs: list[mx.array] = field(default_factory=list)
    inputs: list[tuple[mx.array, ...]] = field(default_factory=list)
    masks: list[mx.array | None] = field(default_factory=list)
    replay: ReplayFn | None = None

    @property
    def window(self) -> int:
        return sum(x.shape[1] for x in self.conv_inputs)


def _as_rows(x: Sequence[int] | mx.array | None) -> mx.array | None:
    if x is None:
        return None
    return x.astype(mx.int32) if isinstance(x, mx.array) else mx.array(list(x), dtype=mx.int32)


class RecurrentCache:
    """Convolution tail + recurrent state for one linear-attention layer, one or many rows."""

    kind: ClassVar[str] = "RecurrentCache"

    def __init__(self, left_padding: Sequence[int] | None = None) -> None:
        self.conv_state: mx.array | None = None
        self.recurrent_state: mx.array | None = None
        self.left_padding: mx.array | None = _as_rows(left_padding)
        self.lengths: mx.array | None = None
        # Tokens seen: an int while every row saw the same count, else one per row.
        self._offset: int | mx.array = 0
        if self.left_padding is not None:
            self._offset = mx.zeros(self.left_padding.shape, dtype=mx.int32)
        self._round: _Round | None = None

    # --- what the layer calls ---------------------------------------------

    @property
    def offset(self) -> int | mx.array:
        """Real (non-pad) tokens absorbed: an int, or ``[B]`` int32 once rows differ."""
        return self._offset

    @property
    def batch_size(self) -> int:
        for a in (self.conv_state, self.recurrent_state, self.left_padding, self.lengths):
            if a is not None:
                return a.shape[0]
        if isinstance(self._offset, mx.array):
            return self._offset.shape[0]
        return 1

    def make_mask(
        self, N: int, *, window_size: int | None = None, return_array: bool = False
    ) -> mx.array | None:
        """``[B, N]`` bool: which of the next ``N`` positions are real tokens (``None``: all).

        ``window_size``/``return_array`` are accepted for protocol compatibility;
        a recurrence has no window.
        """
        pos = mx.arange(N)
        mask = None
        if self.left_padding is not None:
            mask = pos >= self.left_padding[:, None]
        if self.lengths is not None:
            inside = pos < self.lengths[:, None]
            mask = inside if mask is None else mask & inside
        return mask

    def tail_ends(self, N: int) -> mx.array | None:
        """Per-row end of the real tokens within the next ``N`` (``None``: all ``N`` real).

        With right padding a row's convolution tail is the ``K-1`` inputs
        ending at its last real token, not at the end of the padded chunk.
        """
        if self.lengths is None:
            return None
        return mx.clip(self.lengths, 0, N)

    def conv_tail(self, batch: int, width: int, channels: int, dtype: mx.Dtype) -> mx.array:
        """The stored tail, or zeros (the causal convolution's left padding) when empty."""
        if self.conv_state is not None:
            return self.conv_state
        return mx.zeros((batch, width, channels), dtype=dtype)

    def update(self, *, conv_state: mx.array, recurrent_state: mx.array, n: int) -> None:
        """Store the new tail and state after a forward over ``n`` positions (pads included)."""
        self.conv_state = conv_state
        self.recurrent_state = recurrent_state
        self._advance(n)

    @property
    def in_round(self) -> bool:
        return self._round is not None

    def record(
        self,
        *,
        conv_input: mx.array,
        inputs: tuple[mx.array, ...],
        mask: mx.array | None,
        replay: ReplayFn,
    ) -> None:
        """During a round, keep what :meth:`commit` needs to replay a kept prefix.

        ``conv_input`` ``[B, S, C]`` is the convolution's input for this
        forward (already masked); ``inputs`` the recurrence's inputs, each
        ``[B, S, ...]``; ``replay`` the state-only kernel that consumes them.
        Outside a round this does nothing.
        """
        r = self._round
        if r is None:
            return
        r.conv_inputs.append(conv_input)
        r.inputs.append(inputs)
        r.masks.append(mask)
        r.replay = replay

    # --- padding --------------------------------------------------------------

    def prepare(
        self,
        *,
        left_padding: Sequence[int] | None = None,
        lengths: Sequence[int] | None = None,
        right_padding: Sequence[int] | None = None,
    ) -> None:
        """Declare padding for the next forwards so pad tokens never touch the state.

        Right padding needs ``lengths`` (real tokens per row from the next
        position on): the tail of each row must end at its last real token.
        """
        if right_padding is not None and lengths is None and any(int(p) for p in right_padding):
            raise CacheError(
                f"{self.kind}.prepare got right_padding={list(right_padding)} without lengths",
                fix="pass lengths= (real tokens per row) together with right_padding",
            )
        if left_padding is not None:
            self.left_padding = _as_rows(left_padding)
            self._rows_offset()
        if lengths is not None:
            self.lengths = _as_rows(lengths)
            self._rows_offset()

    def finalize(self) -> None:
        """End a padded prefill: padding is consumed, the state holds only real tokens."""
        self.lengths = None
        self.left_padding = None

    def _rows_offset(self) -> None:
        if not isinstance(self._offset, mx.array):
            self._offset = mx.full((self.batch_size,), self._offset, dtype=mx.int32)

    def _real_count(self, n: int) -> mx.array | int:
        if self.left_padding is None and self.lengths is None:
            return n
        end = mx.full((self.batch_size,), n, dtype=mx.int32)
        if self.lengths is not None:
            end = mx.minimum(end, self.lengths)
        start = mx.zeros_like(end)
        if self.left_padding is not None:
            start = mx.maximum(start, self.left_padding)
        return mx.maximum(end - start, 0)

    def _advance(self, n: int) -> None:
        self._offset = self._offset + self._real_count(n)
        if self.left_padding is not None:
            self.left_padding = self.left_padding - n
            # Once every row is past its pads, drop the mask: the unmasked
            # recurrence gives the same state and skips the select.
            if _int(self.left_padding.max()) <= 0:
                self.left_padding = None
        if self.lengths is not None:
            self.lengths = self.lengths - n

    # --- trim: refused --------------------------------------------------------

    def is_trimmable(self) -> bool:
        """Never: the state mixes every token; use speculative rounds instead."""
        return False

    def trim(self, n: int) -> int:
        if n == 0:
            return 0
        raise CacheNotTrimmable(
            f"{self.kind} cannot drop the last {n} token(s): its recurrent state and "
            "convolution tail summarise every token seen, and the state before them is gone",
            fix="roll speculative windows back with begin_round()/commit(keep), and reuse a "
            "prompt cache only for an exact prefix (never trim it)",
        )

    # --- speculative rounds ---------------------------------------------------

    def begin_round(self) -> None:
        """Snapshot the cache before a window of draft tokens is verified."""
        if self._round is not None:
            raise CacheError(
                f"{self.kind}.begin_round called while a round is open",
                fix="commit(keep) the open round before beginning another",
            )
        self._round = _Round(
            conv_state=self.conv_state,
            recurrent_state=self.recurrent_state,
            offset=self._offset,
            left_padding=self.left_padding,
            lengths=self.lengths,
        )

    def commit(self, keep: int | Sequence[int] | mx.array) -> None:
        """Keep the first ``keep`` tokens of the window (one count, or one per row).

        The state becomes bit-identical to a fresh forward over the kept tokens
        from the snapshot: the snapshot is restored and only the kept prefix is
        replayed through the recorded inputs.
        """
        r = self._round
        if r is None:
            raise CacheError(
                f"{self.kind}.commit called with no open round",
                fix="call begin_round() before verifying a window",
            )
        S = r.window
        keep_rows = None if isinstance(keep, int) else _as_rows(keep)
        if keep_rows is not None:
            if keep_rows.shape != (self.batch_size,):
                raise CacheError(
                    f"{self.kind}.commit got {keep_rows.shape[0]} keep counts for "
                    f"{self.batch_size} rows",
                    fix="pass one keep count per row, or a single int",
                )
            lo, hi = _int(keep_rows.min()), _int(keep_rows.max())
        else:
            lo = hi = int(cast(int, keep))
        if lo < 0 or hi > S:
            raise CacheError(
                f"{self.kind}.commit(keep={keep if keep_rows is None else keep_rows.tolist()}) is "
                f"outside the verified window of {S} token(s)",
                fix=f"keep between 0 and {S} tokens",
            )
        self._round = None
        if lo == S:  # everything kept: the live state is already right
            return
        self._rollback(r, S, keep_rows if keep_rows is not None and lo != hi else lo)

    def _rollback(self, r: _Round, S: int, keep: int | mx.array) -> None:
        # A round begun on an empty cache replays from the empty state: a zero
        # convolution tail (the causal convolution's left padding) and a zero
        # recurrent state, which is what the layer starts an empty cache from.
        live = (self.conv_state, self.recurrent_state)
        self.conv_state, self.recurrent_state = r.conv_state, r.recurrent_state
        self._offset, self.left_padding, self.lengths = r.offset, r.left_padding, r.lengths
        if isinstance(keep, int) and keep == 0:
            return
        conv_in = mx.concatenate(r.conv_inputs, axis=1)
        inputs = tuple(mx.concatenate(list(parts), axis=1) for parts in zip(*r.inputs, strict=True))
        mask = self._window_mask(r, S)
        state0, tail = r.recurrent_state, r.conv_state
        if state0 is None and live[1] is not None:
            state0 = mx.zeros_like(live[1])
        if tail is None and live[0] is not None:
            tail = mx.zeros_like(live[0])
        if state0 is None or tail is None or r.replay is None:
            raise CacheError(
                f"{self.kind}: the round recorded no forward to replay the kept tokens from",
                fix="run the verify forward between begin_round() and commit(keep)",
            )
        lengths: mx.array | None = None
        if isinstance(keep, int):
            inputs = tuple(x[:, :keep] for x in inputs)
            conv_in = conv_in[:, :keep]
            mask = None if mask is None else mask[:, :keep]
            n: int | mx.array = keep
        else:
            lengths = keep.astype(mx.int32)
            n = keep
        self.recurrent_state = r.replay(*inputs, state0, mask, lengths)
        width = tail.shape[1]
        full = mx.concatenate([tail, conv_in], axis=1)
        if isinstance(n, int):
            self.conv_state = mx.contiguous(full[:, n : n + width])
        else:
            pos = (n[:, None] + mx.arange(width))[..., None]
            self.conv_state = mx.take_along_axis(full, pos, axis=1)
        self._advance_rows(n)

    def _window_mask(self, r: _Round, S: int) -> mx.array | None:
        if all(m is None for m in r.masks):
            return None
        parts = [
            m if m is not None else mx.ones((x.shape[0], x.shape[1]), dtype=mx.bool_)
            for m, x in zip(r.masks, r.conv_inputs, strict=True)
        ]
        return mx.concatenate(parts, axis=1)

    def _advance_rows(self, n: int | mx.array) -> None:
        if isinstance(n, int):
            self._advance(n)
            return
        # Per-row keep: rows advanced by different counts (no pads inside a window).
        self._rows_offset()
        self._offset = self._offset + n
        if self.left_padding is not None:
            self.left_padding = self.left_padding - n
            if _int(self.left_padding.max()) <= 0:
                self.left_padding = None
        if self.lengths is not None:
            self.lengths = self.lengths - n

    # --- rows -------------------------------------------------------------------

    def _no_round(self, what: str) -> None:
        if self._round is not None:
            raise CacheError(
                f"{self.kind}.{what} called while a speculative round is open",
                fix="commit(keep) the round first",
            )

    def filter(self, rows: Sequence[int] | mx.array) -> None:
        """Keep only ``rows`` (in that order)."""
        self._no_round("filter")
        idx = _as_rows(rows)
        take = lambda a: None if a is None else a[idx]  # noqa: E731
        self.conv_state, self.recurrent_state = take(self.conv_state), take(self.recurrent_state)
        self.left_padding, self.lengths = take(self.left_padding), take(self.lengths)
        if isinstance(self._offset, mx.array):
            self._offset = self._offset[idx]

    def _row_offsets(self) -> mx.array:
        if isinstance(self._offset, mx.array):
            return self._offset
        return mx.full((self.batch_size,), self._offset, dtype=mx.int32)

    def extend(self, other: RecurrentCache) -> None:
        """Append the rows of ``other`` (empty sides become zero state: nothing seen)."""
        self._no_round("extend")
        other._no_round("extend")
        a_rows, b_rows = self.batch_size, other.batch_size

        def cat(a: mx.array | None, b: mx.array | None, fill: int = 0) -> mx.array | None:
            if a is None and b is None:
                return None
            ref = a if a is not None else b
            assert ref is not None
            if a is None:
                a = mx.full((a_rows, *ref.shape[1:]), fill, dtype=ref.dtype)
            if b is None:
                b = mx.full((b_rows, *ref.shape[1:]), fill, dtype=ref.dtype)
            return mx.concatenate([a, b])

        offsets = mx.concatenate([self._row_offsets(), other._row_offsets()])
        self.conv_state = cat(self.conv_state, other.conv_state)
        self.recurrent_state = cat(self.recurrent_state, other.recurrent_state)
        self.left_padding = cat(self.left_padding, other.left_padding)
        self.lengths = cat(self.lengths, other.lengths, fill=2**30)
        self._offset = offsets

    def takes_row(self, single: Any) -> bool:
        """Whether :meth:`put_row` can write ``single`` (one row's state) over a row of
        this batch in place: both unpadded, written, of one shape, no round open."""
        if type(single) is not RecurrentCache or single.batch_size != 1:
            return False
        ready = all(
            c._round is None
            and c.left_padding is None
            and c.lengths is None
            and c.conv_state is not None
            and c.recurrent_state is not None
            for c in (self, single)
        )
        if not ready:
            return False
        assert self.conv_state is not None and single.conv_state is not None
        assert self.recurrent_state is not None and single.recurrent_state is not None
        return bool(
            self.conv_state.shape[1:] == single.conv_state.shape[1:]
            and self.recurrent_state.shape[1:] == single.recurrent_state.shape[1:]
        )

    def put_row(self, row: int, single: RecurrentCache) -> None:
        """Make row ``row`` hold ``single``'s state; the batch's arrays are written in place."""
        if not self.takes_row(single) or not 0 <= row < self.batch_size:
            raise CacheError(
                f"{self.kind}.put_row: this cache cannot take row {row}'s place",
                fix="check takes_row() first; extend otherwise",
            )
        assert self.conv_state is not None and self.recurrent_state is not None
        self.conv_state[row : row + 1] = cast(mx.array, single.conv_state)
        self.recurrent_state[row : row + 1] = cast(mx.array, single.recurrent_state)
        at = mx.arange(self.batch_size) == row
        self._offset = mx.where(at, mx.array(single.offset, dtype=mx.int32), self._row_offsets())

    def extract(self, row: int) -> RecurrentCache:
        """Row ``row`` as an independent single-row cache."""
        self._no_round("extract")
        out = RecurrentCache()
        if self.conv_state is not None:
            out.conv_state = mx.contiguous(self.conv_state[row : row + 1])
        if self.recurrent_state is not None:
            out.recurrent_state = mx.contiguous(self.recurrent_state[row : row + 1])
        off = self._offset
        out._offset = _int(off[row]) if isinstance(off, mx.array) else off
        return out

    @classmethod
    def merge(cls, caches: Sequence[RecurrentCache]) -> RecurrentCache:
        """One batch cache whose rows are ``caches``, in order."""
        if not caches:
            raise CacheError(f"{cls.kind}.merge got no caches", fix="pass at least one cache")
        first = caches[0]
        first._no_round("merge")
        merged = cls()
        merged.conv_state, merged.recurrent_state = first.conv_state, first.recurrent_state
        merged._offset = first._row_offsets()
        for c in caches[1:]:
            merged.extend(c)
        return merged

    @classmethod
    def stack(cls, caches: Sequence[RecurrentCache]) -> RecurrentCache:
        """A batch whose row ``i`` continues bit for bit as ``caches[i]`` alone.

        A row's state is its own slice of the batch state and the recurrence
        is computed row by row, so stacking changes no value (tested). One
        concatenation per array, however many caches (``merge`` extends one
        at a time).
        """
        if not caches:
            raise CacheError(f"{cls.kind}.stack got no caches", fix="pass at least one cache")
        for c in caches:
            c._no_round("stack")
            if c.left_padding is not None or c.lengths is not None:
                raise CacheError(
                    f"{cls.kind}.stack got a cache in the middle of a padded prefill",
                    fix="finalize() the padded prefill before stacking its rows",
                )

        def rows(name: str) -> mx.array | None:
            ref = next((getattr(c, name) for c in caches if getattr(c, name) is not None), None)
            if ref is None:
                return None
            return mx.concatenate(
                [
                    getattr(c, name)
                    if getattr(c, name) is not None
                    else mx.zeros((c.batch_size, *ref.shape[1:]), dtype=ref.dtype)
                    for c in caches
                ]
            )

        out = cls()
        out.conv_state, out.recurrent_state = rows("conv_state"), rows("recurrent_state")
        out._offset = mx.concatenate([c._row_offsets() for c in caches])
        return out

    def empty_batch(self, left_padding: Sequence[int]) -> RecurrentCache:
        """An empty batch cache of this kind, one row per entry of ``left_padding``."""
        return RecurrentCache(left_padding=left_padding)

    def bounded(self, max_tokens: int) -> RecurrentCache:
        """This cache: recurrent state does not grow with the sequence, so it is bounded."""
        return self

    # --- size and state -----------------------------------------------------------

    def empty(self) -> bool:
        return self.recurrent_state is None and self.conv_state is None

    def size(self) -> int:
        off = self._offset
        return _int(off.max()) if isinstance(off, mx.array) else off

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.conv_state, self.recurrent_state) if a is not None)

    def checkpoint(self) -> Checkpoint:
        """This row's tail and state as an immutable snapshot (the state cannot be trimmed).

        Free until the cache advances: every forward replaces both arrays.
        """
        refuse_open_round(self, self._round is not None)
        if isinstance(self._offset, mx.array):
            raise CacheError(
                f"{self.kind}.checkpoint is for a single-row cache; this one holds "
                f"{self.batch_size} rows",
                fix="extract(row) the row first",
            )
        return Checkpoint.of(self, self.state, self.meta_state, self._offset)

    @property
    def state(self) -> tuple[mx.array, ...]:
        """``(conv_state, recurrent_state)``, plus ``[B]`` offsets when rows differ."""
        if self.conv_state is None or self.recurrent_state is None:
            return ()
        arrays: tuple[mx.array, ...] = (self.conv_state, self.recurrent_state)
        if isinstance(self._offset, mx.array):
            arrays = (*arrays, self._offset)
        return arrays

    @property
    def meta_state(self) -> tuple[str, ...]:
        """``(offset,)`` for a uniform offset; ``("rows",)`` when offsets are per row."""
        off = self._offset
        return ("rows",) if isinstance(off, mx.array) else (str(off),)

    @classmethod
    def from_state(
        cls, state: Sequence[mx.array], meta_state: Sequence[str] = ()
    ) -> RecurrentCache:
        arrays = tuple(state)
        meta = tuple(meta_state) or ("0",)
        rows = meta == ("rows",)
        want = (3,) if rows else (0, 2)
        if len(arrays) not in want or len(meta) != 1:
            raise CacheError(
                f"{cls.kind}.from_state got {len(arrays)} array(s) and meta_state {meta!r}; "
                f"expected {' or '.join(map(str, want))} arrays with meta_state "
                "('<offset>',) or ('rows',)",
                fix="pass the state and meta_state of a saved RecurrentCache unchanged",
            )
        cache = cls()
        if arrays:
            cache.conv_state, cache.recurrent_state = arrays[0], arrays[1]
        if rows:
            cache._offset = arrays[2].astype(mx.int32)
        else:
            cache._offset = parse_count(meta[0], name="offset", owner=cls.kind)
        return cache

    def __repr__(self) -> str:
        return (
            f"RecurrentCache(rows={self.batch_size}, offset={self._offset}, "
            f"empty={self.empty()}, in_round={self.in_round})"
        )


def _int(a: mx.array) -> int:
    """A one-element integer array as an int."""
    value = a.item()
    if isinstance(value, complex):
        raise CacheError(f"expected an integer count, found {value!r}")
    return int(value)
