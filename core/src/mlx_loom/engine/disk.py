"""The prefix store's disk tier: prompt caches kept in a directory across evictions and restarts.

Entries the memory tier evicts — and every entry when the engine stops — are
written to the directory as verified prompt-cache files
(:func:`~mlx_loom.cache.save_prompt_cache`: checksummed, written to a
temporary name and renamed, so a reader never sees half a file). What is
written is what can serve a later prompt exactly:

* an entry whose caches all trim: the entry itself (serves any prefix, trimmed);
* an entry that cannot trim: the caches at each of its last
  :data:`FILES_PER_ENTRY` checkpoints (the last turn boundaries and the
  prompt's end: a follow-up, an edited last message, a regenerate), full
  attention trimmed to the checkpoint. Each serves exactly its own length.

A later request — or a restarted server — looks here when memory has nothing
as long: the directory is indexed once (each file's header only, bounded), and
the file sharing the longest usable prefix is loaded and verified in full
(checksum, cache kinds, the geometry against the model, the model identity
and the store key in its metadata). A corrupt, truncated, foreign or tampered
file is skipped with a log line and never used; nothing about a file is fatal.

Bounded by ``max_bytes`` on disk: the least recently used files (by
modification time, which a hit refreshes) are deleted first. Files are named
by a hash of the model identity, the store key and the tokens, so two servers
of one model sharing a directory write the same name for the same prefix.

Used by the engine's thread only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from mlx_loom.artifacts.safetensors_header import read_safetensors_header
from mlx_loom.bounded_json import parse_json
from mlx_loom.cache import load_prompt_cache, save_prompt_cache
from mlx_loom.cache.geometry import check_caches_fit
from mlx_loom.cache.persist import HEADER_KEY
from mlx_loom.errors import CacheError, LoomError

if TYPE_CHECKING:
    from mlx_loom.model import Model

log = logging.getLogger("mlx_loom.engine")

#: Checkpoints of one entry written to disk (its last ones).
FILES_PER_ENTRY = 4
#: Files indexed in the directory; past this many, the rest are ignored (logged).
MAX_FILES = 4096
SUFFIX = ".safetensors"
_FIX = "the file is skipped; delete it, or let the disk tier's byte bound remove it"


def model_identity(model: Model) -> str:
    """What ties a file to these weights: implementation, directory, and each weight file's
    size and modification time (a replaced or rewritten shard changes it), and the
    KV storage dtype when the model was loaded with one."""
    root = Path(model.model_dir).resolve()
    parts = [model.implementation.id, str(root)]
    if getattr(model, "kv_dtype", None) is not None:
        # A cache stored in another precision continues differently.
        parts.append(f"kv_dtype:{model.kv_dtype}")
    for shard in sorted(root.glob("*.safetensors")):
        st = shard.stat()
        parts.append(f"{shard.name}:{st.st_size}:{st.st_mtime_ns}")
    return "sha256:" + hashlib.sha256("\n".join(parts).encode()).hexdigest()


@dataclass
class _File:
    path: Path
    key: str
    tokens: tuple[int, ...]
    #: ``"prefix"``: every cache trims, serves any common prefix;
    #: ``"checkpoint"``: serves exactly its own length.
    serves: str
    nbytes: int
    used: float


@dataclass(frozen=True)
class DiskHit:
    caches: list[Any]
    reused: int
    from_checkpoint: bool


def check_directory(directory: str | Path) -> Path:
    """``directory``, created if missing; :class:`CacheError` unless it is a writable directory."""
    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CacheError(
            f"The prompt-cache directory {str(path)!r} cannot be created ({err.strerror or err}).",
            fix="Pass a writable directory (--prompt-cache-dir, prompt_cache_dir).",
        ) from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise CacheError(
            f"The prompt-cache directory {str(path)!r} is not writable.",
            fix="Pass a writable directory (--prompt-cache-dir, prompt_cache_dir).",
        )
    return path


class DiskTier:
    """Prompt caches in ``directory``, at most ``max_bytes`` of files (see the module docstring)."""

    def __init__(self, directory: str | Path, max_bytes: int | None, model: Model) -> None:
        self.directory = check_directory(directory)
        self.max_bytes = max_bytes
        self.model = model
        self.identity = model_identity(model)
        self._files: dict[str, _File] | None = None
        self.hits = self.writes = self.skipped = 0

    # --- the index ------------------------------------------------------------------

    @property
    def files(self) -> dict[str, _File]:
        if self._files is None:
            self._files = self._scan()
        return self._files

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.files.values())

    def _scan(self) -> dict[str, _File]:
        found: dict[str, _File] = {}
        names = sorted(p for p in self.directory.glob("*" + SUFFIX) if not p.name.startswith("."))
        if len(names) > MAX_FILES:
            log.warning(
                "the prompt-cache directory %s holds %d files; indexing the first %d",
                self.directory,
                len(names),
                MAX_FILES,
            )
        for path in names[:MAX_FILES]:
            entry = self._describe(path)
            if entry is not None:
                found[path.name] = entry
        return found

    def _describe(self, path: Path) -> _File | None:
        """A file's index entry from its header alone; ``None`` (logged) if it is not ours."""
        try:
            header = read_safetensors_header(path)
            raw = header.metadata.get(HEADER_KEY)
            if raw is None:
                raise CacheError("it is not a prompt-cache file", fix=_FIX)
            doc = parse_json(raw, source=str(path), error=CacheError, fix=_FIX)
            meta = doc.get("metadata") if isinstance(doc, dict) else None
            if not isinstance(meta, dict):
                raise CacheError("its header has no metadata", fix=_FIX)
            if meta.get("identity") != self.identity:
                return None  # another model's (or other weights'): not an error, not ours
            tokens = parse_json(
                str(meta.get("tokens")), source=str(path), error=CacheError, fix=_FIX
            )
            if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
                raise CacheError("its token list is not a list of token ids", fix=_FIX)
            serves = meta.get("serves")
            if serves not in ("prefix", "checkpoint") or not isinstance(meta.get("key"), str):
                raise CacheError("its metadata does not say what it serves", fix=_FIX)
            st = path.stat()
        except (LoomError, OSError, ValueError) as err:
            self._skip(path, err)
            return None
        return _File(path, meta["key"], tuple(tokens), serves, st.st_size, st.st_mtime)

    def _skip(self, path: Path, err: BaseException) -> None:
        self.skipped += 1
        message = err.message if isinstance(err, LoomError) else str(err)
        log.warning("skipping the prompt-cache file %s: %s", path, message)

    # --- lookup -------------------------------------------------------------------

    def best(
        self, key: Hashable, prompt: Sequence[int], ends_chunk: Callable[[int], bool] | None
    ) -> tuple[int, str] | None:
        """The longest usable prefix a file holds for ``prompt``, and the file's name."""
        want, prompt = repr(key), tuple(prompt)
        best: tuple[int, str] | None = None
        for name, f in self.files.items():
            if f.key != want:
                continue
            if f.serves == "prefix":
                usable = min(_common_prefix(f.tokens, prompt), len(prompt) - 1)
            else:
                p = len(f.tokens)
                ok = p <= len(prompt) - 1 and ends_chunk is not None and ends_chunk(p)
                usable = p if ok and prompt[:p] == f.tokens else 0
            if usable > 0 and (best is None or usable > best[0]):
                best = (usable, name)
        return best

    def load(self, name: str, key: Hashable, usable: int) -> DiskHit | None:
        """The file's caches holding the first ``usable`` tokens, verified; ``None`` if it fails."""
        f = self.files[name]
        try:
            caches, meta = load_prompt_cache(f.path, kinds=self.model.binding.cache_kinds)
            if meta.get("identity") != self.identity or meta.get("key") != repr(key):
                raise CacheError("its verified metadata is not this model's or key's", fix=_FIX)
            if meta.get("tokens") != json.dumps(list(f.tokens)):
                raise CacheError("its verified token list differs from its header's", fix=_FIX)
            check_caches_fit(caches, self.model, tokens=len(f.tokens), source=str(f.path))
            mx.eval([c.state for c in caches])
            drop = len(f.tokens) - usable
            if drop:
                for c in caches:
                    c.trim(drop)
        except (LoomError, OSError, ValueError) as err:
            del self.files[name]
            self._skip(f.path, err)
            return None
        self.hits += 1
        self._touch(f)
        return DiskHit(caches, usable, f.serves == "checkpoint")

    # --- writing ------------------------------------------------------------------

    def write(
        self, key: Hashable, tokens: Sequence[int], caches: Sequence[Any], serves: str
    ) -> None:
        """Keep ``caches`` (holding exactly ``tokens``) on disk, then evict to the byte bound."""
        tokens = tuple(tokens)
        name = self._name(key, tokens)
        known = self.files.get(name)
        if known is not None:
            self._touch(known)
            return
        size = sum(int(c.nbytes) for c in caches)
        if self.max_bytes is not None and size > self.max_bytes:
            return  # larger than the whole tier
        path = self.directory / name
        metadata = {
            "identity": self.identity,
            "key": repr(key),
            "tokens": json.dumps(list(tokens)),
            "serves": serves,
        }
        try:
            save_prompt_cache(path, caches, metadata, kinds=self.model.binding.cache_kinds)
            st = path.stat()
        except (LoomError, OSError) as err:
            message = err.message if isinstance(err, LoomError) else str(err)
            log.warning("could not write the prompt-cache file %s: %s", path, message)
            return
        self.writes += 1
        self.files[name] = _File(path, repr(key), tokens, serves, st.st_size, st.st_mtime)
        self._evict(keep=name)

    def _name(self, key: Hashable, tokens: tuple[int, ...]) -> str:
        digest = hashlib.sha256(f"{self.identity}\n{key!r}\n{list(tokens)}".encode()).hexdigest()
        return digest[:40] + SUFFIX

    def _touch(self, f: _File) -> None:
        try:
            os.utime(f.path)
            f.used = f.path.stat().st_mtime
        except OSError:
            pass  # another server removed it: the index will find out on load

    def _evict(self, keep: str) -> None:
        if self.max_bytes is None:
            return
        files = self.files
        total = sum(f.nbytes for f in files.values())
        for name, f in sorted(files.items(), key=lambda kv: kv[1].used):
            if total <= self.max_bytes:
                break
            if name == keep:
                continue
            try:
                f.path.unlink(missing_ok=True)
            except OSError as err:
                log.warning("could not delete the prompt-cache file %s: %s", f.path, err)
                continue
            total -= f.nbytes
            del files[name]


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """The shared prefix's length, by bisection over slice comparisons (in C): a
    directory of thousands of files sharing a long system prompt stays cheap."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
