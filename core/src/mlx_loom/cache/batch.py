"""Batch key/value caches: ``B > 1`` rows, each left-padded to a shared length.

Rows are aligned on the right (their newest token shares the last slot), and
each row's ``left_padding`` counts the pad slots that the mask hides; the
per-row ``offset`` is the row's true token count (negative until the pads are
written). Right-padded prefill chunks (rows of unequal prompt length in one
forward) are declared with :meth:`prepare` and rolled into left padding by
:meth:`finalize`. Row operations (:meth:`filter`, :meth:`extend`,
:meth:`extract`, :meth:`merge`) let a continuous-batching loop add and remove
sequences. Slot and padding bookkeeping match mlx-lm's ``BatchKVCache`` and
``BatchRotatingKVCache`` bit for bit (parity-tested).

:class:`BatchKVCache` takes a storage codec like the single-row layouts
(:mod:`mlx_loom.cache.storage`): the same slot bookkeeping, written once over
"an array or a codec's tuple of arrays" (see ``_buffers``), so its row ``i``
holds exactly what the single-row :class:`~mlx_loom.cache.KVCache` of that
sequence holds in that codec. :class:`BatchRotatingKVCache` (mlx-lm's padded
window layout) stores plain keys/values only; windows in a codec batch by
stacking (:class:`~mlx_loom.cache.StackedRotatingKVCache`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, NoReturn, cast

import mlx.core as mx

from mlx_loom.cache import _buffers as buf
from mlx_loom.cache.kv import KVCache
from mlx_loom.cache.masks import create_causal_mask
from mlx_loom.cache.protocol import Mask
from mlx_loom.cache.rotating import RotatingKVCache, check_window
from mlx_loom.cache.storage import CodecLayout, common_codec, split_meta
from mlx_loom.cache.views import PlainView
from mlx_loom.errors import CacheError, CacheNotTrimmable, CapabilityRefused

__all__ = ["BatchKVCache", "BatchRotatingKVCache", "dynamic_roll"]


def dynamic_roll(x: mx.array, shifts: mx.array, axis: int) -> mx.array:
    """Roll each row of ``x`` along ``axis`` by its own shift (``shifts`` is ``[B, 1]``)."""
    n = x.shape[axis]
    shift_index = (...,) + (None,) * (x.ndim - axis)
    idx = (mx.arange(n)[shift_index[:-1]] - shifts[shift_index]) % n
    return mx.take_along_axis(x, idx, axis=axis)


def _int_list(values: Any, *, owner: str, name: str, allow_empty: bool = False) -> list[int]:
    if isinstance(values, mx.array):
        values = values.tolist()
    try:
        out = [int(v) for v in values]
        ok = all(not isinstance(v, bool) and int(v) == v for v in values)
    except (TypeError, ValueError):
        ok = False
    if not ok or (not out and not allow_empty):
        raise CacheError(
            f"{owner}: {name}={values!r} must be a non-empty sequence of ints",
            fix=f"pass one {name} entry per batch row",
        )
    return out


def _refuse_quantize(kind: str) -> NoReturn:
    raise CapabilityRefused(
        f"{kind}: KV quantization of a batch cache is not supported",
        fix="batch without kv_bits, or generate one sequence at a time with kv_bits",
    )


def _cat_rows(parts: Sequence[buf.Stored]) -> buf.Stored:
    """Concatenate stored buffers along the batch axis."""
    groups = zip(*(buf.leaves(p) for p in parts), strict=True)
    return buf.rebuild(parts[0], [mx.concatenate(list(g)) for g in groups])


def _ints(a: mx.array) -> list[int]:
    """A 1-D integer array as a list of ints."""
    return [int(x) for x in cast(list[int], a.tolist())]


class _BatchRowsBase:
    """Row bookkeeping shared by both batch kinds."""

    kind: ClassVar[str]

    def __init__(self, left_padding: Sequence[int]) -> None:
        pads = _int_list(left_padding, owner=self.kind, name="left_padding")
        if min(pads) < 0:
            raise CacheError(
                f"{self.kind}: left_padding={pads} has a negative entry",
                fix="left padding counts pad tokens and must be >= 0",
            )
        self.keys: buf.Stored | None = None
        self.values: buf.Stored | None = None
        self.left_padding = mx.array(pads)
        self.offset = mx.array([-p for p in pads])
        self._idx = 0

    @property
    def batch_size(self) -> int:
        return self.offset.shape[0]

    def _rows(self, rows: Sequence[int]) -> mx.array:
        idx = _int_list(rows, owner=f"{self.kind}.filter", name="rows")
        B = self.batch_size
        bad = [r for r in idx if not 0 <= r < B]
        if bad:
            raise CacheError(
                f"{self.kind}.filter: rows {bad} are out of range for a batch of {B}",
                fix=f"pass row indices in [0, {B})",
            )
        return mx.array(idx)

    def _row(self, row: int) -> int:
        B = self.batch_size
        if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < B:
            raise CacheError(
                f"{self.kind}.extract: row={row!r} is out of range for a batch of {B}",
                fix=f"pass a row index in [0, {B})",
            )
        return row

    def _check_other(self, other: Any) -> None:
        if type(other) is not type(self):
            raise CacheError(
                f"{self.kind}.extend: cannot append rows of a {type(other).__name__}",
                fix=f"extend a {self.kind} only with another {self.kind}",
            )

    def _add_left_padding(self, left_padding: Sequence[int]) -> None:
        """Shift every row right by its declared left padding (empty cache only)."""
        if self.keys is not None:
            raise CacheError(
                f"{self.kind}.prepare: left padding can only be declared on an empty cache",
                fix="declare left padding before the first forward, or use right_padding",
            )
        pads = _int_list(left_padding, owner=f"{self.kind}.prepare", name="left_padding")
        if len(pads) != self.batch_size:
            raise CacheError(
                f"{self.kind}.prepare: left_padding has {len(pads)} entries for "
                f"{self.batch_size} rows",
                fix="pass one entry per batch row",
            )
        self.left_padding = self.left_padding + mx.array(pads)
        self.offset = self.offset - mx.array(pads)

    def _pad_for_extend(
        self, c: Any, max_idx: int, max_len: int, like: tuple[Any, Any]
    ) -> tuple[Any, Any, mx.array, mx.array]:
        """Right-align ``c``'s rows on ``max_idx`` in a buffer of ``max_len`` slots."""
        k, v = c.keys, c.values
        if k is None:
            # An empty side: zero slots shaped like the other side's buffers.
            k = buf.apply(
                lambda a: mx.zeros((c.batch_size, *a.shape[1:2], 0, a.shape[3]), a.dtype), like[0]
            )
            v = buf.apply(
                lambda a: mx.zeros((c.batch_size, *a.shape[1:2], 0, a.shape[3]), a.dtype), like[1]
            )
        left = max_idx - c._idx
        right = max_len - buf.seq_len(k) - left
        if right < 0:
            k, v = buf.take(k, None, right), buf.take(v, None, right)
            right = 0
        if left or right:
            widths = [(0, 0), (0, 0), (left, right), (0, 0)]
            k = buf.apply(lambda a: mx.pad(a, widths), k)
            v = buf.apply(lambda a: mx.pad(a, widths), v)
        return k, v, c.offset, c.left_padding + left

    def _extend_rows(self, other: Any) -> None:
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        like = (self.keys, self.values) if self.keys is not None else (other.keys, other.values)
        max_idx = max(self._idx, other._idx)
        max_len = max(buf.seq_len(c.keys) for c in (self, other) if c.keys is not None)
        parts = [self._pad_for_extend(c, max_idx, max_len, like) for c in (self, other)]
        keys, values, offsets, pads = zip(*parts, strict=True)
        self.keys = _cat_rows(keys)
        self.values = _cat_rows(values)
        self.offset = mx.concatenate(list(offsets))
        self.left_padding = mx.concatenate(list(pads))
        self._idx = max_idx

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return buf.nbytes(self.keys, self.values)

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> NoReturn:
        _refuse_quantize(self.kind)

    def to_codec(self, codec: Any) -> NoReturn:
        _refuse_quantize(self.kind)


