"""The shared prefix store: prompt caches keyed by the tokens they hold, LRU-bounded.

Every request of an engine looks here first: the entry sharing the longest
usable prefix with its prompt saves that much prefill. "Usable" depends on
the caches: an entry whose caches can all trim (full KV, a window that has
not filled) serves any common prefix, trimmed to it; an entry that cannot
trim (recurrent state, a wrapped window) serves the engine only from its
checkpoints (below) — its own end holds tokens decoded one at a time, which a
prefill from nothing does not repeat bit for bit — and serves
:meth:`PrefixStore.fetch` a prompt it is an exact prefix of. At least one
prompt token is always left to feed, since the last prompt token's logits
choose the first new token.

When a request ends, its caches (prompt plus generated tokens) go back in, so
the next turn of that conversation finds them; two conversations that
alternate keep an entry each, where one shared slot would lose both.

**Checkpoints** make caches that cannot trim reusable too. While a prompt
is prefilled, the engine keeps, at turn boundaries, at the prompt's end and
every few chunks (:mod:`mlx_loom.engine.splits`), a snapshot of each layer
that cannot trim (``cache.checkpoint()``: a recurrent state, a sliding
window's slots and offsets); they go in with the request's entry. A later
prompt sharing ``p`` tokens with an entry is then served from the entry's
last checkpoint at or before ``p``: those layers are restored from it, and
layers that can trim (full attention, whose keys for ``[0, p)`` are the
same in the longer entry) are trimmed to it. Gemma 4's KV-shared layers own
no cache and follow their donors. A checkpoint serves only a prompt whose own
prefill ends a chunk at that position, so its caches are exactly those a
request with no cache would have there (see :mod:`mlx_loom.engine.splits`).

Bounds: at most ``max_entries`` entries and ``max_bytes`` bytes; the least
recently used entries go first. A trimmable entry that is a prefix of a new
one is dropped (the longer one serves it, trimmed). Entries are stored and
handed out as independent copies (:func:`~mlx_loom.engine.caches.snapshot`),
so a request writing to its caches never changes the store.

Used by the engine's thread only.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlx_loom.engine.caches import snapshot
from mlx_loom.engine.disk import FILES_PER_ENTRY, DiskTier
from mlx_loom.errors import LoomError

log = logging.getLogger("mlx_loom.engine")

#: Checkpoints one entry keeps (its latest): with no byte bound, a 100K-token
#: prompt checkpointed every 8,192 tokens would otherwise keep a dozen
#: Qwen3-Next states (~79 MB each) in every entry.
MAX_CHECKPOINTS_PER_ENTRY = 16


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens ``a`` and ``b`` share from the start (the prefix store's match,
    and a prompt cache's)."""
    n = 0
    for x, y in zip(a, b, strict=False):  # stops at the shorter
        if x != y:
            break
        n += 1
    return n


@dataclass(frozen=True)
class TakenCheckpoint:
    """The caches of one row at one prompt position: a snapshot of each layer that
    cannot trim (``None`` for a layer that trims), and each layer's cache kind then."""

    position: int
    layers: tuple[Any, ...]
    kinds: tuple[Hashable, ...]  # each layer's form: its class and its codec

    @property
    def nbytes(self) -> int:
        return sum(int(c.nbytes) for c in self.layers if c is not None)


def take_checkpoint(position: int, caches: Sequence[Any]) -> TakenCheckpoint:
    """Snapshot each layer of ``caches`` that offers ``checkpoint()``; the others will trim."""
    layers = tuple(
        c.checkpoint() if callable(getattr(c, "checkpoint", None)) else None for c in caches
    )
    mx.eval([a for c in layers if c is not None for a in c.arrays])
    return TakenCheckpoint(position, layers, tuple(_form(c) for c in caches))


def _form(cache: Any) -> Hashable:
    """A layer's class and storage codec: one layout changes codec when KV quantization starts."""
    return (type(cache), getattr(cache, "codec_key", None))


def trims_as(cache: Any, kind: Hashable) -> bool:
    return bool(cache.is_trimmable()) and _form(cache) == kind


def _restorable(entry: _Entry, cp: TakenCheckpoint) -> bool:
    """Whether ``entry``'s caches at ``cp`` can be rebuilt: a layer without a snapshot is
    trimmed from the entry's end, so it must still be the kind it was then (KV
    quantization may have switched it since) and trim."""
    return all(
        layer is not None or trims_as(c, kind)
        for layer, c, kind in zip(cp.layers, entry.caches, cp.kinds, strict=True)
    )


@dataclass
class _Entry:
    tokens: tuple[int, ...]
    caches: list[Any]
    nbytes: int
    trimmable: bool
    checkpoints: tuple[TakenCheckpoint, ...] = ()


