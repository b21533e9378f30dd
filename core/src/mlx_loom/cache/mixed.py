"""Rows of different KV codecs in one decoding batch.

Continuous batching stacks single-row caches of one kind into a batch cache
of that kind (``stack``), whose rows decode bit for bit as alone. Requests
may ask for different storage — plain, affine 4-bit, TurboQuant 3-bit —
and still share one forward: :class:`MixedRowsCache` keeps one batch cache
per codec (a *segment*) and remembers which batch row lives in which
segment. Appending splits the step's keys/values by segment and returns a
:class:`~mlx_loom.cache.views.RowsView`; its mask is a
:class:`~mlx_loom.cache.views.RowsMask` with each segment's own mask. Each
row is computed by its own segment, exactly as in a batch of its codec
alone, so it still decodes bit for bit as it would alone (tested per
family). Everything outside attention (projections, norms, MLPs) runs once
for the whole batch.

:func:`stack_rows` and :func:`join_rows` are what the engine calls: they
return a plain batch of the one kind when every row has it (the common
case is unchanged), and a mixed one otherwise.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, ClassVar

import mlx.core as mx

from mlx_loom.cache.views import RowsMask, RowsView
from mlx_loom.errors import CacheError, CacheNotTrimmable

__all__ = ["MixedRowsCache", "join_rows", "row_signature", "stack_rows"]


def _storage(cache: Any) -> Hashable:
    """The cache's storage codec (``codec_key``), or its declared width for a plugin kind."""
    key = getattr(cache, "codec_key", None)
    if key is not None:
        return key
    return (getattr(cache, "bits", None), getattr(cache, "group_size", None))


def row_signature(cache: Any) -> Hashable:
    """What two caches must share to be rows of one batch cache of their kind."""
    return (
        type(cache),
        getattr(cache, "max_size", None),
        getattr(cache, "keep", None),
        _storage(cache),
    )


def _batch_signature(cache: Any) -> Hashable:
    """The :func:`row_signature` of a batch cache's rows (its single-row kind's)."""
    single = getattr(type(cache), "_single", None)
    return (
        single,
        getattr(cache, "max_size", None),
        0 if getattr(cache, "max_size", None) is not None else None,
        _storage(cache),
    )


def stack_rows(caches: Sequence[Any]) -> Any:
    """A batch of ``caches`` (single-row caches of one layer), row ``i`` = ``caches[i]``."""
    if len({row_signature(c) for c in caches}) == 1:
        return type(caches[0]).stack(list(caches))
    return MixedRowsCache.stack(caches)


def join_rows(mine: Any, theirs: Any) -> Any:
    """``mine``'s rows followed by ``theirs``' (two batch caches of one layer).

    Extends ``mine`` in place when both hold one kind; otherwise returns a
    :class:`MixedRowsCache` over both.
    """
    if not isinstance(mine, MixedRowsCache) and not isinstance(theirs, MixedRowsCache):
        if _batch_signature(mine) == _batch_signature(theirs) and type(mine) is type(theirs):
            mine.extend(theirs)
            return mine
    mixed = mine if isinstance(mine, MixedRowsCache) else MixedRowsCache([mine])
    mixed.extend(theirs)
    return mixed