class BatchKVCache(CodecLayout, _BatchRowsBase):
    """Full KV cache for a left-padded batch.

    ``left_padding[i]`` pad tokens precede row ``i``'s prompt, e.g. prompts
    ``[1 3 5]``, ``[7]``, ``[2 6 8 9]`` enter as ``[0 1 3 5]``, ``[0 0 0 7]``,
    ``[2 6 8 9]`` with ``left_padding = [1, 3, 0]``.

    A row's real keys sit in time order, as in the row's own
    :class:`~mlx_loom.cache.KVCache`; the pads only add masked slots in front.
    On the CPU backend attention then reduces over the same values in the same
    order (a masked slot adds an exact zero), so a merged row decodes bit for
    bit as it would alone (tested for every family).
    """

    kind: ClassVar[str] = "BatchKVCache"
    step: ClassVar[int] = 256
    #: The single-row kind a row of this batch is (``merge`` takes, ``extract`` gives).
    _single: ClassVar[type] = KVCache

    def __init__(self, left_padding: Sequence[int], *, codec: Any = None) -> None:
        super().__init__(left_padding)
        self._take_codec(codec)
        self._right_padding: mx.array | None = None
        #: Where the rows ended when a speculative round began (``None``: no round).
        self._round_idx: int | None = None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        prev = self._idx
        L = keys.shape[2]
        if self.keys is None or self.values is None or prev + L > buf.seq_len(self.keys):
            n = (L + self.step - 1) // self.step * self.step
            new_k = self._codec.zeros_keys(keys, n)
            new_v = self._codec.zeros_values(values, n)
            if self.keys is None or self.values is None:
                self.keys, self.values = new_k, new_v
            else:
                if prev % self.step != 0:
                    self.keys = buf.take(self.keys, None, prev)
                    self.values = buf.take(self.values, None, prev)
                self.keys = buf.cat([self.keys, new_k])
                self.values = buf.cat([self.values, new_v])
        self.offset = self.offset + L
        self._idx += L
        buf.write(self.keys, prev, self._codec.encode_keys(keys))
        buf.write(self.values, prev, self._codec.encode_values(values))
        return self.keys_and_values()

    def append(self, keys: mx.array, values: mx.array) -> Any:
        """Append this step's keys/values; return the view that attends over every row."""
        return self._codec.view(*self.update_and_fetch(keys, values))

    def keys_and_values(self) -> tuple[Any, Any]:
        if self.keys is None or self.values is None:
            raise CacheError(f"{self.kind}: no keys/values yet", fix="call update_and_fetch first")
        return buf.take(self.keys, None, self._idx), buf.take(self.values, None, self._idx)

    def make_mask(
        self, N: int, *, window_size: int | None = None, return_array: bool = False
    ) -> Mask:
        # Always an array: the padding differs per row.
        return create_causal_mask(
            N, offset=self._idx, left_padding=self.left_padding, window_size=window_size
        )

    # --- one token written by a compiled step (mlx_loom.cpu.compiled_step) -----

    def takes_traced_token(self) -> bool:
        """Whether a traced one-token step may write slot :attr:`write_slot` of the
        buffers as they stand: plain storage with room for the token, no padded
        prefill pending (:meth:`finalize`) and no speculative round open."""
        return bool(
            self.plain
            and isinstance(self.keys, mx.array)
            and isinstance(self.values, mx.array)
            and self._right_padding is None
            and self._round_idx is None
            and self._idx < self.keys.shape[2]
        )

    @property
    def write_slot(self) -> int:
        """The slot every row's next token goes to (rows are right-aligned)."""
        return self._idx

    def written(self, keys: mx.array, values: mx.array, offset: mx.array) -> None:
        """Take the buffers and row positions a traced step returned after writing one
        token at :attr:`write_slot` — what :meth:`update_and_fetch` leaves."""
        self.keys, self.values, self.offset = keys, values, offset
        self._idx += 1

    # --- a row replaced in place (a parked row's place taken) ------------------

    def takes_row(self, single: Any) -> bool:
        """Whether :meth:`put_row` can write ``single`` (a row's own cache) over a row
        of this batch in place: the same kind and codec, at most as many tokens
        as the batch's rows are long, no padded prefill or round pending."""
        if type(single) is not self._single:
            return False
        one: Any = single
        return bool(
            one.codec_key == self.codec_key
            and self.keys is not None
            and one.keys is not None
            and 0 < one.size() <= self._idx
            and self._right_padding is None
            and self._round_idx is None
        )

    def put_row(self, row: int, single: Any) -> None:
        """Make row ``row`` hold ``single``'s tokens, right-aligned as :meth:`merge`
        aligns a row (zeros in front, masked as left padding); the buffers are
        written in place, so no other row is copied."""
        if not self.takes_row(single):
            raise CacheError(
                f"{self.kind}.put_row: this {type(single).__name__} cannot take a row's place",
                fix="check takes_row() first; merge or extend otherwise",
            )
        row = self._row(row)
        n = single.size()
        pad = self._idx - n
        keys, values = self._stored()

        def place(batch: buf.Stored, one: buf.Stored) -> None:
            for b, a in zip(buf.leaves(batch), buf.leaves(one), strict=True):
                tail = b.shape[2] - self._idx
                b[row : row + 1] = mx.pad(a[..., :n, :], [(0, 0), (0, 0), (pad, tail), (0, 0)])

        place(keys, single.keys)
        place(values, single.values)
        at = mx.arange(self.batch_size) == row
        self.left_padding = mx.where(at, pad, self.left_padding)
        self.offset = mx.where(at, n, self.offset)

    # --- padded prefill -------------------------------------------------------

    def prepare(
        self,
        *,
        left_padding: Sequence[int] | None = None,
        lengths: Sequence[int] | None = None,
        right_padding: Sequence[int] | None = None,
    ) -> None:
        if left_padding is not None:
            self._add_left_padding(left_padding)
        if right_padding is not None:
            pads = _int_list(right_padding, owner=f"{self.kind}.prepare", name="right_padding")
            if max(pads) > 0:
                self._right_padding = mx.array(pads)

    def finalize(self) -> None:
        """Roll each row right by its right padding so the pads become left padding."""
        if self._right_padding is None:
            return
        pads = self._right_padding
        keys, values = self._stored()
        self.keys = buf.apply(lambda a: dynamic_roll(a, pads[:, None], axis=2), keys)
        self.values = buf.apply(lambda a: dynamic_roll(a, pads[:, None], axis=2), values)
        self.offset = self.offset - pads
        self.left_padding = self.left_padding + pads
        self._right_padding = None

    # --- trim -----------------------------------------------------------------

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self._idx, buf.trim_count(n, owner=self.kind))
        self._idx -= n
        self.offset = self.offset - n
        return n

    # --- speculative rounds: per-row keep ---------------------------------------

    def begin_round(self) -> None:
        """Note where every row ends before a verify window is appended."""
        if self._round_idx is not None:
            raise CacheError(
                f"{self.kind}.begin_round called while a round is open",
                fix="commit(keep) the open round before beginning another",
            )
        self._round_idx = self._idx

    def commit(self, keep: int | Sequence[int]) -> None:
        """Keep the first ``keep[i]`` of the round's tokens in row ``i`` (or ``keep`` in all).

        Every row appended the same window; row ``i`` drops its last
        ``window - keep[i]`` tokens. The tokens all rows drop are trimmed;
        beyond that, each row is rolled right by what it drops, so its kept
        tokens stay right-aligned in time order and the dropped ones become
        left padding (masked). A row then holds exactly its kept sequence
        behind masked slots, which attends bit for bit as the row alone.
        """
        start = self._round_idx
        if start is None:
            raise CacheError(
                f"{self.kind}.commit called with no open round",
                fix="call begin_round() before verifying a window",
            )
        window = self._idx - start
        counts = [keep] * self.batch_size if isinstance(keep, int) else list(keep)
        if len(counts) != self.batch_size or any(
            isinstance(k, bool) or not 0 <= int(k) <= window for k in counts
        ):
            raise CacheError(
                f"{self.kind}.commit(keep={keep!r}) does not give each of {self.batch_size} "
                f"rows a count within the round's {window} token(s)",
                fix="pass one keep count per row, each between 0 and the window",
            )
        self._round_idx = None
        drop = [window - int(k) for k in counts]
        self.trim(min(drop))
        extra = [d - min(drop) for d in drop]
        if not any(extra):
            return
        shift = mx.array(extra)[:, None]
        used = self._idx  # the slots past it are growth room, not tokens

        def roll(a: mx.array) -> mx.array:
            return dynamic_roll(a[..., :used, :], shift, axis=2)

        keys, values = self._stored()
        self.keys = buf.apply(roll, keys)
        self.values = buf.apply(roll, values)
        self.left_padding = self.left_padding + shift[:, 0]
        self.offset = self.offset - shift[:, 0]

    # --- rows -----------------------------------------------------------------

    def filter(self, rows: Sequence[int]) -> None:
        idx = self._rows(rows)
        if self.keys is not None and self.values is not None:
            self.keys = buf.apply(lambda a: a[idx], self.keys)
            self.values = buf.apply(lambda a: a[idx], self.values)
        self.offset = self.offset[idx]
        self.left_padding = self.left_padding[idx]
        # Drop slots that are padding in every remaining row.
        shift = min(_ints(self.left_padding))
        if shift > 0:
            if self.keys is not None and self.values is not None:
                self.keys = buf.take(self.keys, shift, None)
                self.values = buf.take(self.values, shift, None)
            self._idx -= shift
            self.left_padding = self.left_padding - shift

    def _check_other(self, other: Any) -> None:
        super()._check_other(other)
        self._check_codec(other, "extend")

    def extend(self, other: BatchKVCache) -> None:
        self._check_other(other)
        self._extend_rows(other)

    def _empty_single(self) -> Any:
        return self._single(codec=self._codec)

    def extract(self, row: int) -> Any:
        row = self._row(row)
        cache = self._empty_single()
        if self.keys is None or self.values is None:
            return cache
        pad = _ints(self.left_padding)[row]
        cut = lambda a: mx.contiguous(a[row : row + 1, :, pad : self._idx])  # noqa: E731
        cache.keys = buf.apply(cut, self.keys)
        cache.values = buf.apply(cut, self.values)
        cache.offset = buf.seq_len(cache.keys)
        return cache

    @classmethod
    def _check_members(cls, caches: Sequence[Any]) -> None:
        if not caches:
            raise CacheError(f"{cls.kind}.merge: no caches given", fix="pass at least one cache")
        name = cls._single.__name__
        for i, c in enumerate(caches):
            if type(c) is not cls._single:
                raise CacheError(
                    f"{cls.kind}.merge: caches[{i}] is a {type(c).__name__}, not a {name}",
                    fix=f"merge only single-row {name}s into a {cls.kind}",
                )

    @classmethod
    def _new_like(cls, caches: Sequence[Any], pads: list[int]) -> BatchKVCache:
        return cls(pads, codec=common_codec(caches, owner=f"{cls.kind}.merge"))

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> BatchKVCache:
        cls._check_members(caches)
        lengths = [c.size() for c in caches]
        longest = max(lengths)
        pads = [longest - n for n in lengths]
        cache = cls._new_like(caches, pads)
        if longest == 0:
            return cache
        ref = next(c for c in caches if c.keys is not None)

        def row(stored: buf.Stored | None, like: buf.Stored, pad: int, n: int) -> buf.Stored:
            # Each row right-aligned in ``longest`` slots, zeros in front: built
            # per row and concatenated once (not written slot by slot).
            if stored is None or n == 0:
                return buf.apply(
                    lambda a: mx.zeros((1, a.shape[1], longest, a.shape[3]), a.dtype), like
                )
            used = buf.take(stored, None, n)
            return buf.apply(lambda a: mx.pad(a, [(0, 0), (0, 0), (pad, 0), (0, 0)]), used)

        keys = _cat_rows(
            [row(c.keys, ref.keys, p, n) for p, n, c in zip(pads, lengths, caches, strict=True)]
        )
        values = _cat_rows(
            [row(c.values, ref.values, p, n) for p, n, c in zip(pads, lengths, caches, strict=True)]
        )
        cache.keys, cache.values = keys, values
        cache.offset = cache.offset + longest
        cache._idx = longest
        return cache

    @classmethod
    def stack(cls, caches: Sequence[Any]) -> BatchKVCache:
        """The batch whose row ``i`` decodes exactly as ``caches[i]`` alone (see the class)."""
        return cls.merge(caches)

    # --- size and state -------------------------------------------------------

    def size(self) -> int:
        return self._idx

    @property
    def state(self) -> tuple[mx.array, ...]:
        """``(offset, left_padding[, keys..., values...])``, keys cut to the used slots."""
        if self.keys is None:
            return (self.offset, self.left_padding)
        k, v = self.keys_and_values()
        return (self.offset, self.left_padding, *buf.leaves(k), *buf.leaves(v))

    @property
    def meta_state(self) -> tuple[str, ...]:
        """``(idx,)`` as a decimal string, then the codec's part."""
        return (str(self._idx), *self._codec_meta())

    @classmethod
    def from_state(cls, state: Sequence[mx.array], meta_state: Sequence[str]) -> BatchKVCache:
        own, codec = split_meta(meta_state, 1, owner=cls.kind)
        (idx,) = buf.parse_meta(own, ("idx",), owner=cls.kind)
        cache = cls([0], codec=codec)
        n = cache._codec.leaves
        arrays = buf.check_state_len(state, (2, 2 + 2 * n), owner=cls.kind)
        cache.offset, cache.left_padding = arrays[0], arrays[1]
        if len(arrays) > 2:
            cache.keys = arrays[2] if n == 1 else tuple(arrays[2 : 2 + n])
            cache.values = arrays[3] if n == 1 else tuple(arrays[2 + n :])
        cache._idx = idx
        return cache

    def empty_batch(self, left_padding: Sequence[int]) -> BatchKVCache:
        return BatchKVCache(left_padding, codec=self._codec)


