"""The shared prefix store: prompt caches keyed by the tokens they hold, LRU-bounded.

Every request of an engine looks here first: the entry sharing the longest
usable prefix with its prompt saves that much prefill. "Usable" depends on
the caches: an entry whose caches can all trim (full KV, a window that has
not filled) serves any common prefix, trimmed to it; an entry that cannot
trim (recurrent state, a wrapped window) serves only a prompt it is an exact
prefix of. At least one prompt token is always left to feed, since the last
prompt token's logits choose the first new token.

When a request ends, its caches (prompt plus generated tokens) go back in, so
the next turn of that conversation finds them; two conversations that
alternate keep an entry each, where one shared slot would lose both.

Bounds: at most ``max_entries`` entries and ``max_bytes`` bytes; the least
recently used entries go first. A trimmable entry that is a prefix of a new
one is dropped (the longer one serves it, trimmed). Entries are stored and
handed out as independent copies (:func:`~mlx_loom.engine.caches.snapshot`),
so a request writing to its caches never changes the store.

Used by the engine's thread only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlx_loom.engine.caches import snapshot


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens ``a`` and ``b`` share from the start (the prefix store's match,
    and a prompt cache's)."""
    n = 0
    for x, y in zip(a, b, strict=False):  # stops at the shorter
        if x != y:
            break
        n += 1
    return n


@dataclass
class _Entry:
    tokens: tuple[int, ...]
    caches: list[Any]
    nbytes: int
    trimmable: bool


@dataclass(frozen=True)
class StoreStats:
    entries: int
    nbytes: int
    hits: int
    misses: int
    evictions: int


class PrefixStore:
    """LRU store of single-row prompt caches, keyed by (cache layout, tokens held)."""

    def __init__(self, max_entries: int, max_bytes: int | None = None) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[Hashable, tuple[int, ...]], _Entry] = OrderedDict()
        self._nbytes = 0
        self.hits = self.misses = self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def stats(self) -> StoreStats:
        return StoreStats(len(self), self._nbytes, self.hits, self.misses, self.evictions)

    def resize(self, max_entries: int, max_bytes: int | None) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._evict()

    # --- lookup -----------------------------------------------------------------

    def fetch(self, key: Hashable, prompt: Sequence[int]) -> tuple[list[Any], int] | None:
        """Caches holding the longest usable prefix of ``prompt``, and its length.

        ``key`` is the cache layout the request needs (the same model cache
        kinds, KV quantization and window), so an entry is only ever reused
        by a request that would have built the same caches.
        """
        best: tuple[int, tuple[Hashable, tuple[int, ...]]] | None = None
        for entry_key, entry in self._entries.items():
            if entry_key[0] != key:
                continue
            n = common_prefix(entry.tokens, prompt)
            if n == len(entry.tokens) and n < len(prompt):
                usable = n  # an exact prefix: no trim needed
            elif entry.trimmable:
                usable = min(n, len(prompt) - 1)
            else:
                continue
            if usable > 0 and (best is None or usable > best[0]):
                best = (usable, entry_key)
        if best is None:
            self.misses += 1
            return None
        usable, entry_key = best
        entry = self._entries[entry_key]
        self._entries.move_to_end(entry_key)
        caches = snapshot(entry.caches)
        drop = len(entry.tokens) - usable
        if drop:
            for c in caches:
                c.trim(drop)
        self.hits += 1
        return caches, usable

    # --- insertion ----------------------------------------------------------------

    def measure(self, caches: Sequence[Any]) -> tuple[int, bool]:
        """An entry's bytes, and whether every one of its caches can trim."""
        return sum(int(c.nbytes) for c in caches), all(c.is_trimmable() for c in caches)

    def insert(self, key: Hashable, tokens: Sequence[int], caches: Sequence[Any]) -> None:
        """Keep ``caches`` (holding exactly ``tokens``) for later requests."""
        tokens = tuple(tokens)
        if not tokens or self.max_entries == 0:
            return
        copies = snapshot(caches)
        mx.eval([c.state for c in copies])
        nbytes, trimmable = self.measure(copies)
        if self.max_bytes is not None and nbytes > self.max_bytes:
            return  # larger than the whole store: keeping it would evict everything
        entry_key = (key, tokens)
        old = self._entries.pop(entry_key, None)
        if old is not None:
            self._nbytes -= old.nbytes
        if trimmable:
            for other_key in [
                k
                for k, e in self._entries.items()
                if k[0] == key and e.trimmable and tokens[: len(e.tokens)] == e.tokens
            ]:
                self._nbytes -= self._entries.pop(other_key).nbytes
        self._entries[entry_key] = _Entry(tokens, copies, nbytes, trimmable)
        self._nbytes += nbytes
        self._evict()

    def _evict(self) -> None:
        while self._entries and (
            len(self._entries) > self.max_entries
            or (self.max_bytes is not None and self._nbytes > self.max_bytes)
        ):
            _, entry = self._entries.popitem(last=False)
            self._nbytes -= entry.nbytes
            self.evictions += 1

    def clear(self) -> None:
        self._entries.clear()
        self._nbytes = 0