@dataclass(frozen=True)
class StoreStats:
    entries: int
    nbytes: int
    hits: int
    misses: int
    evictions: int
    #: Bytes of the entries' checkpoints (part of ``nbytes``), and how many there are.
    checkpoint_bytes: int = 0
    checkpoints: int = 0
    #: Hits served from a checkpoint (part of ``hits``).
    checkpoint_hits: int = 0
    #: The disk tier (``--prompt-cache-dir``): bytes and files there, hits served
    #: from it (part of ``hits``), files written, files skipped as unusable.
    disk_bytes: int = 0
    disk_files: int = 0
    disk_hits: int = 0
    disk_writes: int = 0
    disk_skipped: int = 0


@dataclass(frozen=True)
class Hit:
    """Caches holding the first ``reused`` prompt tokens, from an entry or a checkpoint."""

    caches: list[Any]
    reused: int
    #: Served from a checkpoint: the caches are exactly what a prefill of
    #: those tokens from nothing makes (see :mod:`mlx_loom.engine.splits`).
    from_checkpoint: bool
    #: The entry's checkpoints up to the one served: the request's own entry
    #: keeps them (they are immutable; an entry with the same tokens replaces
    #: the old one, which must not take them away).
    earlier: tuple[TakenCheckpoint, ...] = ()