class BatchRotatingKVCache(_BatchRowsBase):
    """Sliding-window KV cache of ``max_size`` slots for a left-padded batch (``keep = 0``)."""

    kind: ClassVar[str] = "BatchRotatingKVCache"
    step: ClassVar[int] = 256

    def __init__(self, max_size: int, left_padding: Sequence[int]) -> None:
        check_window(max_size, 0, owner=self.kind)
        super().__init__(left_padding)
        self.max_size = max_size
        self._offset = 0  # slots written (the padded length), shared by all rows
        self.rotated = False
        # Per-row end of the real tokens during a right-padded prefill, so that
        # pads never evict real tokens from the window.
        self._lengths: mx.array | None = None

    # --- slot moves -----------------------------------------------------------

    def _kv(self) -> tuple[mx.array, mx.array]:
        """The stored keys and values: plain arrays (this layout stores no codec)."""
        k, v = self.keys, self.values
        if not isinstance(k, mx.array) or not isinstance(v, mx.array):
            raise CacheError(f"{self.kind}: no keys/values yet", fix="call update_and_fetch first")
        return k, v

    def _drop_front(self, n: int, v: mx.array, append: mx.array | None = None) -> mx.array:
        if n > 0:
            v = v[..., n:, :]
        return v if append is None else mx.concatenate([v, append], axis=2)

    def _to_time_order(self) -> None:
        if self.rotated:
            k, v = self._kv()
            self.keys = mx.roll(k, -self._idx, 2)
            self.values = mx.roll(v, -self._idx, 2)
            self._idx = self.keys.shape[2]
            self.rotated = False

    def _roll_out_right_padding(self, lengths: mx.array) -> None:
        k, v = self._kv()
        roll = mx.maximum(0, self.offset - lengths)
        self.keys = dynamic_roll(k, roll[:, None], axis=2)
        self.values = dynamic_roll(v, roll[:, None], axis=2)
        self.left_padding = self.left_padding + roll
        self.offset = self.offset - roll

    def _append_chunk(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self.keys is None:
            k, v = keys, values
        else:
            self._to_time_order()
            k, v = self._kv()
            if k.shape[2] > self._idx:
                self.keys, self.values = k[..., : self._idx, :], v[..., : self._idx, :]
            if self._lengths is not None:
                self._roll_out_right_padding(self._lengths)
            k, v = self._kv()
            drop = self._idx - self.max_size + 1
            if drop > 0:
                self.left_padding = self.left_padding - drop
            k = self._drop_front(drop, k, keys)
            v = self._drop_front(drop, v, values)
        L = keys.shape[2]
        self.offset = self.offset + L
        self._offset += L
        self._idx = k.shape[2]
        # Tie the bookkeeping arrays to the keys so evaluating the cache
        # evaluates them too (their graphs would otherwise grow every step).
        k = mx.depends(k, (self.left_padding, self.offset))
        self.keys, self.values = k, v
        return k, v

    def _write_in_place(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self._lengths is not None:
            raise CacheError(
                f"{self.kind}: decoding before finalize() after a right-padded prefill",
                fix="call finalize() once the padded prefill is done",
            )
        B, H, S, Dk = keys.shape
        prev = self._offset
        old = None if self.keys is None else self._kv()
        if old is None or (prev >= old[0].shape[2] and old[0].shape[2] < self.max_size):
            n = min(self.step, self.max_size - prev)
            new_k = mx.zeros((B, H, n, Dk), keys.dtype)
            new_v = mx.zeros((B, H, n, values.shape[3]), values.dtype)
            if old is None:
                self.keys, self.values = new_k, new_v
            else:
                self.keys = mx.concatenate([old[0], new_k], axis=2)
                self.values = mx.concatenate([old[1], new_v], axis=2)
            self._idx = prev
        k, v = self._kv()
        excess = k.shape[2] - self.max_size
        if excess > 0:
            k, v = self._drop_front(excess, k), self._drop_front(excess, v)
            self._idx = self.max_size
            self.left_padding = self.left_padding - excess
        if self._idx == self.max_size:
            self.rotated = True
            self._idx = 0
        if self.rotated:
            self.left_padding = self.left_padding - S
        k[..., self._idx : self._idx + S, :] = keys
        v[..., self._idx : self._idx + S, :] = values
        self._offset += S
        self.offset = self.offset + S
        self._idx += S
        self.keys, self.values = mx.depends(k, (self.left_padding, self.offset)), v
        return self.keys_and_values()

    # --- append and attend ----------------------------------------------

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if keys.shape[2] == 1:
            return self._write_in_place(keys, values)
        return self._append_chunk(keys, values)

    def append(self, keys: mx.array, values: mx.array) -> PlainView:
        """Append this step's keys/values; return the view that attends over the window."""
        return PlainView(*self.update_and_fetch(keys, values))

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        k, v = self._kv()
        if self._offset < k.shape[2]:
            return k[..., : self._offset, :], v[..., : self._offset, :]
        return k, v

    def make_mask(
        self, N: int, *, window_size: int | None = None, return_array: bool = False
    ) -> Mask:
        window_size = window_size or self.max_size
        offset = min(self.max_size - 1, self._offset)
        key_pos = mx.arange(offset + N)
        query_pos = mx.arange(offset, offset + N) if offset else key_pos
        query_pos, key_pos = query_pos[:, None], key_pos[None]
        mask = (query_pos >= key_pos) & (query_pos < key_pos + window_size)
        left = self.left_padding
        # The update about to run drops this many front slots (and the pads in them).
        if (dropped := self._idx - self.max_size + int(N > 1)) > 0:
            left = left - dropped
        rotated = N == 1 and (self.rotated or self._idx >= self.max_size)
        if rotated:
            left = left - 1
        mask = mask & (key_pos >= mx.expand_dims(left, (1, 2, 3)))
        if rotated:
            idx = 0 if self._idx >= self.max_size else self._idx
            mask = mx.roll(mask, idx + 1, -1)
        return mask

    # --- padded prefill -------------------------------------------------------

    def prepare(
        self,
        *,
        left_padding: Sequence[int] | None = None,
        lengths: Sequence[int] | None = None,
        right_padding: Sequence[int] | None = None,
    ) -> None:
        if left_padding is not None:
            self._add_left_padding(left_padding)
        if right_padding is not None:
            pads = _int_list(right_padding, owner=f"{self.kind}.prepare", name="right_padding")
            if max(pads) > 0:
                if lengths is None:
                    raise CacheError(
                        f"{self.kind}.prepare: right_padding needs the per-row lengths",
                        fix="pass lengths= (each row's real token count in the chunk)",
                    )
                n = _int_list(lengths, owner=f"{self.kind}.prepare", name="lengths")
                self._lengths = mx.array(n) + self.offset

    def finalize(self) -> None:
        if self._lengths is not None:
            self._roll_out_right_padding(self._lengths)
            self._lengths = None

    # --- trim -----------------------------------------------------------------

    def is_trimmable(self) -> bool:
        """True while the window has never filled (no slot was overwritten or dropped)."""
        return self._offset < self.max_size

    def trim(self, n: int) -> int:
        n = min(self._offset, buf.trim_count(n, owner=self.kind))
        if n == 0:
            return 0
        if not self.is_trimmable():
            raise CacheNotTrimmable(
                f"{self.kind}(max_size={self.max_size}) cannot trim {n} token(s) after "
                f"{self._offset} written slots: the window is full, so older tokens were "
                "already overwritten or dropped and the trimmed window would be wrong",
                fix="do not trim a sliding-window cache past its window (e.g. disable "
                "speculative decoding for this model)",
            )
        self._offset -= n
        self._idx -= n
        self.offset = self.offset - n
        return n

    # --- rows -----------------------------------------------------------------

    def filter(self, rows: Sequence[int]) -> None:
        idx = self._rows(rows)
        if self.keys is not None:
            k, v = self._kv()
            self.keys, self.values = k[idx], v[idx]
        self.offset = self.offset[idx]
        self.left_padding = self.left_padding[idx]

    def extend(self, other: BatchRotatingKVCache) -> None:
        self._check_other(other)
        if other.max_size != self.max_size:
            raise CacheError(
                f"{self.kind}.extend: max_size {other.max_size} differs from {self.max_size}",
                fix="extend only with a batch cache of the same window",
            )
        if self.keys is None and other.keys is None:
            self._extend_rows(other)
            return
        if self.rotated != other.rotated or self._idx != other._idx:
            self._to_time_order()
            other._to_time_order()
        self._extend_rows(other)
        self._offset = max(self._offset, other._offset)

    def extract(self, row: int) -> RotatingKVCache:
        row = self._row(row)
        cache = RotatingKVCache(self.max_size)
        if self.keys is None:
            return cache
        k, v = self._kv()
        pad = max(0, _ints(self.left_padding)[row])
        keys, values = k[row : row + 1], v[row : row + 1]
        end = self._idx
        if self.rotated:
            keys = mx.roll(keys, -self._idx, 2)
            values = mx.roll(values, -self._idx, 2)
            end = self.max_size
        kept = mx.contiguous(keys[:, :, pad:end])
        cache.keys, cache.values = kept, mx.contiguous(values[:, :, pad:end])
        cache.offset = _ints(self.offset)[row]
        cache._idx = kept.shape[2]
        return cache

    @classmethod
    def merge(cls, caches: Sequence[RotatingKVCache]) -> BatchRotatingKVCache:
        if not caches:
            raise CacheError(f"{cls.kind}.merge: no caches given", fix="pass at least one cache")
        for i, c in enumerate(caches):
            if type(c) is not RotatingKVCache or not c.plain:
                what = type(c).__name__ if type(c) is not RotatingKVCache else c.storage.describe()
                raise CacheError(
                    f"{cls.kind}.merge: caches[{i}] is a {what}, not a plain RotatingKVCache",
                    fix="merge only unquantized sliding-window caches into a BatchRotatingKVCache "
                    "(windows in a codec batch by stack())",
                )
            c._check_batchable()
        sizes = {c.max_size for c in caches}
        if len(sizes) > 1:
            raise CacheError(
                f"{cls.kind}.merge: caches have different max_size values {sorted(sizes)}",
                fix="merge only caches of the same layer (same window)",
            )
        max_size = caches[0].max_size
        lengths = [c.size() for c in caches]
        longest = max(lengths)
        if longest == 0:
            return cls(max_size, [0] * len(caches))
        pads = [longest - n for n in lengths]
        stored = [c._stored() if c.keys is not None else None for c in caches]
        full = [cast(tuple[mx.array, mx.array], kv) for kv in stored if kv is not None]
        H = max(k.shape[1] for k, _ in full)
        Dk = max(k.shape[3] for k, _ in full)
        Dv = max(v.shape[3] for _, v in full)
        dtype = full[0][0].dtype
        keys = mx.zeros((len(caches), H, longest, Dk), dtype=dtype)
        values = mx.zeros((len(caches), H, longest, Dv), dtype=dtype)
        for i, (p, n, c, kv) in enumerate(zip(pads, lengths, caches, stored, strict=True)):
            if kv is None or n == 0:
                continue
            keys[i : i + 1, :, p : p + n] = cast(mx.array, c._time_ordered(kv[0]))[..., -n:, :]
            values[i : i + 1, :, p : p + n] = cast(mx.array, c._time_ordered(kv[1]))[..., -n:, :]
        cache = cls(max_size, pads)
        cache.keys, cache.values = keys, values
        cache.offset = mx.array([c.offset for c in caches])
        cache._idx = longest
        cache._offset = longest
        return cache

    # --- size and state -------------------------------------------------------

    def size(self) -> int:
        return min(self._offset, self.max_size)

    @property
    def state(self) -> tuple[mx.array, ...]:
        """``(offset, left_padding[, keys, values])``, keys in slot order."""
        if self.keys is None:
            return (self.offset, self.left_padding)
        return (self.offset, self.left_padding, *self._kv())

    @property
    def meta_state(self) -> tuple[str, ...]:
        """``(max_size, written, idx, rotated)`` as decimal strings."""
        return (str(self.max_size), str(self._offset), str(self._idx), str(int(self.rotated)))

    @classmethod
    def from_state(
        cls, state: Sequence[mx.array], meta_state: Sequence[str]
    ) -> BatchRotatingKVCache:
        arrays = buf.check_state_len(state, (2, 4), owner=cls.kind)
        max_size, written, idx, rotated = buf.parse_meta(
            meta_state, ("max_size", "written", "idx", "rotated"), owner=cls.kind
        )
        check_window(max_size, 0, owner=cls.kind)
        cache = cls.__new__(cls)
        cache.offset, cache.left_padding = arrays[0], arrays[1]
        cache.keys = arrays[2] if len(arrays) == 4 else None
        cache.values = arrays[3] if len(arrays) == 4 else None
        cache.max_size, cache._offset, cache._idx = max_size, written, idx
        cache.rotated = bool(rotated)
        cache._lengths = None
        return cache

    def empty_batch(self, left_padding: Sequence[int]) -> BatchRotatingKVCache:
        return BatchRotatingKVCache(self.max_size, left_padding)
