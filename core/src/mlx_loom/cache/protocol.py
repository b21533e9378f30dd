"""The cache protocols every cache kind honours.

Graphs and loops talk to caches only through these methods, so a loop written
once (prefill, decode, batching, speculation, prompt-cache reuse) works for
every family whose caches conform. The method names follow mlx-lm's caches on
purpose: mlx-lm is our numerical oracle, and parity tests drive both with the
same calls.

Shapes: keys and values are ``[B, n_kv_heads, L, head_dim]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import mlx.core as mx

# A mask is ``None`` (no masking needed), the string ``"causal"`` (let the
# attention kernel build it) or a boolean array broadcastable to
# ``[B, heads, L_query, L_key]``.
Mask = None | str | mx.array


@runtime_checkable
class Cache(Protocol):
    """State carried between forwards for one layer."""

    @property
    def offset(self) -> int | mx.array:
        """Tokens seen so far: an int, or one per row in a batch."""

    def make_mask(
        self, N: int, *, window_size: int | None = None, return_array: bool = False
    ) -> Mask:
        """The attention mask for the next ``N`` query positions."""

    def is_trimmable(self) -> bool:
        """Whether :meth:`trim` can drop trailing tokens exactly."""

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens; return how many were dropped.

        Raises :class:`~mlx_loom.errors.CacheNotTrimmable` when dropping them
        cannot be done exactly. Never silently does nothing.
        """

    @property
    def state(self) -> Any:
        """Arrays that, with :attr:`meta_state`, recreate this cache."""

    @property
    def meta_state(self) -> Any:
        """Small non-array metadata (strings) needed to recreate the cache."""

    @property
    def nbytes(self) -> int: ...

    def empty(self) -> bool: ...


@runtime_checkable
class AttentionCache(Cache, Protocol):
    """A key/value cache: full or rotating window, stored plain or in a codec."""

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        """Append this step's keys/values; return the stored keys/values (mlx-lm's call)."""

    def append(self, keys: mx.array, values: mx.array) -> Any:
        """Append this step's keys/values; return the view that attends over them.

        The view (:class:`~mlx_loom.cache.views.KVView`) carries the storage
        codec's own attention arithmetic; graphs only ever call
        ``view.attend(queries, scale=, mask=, sinks=)``.
        """


@runtime_checkable
class BatchRows(Protocol):
    """Per-row batch operations (continuous batching, padded prefill)."""

    def prepare(
        self,
        *,
        left_padding: Sequence[int] | None = None,
        lengths: Sequence[int] | None = None,
        right_padding: Sequence[int] | None = None,
    ) -> None:
        """Declare padding for the next (prefill) forward so pads never count."""

    def finalize(self) -> None:
        """Fold any right padding declared in :meth:`prepare` away."""

    def filter(self, rows: Sequence[int]) -> None:
        """Keep only ``rows`` (in that order)."""

    def extend(self, other: Any) -> None:
        """Append the rows of ``other`` (a cache of the same kind)."""

    def extract(self, row: int) -> Cache:
        """Return row ``row`` as an independent single-row cache."""


@runtime_checkable
class RowPlaces(Protocol):
    """Batch caches whose row can be overwritten, in place, by a newcomer's cache.

    Optional. The engine keeps a row that left a batch in its caches for a
    while (parked) and lets a joining row take its place, instead of copying
    every row into new buffers; a batch kind without these methods (or that
    answers ``False``) gets its joins by ``extend``, as before. ``put_row``
    must lay the row out as ``stack`` would, so the row still decodes bit for
    bit as alone.
    """

    def takes_row(self, single: Any) -> bool:
        """Whether ``put_row`` can write ``single`` (a row's own cache) here."""

    def put_row(self, row: int, single: Any) -> None:
        """Make row ``row`` hold ``single``'s tokens (the other rows untouched)."""


@runtime_checkable
class Stackable(Protocol):
    """Single-row caches that can become the rows of a decoding batch.

    ``stack`` is the promise continuous batching rests on: row ``i`` of the
    returned batch cache (a :class:`BatchRows`) decodes bit for bit as
    ``caches[i]`` would alone, so a request's tokens and logits do not depend
    on which other requests share its batch. A kind that cannot keep that
    promise does not provide ``stack``; the engine then runs its rows one
    forward each.
    """

    @classmethod
    def stack(cls, caches: Sequence[Any]) -> Any:
        """A batch cache holding ``caches`` as its rows, in order."""


@runtime_checkable
class Boundable(Protocol):
    """Caches that can hold at most a given number of tokens (``max_kv_size``).

    The engine asks every fresh cache of a request for its bounded form and
    never looks at its class: a full cache becomes a window of that many
    tokens in the same codec, a wider window narrows, state that does not
    grow (recurrent) is returned as it is. A kind that cannot be bounded
    does not provide ``bounded`` (or raises
    :class:`~mlx_loom.errors.CapabilityRefused`), and the request is refused.
    """

    def bounded(self, max_tokens: int) -> Any:
        """A fresh cache for this layer that holds at most ``max_tokens`` tokens (or ``self``)."""


@runtime_checkable
class SpeculativeRounds(Protocol):
    """Caches that cannot be trimmed but can roll a speculative window back."""

    def begin_round(self) -> None:
        """Snapshot the state before a window of draft tokens is verified."""

    def commit(self, keep: int | Sequence[int]) -> None:
        """Keep the first ``keep`` tokens of the window (one count, or one per row)."""


@runtime_checkable
class Checkpointable(Protocol):
    """Caches that cannot always trim, and instead snapshot their state at chosen positions.

    The prefix store keeps these checkpoints while a prompt is prefilled (at
    turn boundaries and every few chunks), so a later prompt sharing a prefix
    restores the checkpoint (``checkpoint.restore()``: a new cache of the same
    kind) where a trimmable cache would be trimmed.
    """

    def checkpoint(self) -> Any:
        """An immutable snapshot of this single-row cache.

        A :class:`~mlx_loom.cache.checkpoint.Checkpoint`; its ``restore()``
        is a new cache of the same kind holding this state.
        """
