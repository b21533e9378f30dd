"""Speculative rounds for sliding-window caches: verify in decode order, commit the kept tokens.

A sliding window that has wrapped cannot be trimmed: the slots its newest
tokens overwrote held the tokens a shorter sequence needs again. A round
avoids overwriting anything until the round is decided:

* :meth:`begin_round` notes where the window stands; nothing is copied;
* every forward inside the round (a verify window of ``k+1`` tokens, or the
  draft's one-token steps) leaves the buffer untouched and attends over a
  *combined* key sequence — for each slot of the window, in slot order, the
  token the slot holds now followed by the round's tokens that one-token
  decoding would write there — with a mask that shows each query exactly the
  slots one-token decode step would show it, in the same order;
* :meth:`commit` writes the kept tokens with one-token writes, so the window
  ends exactly as plain decoding leaves it, slot for slot.

Why this layout: attention reduces over the keys in the order they are laid
out, and floating-point sums depend on that order. A plain multi-token chunk
puts the window back in time order first, which is not the rotated order
one-token decoding attends in, so a verify window's logits would differ from
decode's (measured: up to 5e-5 on a tiny Gemma 4's logits past its window). Here each
query sees the decode step's keys in the decode step's order; the extra
masked entries add exact zeros on the CPU backend (its softmax and matrix
products sum sequentially), so verify logits equal step-by-step decode
logits bit for bit (tested per family).

Everything here is slot bookkeeping on Python ints plus one gather per layer
and forward; no value is computed differently from decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from mlx_loom.cache import _buffers as buf


@dataclass
class WindowRound:
    """An open round: where the window stood, and the round's tokens so far."""

    offset: int
    #: ``(keys, values, idx)`` as they were, for a round that keeps nothing.
    before: tuple[Any, Any, int]
    keys: list[mx.array] = field(default_factory=list)
    values: list[mx.array] = field(default_factory=list)

    @property
    def pending(self) -> int:
        return sum(k.shape[2] for k in self.keys)


@dataclass(frozen=True)
class Layout:
    """Where one-token decoding would put ``count`` new tokens, and what each step sees.

    ``slots[t]`` is the slot token ``t`` is written to; ``seen[t]`` how many
    leading slots the step that writes it attends over; ``length`` the
    buffer's slot count once all are written; ``positions`` the absolute
    position each slot held before the round (``-1``: never written).
    """

    slots: tuple[int, ...]
    seen: tuple[int, ...]
    length: int
    positions: tuple[int, ...]


def decode_layout(
    *, length: int, idx: int, offset: int, max_size: int, keep: int, step: int, count: int
) -> Layout:
    """Simulate ``count`` one-token writes of a rotating cache (its ``_write_in_place``).

    The cache must be normalised (at most ``max_size`` slots; see
    :func:`normalise`).
    """
    if offset >= length:  # full (or never grown past what was written): rotated order
        R = max_size - keep
        positions = tuple(
            p if p < keep else offset - 1 - (idx - 1 - p) % R if R else -1 for p in range(length)
        )
        if offset == length and idx == length:
            positions = tuple(range(length))
    else:
        positions = tuple(p if p < offset else -1 for p in range(length))
    slots, seen = [], []
    L, i, off = length, idx, offset
    for _ in range(count):
        if L == 0 or (off >= L and L < max_size):
            L += min(step, max_size - off)
            i = off
        if i == max_size:
            i = keep
        slots.append(i)
        i += 1
        off += 1
        seen.append(off if off < L else L)
    return Layout(tuple(slots), tuple(seen), L, positions)


def combined_order(
    layout: Layout, old_slots: int, source_slots: int | None = None
) -> tuple[list[int], list[tuple[int, int]]]:
    """Source indices of the combined key sequence, and ``(slot, time)`` of each entry.

    The source is ``old buffer ++ the round's tokens``: the buffer has
    ``source_slots`` slots (default ``old_slots``) of which the first
    ``old_slots`` may hold tokens. Time ``-1`` is the token a slot held
    before the round, ``t >= 0`` the round's ``t``-th.
    """
    base = old_slots if source_slots is None else source_slots
    writes: dict[int, list[int]] = {}
    for t, s in enumerate(layout.slots):
        writes.setdefault(s, []).append(t)
    index, entries = [], []
    for p in range(layout.length):
        if p < old_slots and layout.positions[p] >= 0:
            index.append(p)
            entries.append((p, -1))
        for t in writes.get(p, ()):
            index.append(base + t)
            entries.append((p, t))
    return index, entries


def combined_mask(
    layout: Layout,
    entries: list[tuple[int, int]],
    *,
    first: int,
    n: int,
    offset: int,
    window: int | None,
) -> mx.array:
    """``[n, len(entries)]``: what round tokens ``first .. first+n-1`` see, as decode would."""
    rows = []
    for g in range(first, first + n):
        latest: dict[int, int] = {}
        for slot, t in entries:
            if t <= g:
                latest[slot] = max(latest.get(slot, -1), t)
        me = offset + g
        row = []
        for slot, t in entries:
            ok = slot < layout.seen[g] and latest.get(slot) == t
            if ok and window is not None:
                pos = layout.positions[slot] if t < 0 else offset + t
                ok = pos > me - window
            row.append(ok)
        rows.append(row)
    return mx.array(rows, dtype=mx.bool_)


def gather(source: buf.Stored, index: list[int]) -> buf.Stored:
    """The combined sequence: slots of ``source`` picked in ``index`` order (data movement)."""
    idx = mx.array(index, dtype=mx.int32)
    return buf.apply(lambda a: mx.take(a, idx, axis=2), source)
