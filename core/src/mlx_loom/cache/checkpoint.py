"""Checkpoints: immutable snapshots of a cache that cannot be trimmed back.

A recurrent state and a sliding window that has wrapped both forget the
tokens before them, so a cache holding a long prompt cannot serve a shorter
prefix of it. A checkpoint taken at a token position can: it is the cache's
state at that position, kept aside, and :meth:`Checkpoint.restore` makes a new
single-row cache of the same kind from it.

A checkpoint references the cache's arrays rather than copying them. MLX
arrays are values, but slice assignment (``a[..., i:j, :] = x``, how a window
writes one decoded token in place) rebinds the Python array *object* it is
applied to — so a checkpoint holds new array objects over the same buffers
(``a[...]``), and so does every cache restored from it: the live cache, the
checkpoint and each restored cache can then be written without changing each
other. Caches that replace their arrays on every forward (recurrent state)
cost nothing until they advance; a window costs its slots once it is next
written.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlx_loom.errors import CacheError

__all__ = ["Checkpoint"]


@dataclass(frozen=True)
class Checkpoint:
    """One single-row cache's state at one token position (see the module docstring)."""

    kind: Any  # the cache class (it has ``from_state``)
    arrays: tuple[mx.array, ...]
    meta: tuple[str, ...]
    offset: int
    nbytes: int

    @classmethod
    def of(
        cls, cache: Any, arrays: Sequence[mx.array], meta: Sequence[str], offset: int
    ) -> Checkpoint:
        """A checkpoint over ``arrays`` (new objects, shared buffers) and ``meta``."""
        held = tuple(a[...] for a in arrays)
        return cls(type(cache), held, tuple(meta), offset, sum(a.nbytes for a in held))

    def restore(self) -> Any:
        """A new single-row cache holding this state (writable without changing this one)."""
        return self.kind.from_state([a[...] for a in self.arrays], self.meta)


def refuse_open_round(cache: Any, in_round: bool) -> None:
    if in_round:
        raise CacheError(
            f"{type(cache).__name__}.checkpoint called while a speculative round is open",
            fix="commit(keep) the round first; checkpoints are taken between forwards",
        )