class PrefixStore:
    """LRU store of single-row prompt caches, keyed by (cache layout, tokens held)."""

    def __init__(
        self, max_entries: int, max_bytes: int | None = None, disk: DiskTier | None = None
    ) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.disk = disk
        self._entries: OrderedDict[tuple[Hashable, tuple[int, ...]], _Entry] = OrderedDict()
        self._nbytes = 0
        self.hits = self.misses = self.evictions = self.checkpoint_hits = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def stats(self) -> StoreStats:
        held = [cp for e in self._entries.values() for cp in e.checkpoints]
        disk = self.disk
        on_disk = {}
        if disk is not None:
            on_disk = dict(
                disk_bytes=disk.nbytes,
                disk_files=len(disk.files),
                disk_hits=disk.hits,
                disk_writes=disk.writes,
                disk_skipped=disk.skipped,
            )
        return StoreStats(
            len(self),
            self._nbytes,
            self.hits,
            self.misses,
            self.evictions,
            checkpoint_bytes=sum(cp.nbytes for cp in held),
            checkpoints=len(held),
            checkpoint_hits=self.checkpoint_hits,
            **on_disk,
        )

    def resize(self, max_entries: int, max_bytes: int | None) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._evict()

    # --- lookup -----------------------------------------------------------------

    def fetch(self, key: Hashable, prompt: Sequence[int]) -> tuple[list[Any], int] | None:
        """:meth:`find` without checkpoints, as ``(caches, reused)``."""
        hit = self.find(key, prompt)
        return None if hit is None else (hit.caches, hit.reused)

    def find(
        self,
        key: Hashable,
        prompt: Sequence[int],
        ends_chunk: Callable[[int], bool] | None = None,
    ) -> Hit | None:
        """Caches holding the longest usable prefix of ``prompt``, and its length.

        ``key`` is the cache layout the request needs (the same model cache
        kinds, KV quantization and window, adapter, prefill step), so an
        entry is only ever reused by a request that would have built the same
        caches. ``ends_chunk(p)`` says whether ``prompt``'s own prefill ends a
        chunk at ``p``: only there may a checkpoint serve it (``None``: no
        checkpoint serves it).
        """
        # (tokens reused, the entry, the checkpoint serving them or None)
        best: tuple[int, tuple[Hashable, tuple[int, ...]], TakenCheckpoint | None] | None = None
        for entry_key, entry in self._entries.items():
            if entry_key[0] != key:
                continue
            n = common_prefix(entry.tokens, prompt)
            usable = 0
            if entry.trimmable:
                usable = min(n, len(prompt) - 1)
            elif n == len(entry.tokens) and n < len(prompt) and ends_chunk is None:
                # An exact prefix, no trim needed — but its state was decoded a
                # token at a time, which a prefill from nothing does not repeat
                # bit for bit; callers that pass ``ends_chunk`` take checkpoints only.
                usable = n
            if usable > 0 and (best is None or usable > best[0]):
                best = (usable, entry_key, None)
            cp = self._checkpoint_for(entry, min(n, len(prompt) - 1), ends_chunk)
            # At an equal length a checkpoint wins: its caches are exact.
            if cp is not None and (best is None or cp.position >= best[0]):
                best = (cp.position, entry_key, cp)
        if self.disk is not None:
            found = self.disk.best(key, prompt, ends_chunk)
            if found is not None and (best is None or found[0] > best[0]):
                loaded = self.disk.load(found[1], key, found[0])
                if loaded is not None:
                    self.hits += 1
                    return Hit(loaded.caches, loaded.reused, loaded.from_checkpoint)
        if best is None:
            self.misses += 1
            return None
        usable, entry_key, checkpoint = best
        entry = self._entries[entry_key]
        self._entries.move_to_end(entry_key)
        self.hits += 1
        if checkpoint is not None:
            self.checkpoint_hits += 1
            earlier = tuple(c for c in entry.checkpoints if c.position <= usable)
            return Hit(self._restore(entry, checkpoint), usable, True, earlier)
        caches = snapshot(entry.caches)
        drop = len(entry.tokens) - usable
        if drop:
            for c in caches:
                c.trim(drop)
        return Hit(caches, usable, False)

    @staticmethod
    def _checkpoint_for(
        entry: _Entry, limit: int, ends_chunk: Callable[[int], bool] | None
    ) -> TakenCheckpoint | None:
        """The entry's last checkpoint at or before ``limit`` that can serve the prompt."""
        if ends_chunk is None:
            return None
        for cp in reversed(entry.checkpoints):  # kept in position order
            if not 0 < cp.position <= limit or not ends_chunk(cp.position):
                continue
            if _restorable(entry, cp):
                return cp
        return None

    @staticmethod
    def _restore(entry: _Entry, cp: TakenCheckpoint) -> list[Any]:
        out = []
        for layer, cache in zip(cp.layers, entry.caches, strict=True):
            if layer is not None:
                out.append(layer.restore())
            else:
                (copy,) = snapshot([cache])
                copy.trim(len(entry.tokens) - cp.position)
                out.append(copy)
        return out

    # --- insertion ----------------------------------------------------------------

    def measure(self, caches: Sequence[Any]) -> tuple[int, bool]:
        """An entry's bytes, and whether every one of its caches can trim."""
        return sum(int(c.nbytes) for c in caches), all(c.is_trimmable() for c in caches)

    def weigh(self, nbytes: int) -> int:
        """What ``nbytes`` of an entry's checkpoints count for against ``max_bytes``."""
        return nbytes

    def insert(
        self,
        key: Hashable,
        tokens: Sequence[int],
        caches: Sequence[Any],
        checkpoints: Sequence[TakenCheckpoint] = (),
    ) -> None:
        """Keep ``caches`` (holding exactly ``tokens``) for later requests, with the
        ``checkpoints`` taken on the way there (in position order)."""
        tokens = tuple(tokens)
        if not tokens or self.max_entries == 0:
            return
        copies = snapshot(caches)
        mx.eval([c.state for c in copies])
        nbytes, trimmable = self.measure(copies)
        if self.max_bytes is not None and nbytes > self.max_bytes:
            return  # larger than the whole store: keeping it would evict everything
        kept = [cp for cp in checkpoints if 0 < cp.position <= len(tokens)]
        kept = kept[-MAX_CHECKPOINTS_PER_ENTRY:]
        if trimmable:
            kept = []  # the entry itself serves every prefix, trimmed
        while kept:
            extra = self.weigh(sum(cp.nbytes for cp in kept))
            if self.max_bytes is None or nbytes + extra <= self.max_bytes:
                nbytes += extra
                break
            kept.pop(0)  # the earliest checkpoints go first: later ones save more
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
        self._entries[entry_key] = _Entry(tokens, copies, nbytes, trimmable, tuple(kept))
        self._nbytes += nbytes
        self._evict()

    def _evict(self) -> None:
        while self._entries and (
            len(self._entries) > self.max_entries
            or (self.max_bytes is not None and self._nbytes > self.max_bytes)
        ):
            (key, _), entry = self._entries.popitem(last=False)
            self._nbytes -= entry.nbytes
            self.evictions += 1
            self._spill(key, entry)

    def _spill(self, key: Hashable, entry: _Entry) -> None:
        """Write what of ``entry`` serves exactly to the disk tier, if there is one."""
        disk = self.disk
        if disk is None:
            return
        try:
            if entry.trimmable:
                disk.write(key, entry.tokens, entry.caches, "prefix")
                return
            for cp in entry.checkpoints[-FILES_PER_ENTRY:]:
                if _restorable(entry, cp):
                    tokens = entry.tokens[: cp.position]
                    disk.write(key, tokens, self._restore(entry, cp), "checkpoint")
        except LoomError:
            log.exception("could not write a prompt cache to disk")

    def flush(self) -> None:
        """Write every entry to the disk tier (the engine stops); the entries stay."""
        for (key, _), entry in list(self._entries.items()):
            self._spill(key, entry)

    def clear(self) -> None:
        self._entries.clear()
        self._nbytes = 0