class MixedRowsCache:
    """A batch whose rows live in per-codec batch caches (segments)."""

    kind: ClassVar[str] = "MixedRowsCache"

    def __init__(self, segments: Sequence[Any], rows: Sequence[tuple[int, int]] | None = None):
        self.segments: list[Any] = list(segments)
        if rows is None:
            rows = [(s, j) for s, seg in enumerate(self.segments) for j in range(_size(seg))]
        #: Batch row -> (segment, row within the segment).
        self.rows: list[tuple[int, int]] = list(rows)

    @classmethod
    def stack(cls, caches: Sequence[Any]) -> MixedRowsCache:
        if not caches:
            raise CacheError(f"{cls.kind}.stack: no caches given", fix="pass at least one cache")
        groups: dict[Hashable, list[int]] = {}
        for i, c in enumerate(caches):
            groups.setdefault(row_signature(c), []).append(i)
        segments, rows = [], [(0, 0)] * len(caches)
        for s, members in enumerate(groups.values()):
            segments.append(type(caches[members[0]]).stack([caches[i] for i in members]))
            for j, i in enumerate(members):
                rows[i] = (s, j)
        return cls(segments, rows)

    # --- geometry -------------------------------------------------------------

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    def _members(self) -> list[list[int]]:
        """Per segment, its batch rows in the segment's own row order."""
        out: list[list[int]] = [[] for _ in self.segments]
        for b, (s, j) in sorted(enumerate(self.rows), key=lambda x: x[1]):
            out[s].append(b)
            if len(out[s]) != j + 1:
                raise CacheError(f"{self.kind}: row bookkeeping is inconsistent")
        return out

    def _inverse(self) -> mx.array:
        """Index that puts concatenated per-segment arrays back in batch order."""
        starts, total = [], 0
        for seg in self.segments:
            starts.append(total)
            total += _size(seg)
        return mx.array([starts[s] + j for s, j in self.rows], dtype=mx.int32)

    @property
    def offset(self) -> mx.array:
        """Tokens seen per row (``[B]``), in batch order: each row's RoPE position."""
        parts = [mx.array(seg.offset).astype(mx.int32).reshape(-1) for seg in self.segments]
        return mx.concatenate(parts)[self._inverse()]

    # --- append and attend ----------------------------------------------------

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        raise CacheError(
            f"{self.kind}: rows of different codecs have no single keys/values tensor",
            fix="call append(keys, values) and attend through the view it returns",
        )

    def append(self, keys: mx.array, values: mx.array) -> RowsView:
        if keys.shape[0] != self.batch_size:
            raise CacheError(
                f"{self.kind}: got keys for {keys.shape[0]} rows; the batch has {self.batch_size}",
                fix="pass one row of keys/values per batch row",
            )
        members = self._members()
        views = []
        for seg, rows in zip(self.segments, members, strict=True):
            idx = mx.array(rows, dtype=mx.int32)
            views.append(seg.append(keys[idx], values[idx]))
        return RowsView(tuple(views), tuple(tuple(r) for r in members))

    def make_mask(
        self, N: int, *, window_size: int | None = None, return_array: bool = False
    ) -> RowsMask:
        return RowsMask(
            tuple(
                seg.make_mask(N, window_size=window_size, return_array=return_array)
                for seg in self.segments
            )
        )

    # --- rows -----------------------------------------------------------------

    def prepare(self, **padding: Any) -> None:
        declared = [p for p in padding.values() if p is not None and any(p)]
        if declared:
            raise CacheError(
                f"{self.kind}: padded prefill is not supported; rows are stacked after prefill",
                fix="prefill each prompt in its own single-row cache, then stack the rows",
            )

    def finalize(self) -> None:
        """Nothing to fold away: rows are never padded."""

    def filter(self, rows: Sequence[int]) -> None:
        keep = [int(r) for r in rows]
        bad = [r for r in keep if not 0 <= r < self.batch_size]
        if bad:
            raise CacheError(
                f"{self.kind}.filter: rows {bad} are out of range for a batch of {self.batch_size}",
                fix=f"pass row indices in [0, {self.batch_size})",
            )
        per_seg: list[list[int]] = [[] for _ in self.segments]
        new_rows = []
        for r in keep:
            s, j = self.rows[r]
            new_rows.append((s, len(per_seg[s])))
            per_seg[s].append(j)
        remap: dict[int, int] = {}
        segments: list[Any] = []
        for s, (seg, chosen) in enumerate(zip(self.segments, per_seg, strict=True)):
            if chosen:
                seg.filter(chosen)
                remap[s] = len(segments)
                segments.append(seg)
        self.segments = segments
        self.rows = [(remap[s], j) for s, j in new_rows]

    def extend(self, other: Any) -> None:
        """Append ``other``'s rows (a batch cache of any codec, or another mixed batch)."""
        parts = (
            [(seg, [j for s2, j in other.rows if s2 == s]) for s, seg in enumerate(other.segments)]
            if isinstance(other, MixedRowsCache)
            else [(other, list(range(_size(other))))]
        )
        # Rows of ``other`` in its batch order: (its segment, row within it).
        order = other.rows if isinstance(other, MixedRowsCache) else [(0, j) for j in parts[0][1]]
        placed: dict[int, tuple[int, int]] = {}
        for s_other, (seg, _) in enumerate(parts):
            target = next(
                (
                    t
                    for t, mine in enumerate(self.segments)
                    if type(mine) is type(seg) and _batch_signature(mine) == _batch_signature(seg)
                ),
                None,
            )
            if target is None:
                placed[s_other] = (len(self.segments), 0)
                self.segments.append(seg)
            else:
                placed[s_other] = (target, _size(self.segments[target]))
                self.segments[target].extend(seg)
        self.rows += [(placed[s][0], placed[s][1] + j) for s, j in order]

    def extract(self, row: int) -> Any:
        if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < self.batch_size:
            raise CacheError(
                f"{self.kind}.extract: row={row!r} is out of range for a batch of "
                f"{self.batch_size}",
                fix=f"pass a row index in [0, {self.batch_size})",
            )
        s, j = self.rows[row]
        return self.segments[s].extract(j)

    # --- trim, size, state ------------------------------------------------------

    def is_trimmable(self) -> bool:
        return False

    def trim(self, n: int) -> int:
        if n == 0:
            return 0
        raise CacheNotTrimmable(
            f"{self.kind} cannot trim {n} token(s): its rows live in caches of different codecs",
            fix="extract() the row and trim its single-row cache",
        )

    def size(self) -> int:
        return max((seg.size() for seg in self.segments), default=0)

    def empty(self) -> bool:
        return all(seg.empty() for seg in self.segments)

    @property
    def nbytes(self) -> int:
        return sum(seg.nbytes for seg in self.segments)

    @property
    def state(self) -> Any:
        raise CacheError(
            f"{self.kind}: a batch of mixed codecs has no single state",
            fix="extract() each row and save its single-row caches",
        )

    @property
    def meta_state(self) -> Any:
        return self.state

    def __repr__(self) -> str:
        kinds = ", ".join(type(s).__name__ for s in self.segments)
        return f"{self.kind}(rows={self.batch_size}, segments=[{kinds}])"


def _size(cache: Any) -> int:
    return int(getattr(cache, "batch_size", None) or mx.array(cache.offset).size)
