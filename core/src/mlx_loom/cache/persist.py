"""Saving and loading prompt caches as ``.safetensors`` files, verified before use.

The arrays of each layer's cache ``state`` are stored as tensors named
``"<layer>.<i>"``; everything else (the cache kind, its ``meta_state``
strings, the array count, the caller's metadata, a checksum) is one JSON
document in the file's metadata, validated with a bounded pydantic model on
load.

Unlike mlx-lm, which turns a class name from the file into code through
``globals()``, a file may only name a cache kind from a fixed table of
registered kinds (:data:`mlx_loom.cache.CACHE_KINDS`, or the table the
caller passes — :class:`mlx_loom.PromptCache` passes its model's registry
table, which adds the kinds plugins registered); any other name is a
:class:`~mlx_loom.errors.CacheError`. A hostile file therefore cannot choose
what code runs on load.

Loading checks, in this order, each failure a ``CacheError`` naming the file:

1. the safetensors header (size, nesting, tensors tiling the file exactly),
   so nothing past the end of the file is ever allocated;
2. our header: bounded JSON, then bounded fields (at most
   :data:`MAX_LAYERS` layers, :data:`MAX_ARRAYS_PER_LAYER` arrays each, short
   ``meta_state`` strings), and the array counts against the tensors the file
   really holds — a header claiming ``n_arrays = 10**9`` fails here, before
   anything is built;
3. the checksum: SHA-256 over our header and every tensor's name, dtype,
   shape and bytes, written by :func:`save_prompt_cache`. A bit flip or a
   truncated write anywhere in the body is caught. (It detects corruption, not
   forgery: anyone can write a consistent file, which is why checks 1-2 and the
   kind table do not trust it.)

Files written before the KV caches took a storage codec name kinds such as
``QuantizedKVCache``; :data:`KIND_ALIASES` reads them as the layout they
are, with the codec named in its ``meta_state`` as files name it today.

Files of format version 1 (before the checksum) are refused with the fix
"rebuild the cache": without a checksum their body cannot be verified, and a
prompt cache is cheap to rebuild. Saving writes a temporary file beside the
target and renames it into place, so an interrupted save never leaves a
half-written cache.

Whether the caches fit a particular model (layers, kinds, heads, head_dim,
dtype, window) is checked by :mod:`mlx_loom.cache.geometry` when a
:class:`~mlx_loom.generation.PromptCache` is loaded for that model.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Annotated, Any, Final, Literal, cast

import mlx.core as mx
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from mlx_loom.artifacts.safetensors_header import (
    SafetensorsHeader,
    read_safetensors_header,
)
from mlx_loom.artifacts.staging import remove_orphans, temp_name
from mlx_loom.artifacts.weights import tensor_signature
from mlx_loom.bounded_json import JsonLimits, parse_json
from mlx_loom.errors import CacheError, SafetensorsHeaderError

__all__ = ["KIND_ALIASES", "kind_table", "load_prompt_cache", "save_prompt_cache"]

HEADER_KEY = "mlx_loom.prompt_cache"
FORMAT: Final = "mlx-loom-prompt-cache"
FORMAT_VERSION: Final = 2

#: More layers than any published model has (the deepest have ~120).
MAX_LAYERS = 4096
#: A cache kind's state holds a handful of arrays (a quantized window: six).
MAX_ARRAYS_PER_LAYER = 16
_MAX_META = 16  # meta_state strings per layer
_MAX_META_CHARS = 64
_MAX_KIND_CHARS = 128
_CHECKSUM_PREFIX = "sha256:"
_READ_CHUNK = 1 << 20
# The header is a few levels deep; its size is bounded by the safetensors header's.
_HEADER_JSON = JsonLimits(max_bytes=None)
_REBUILD = "rebuild the prompt cache (save it again from a live PromptCache)"

_MetaString = Annotated[str, StringConstraints(max_length=_MAX_META_CHARS)]

#: Kind names of files written when each layout and codec had a class of its
#: own: ``name -> (layout kind, the layout's own meta_state fields, codec)``.
#: Their ``meta_state`` was the layout's fields then the codec's, so the codec's
#: name goes between the two.
KIND_ALIASES: Mapping[str, tuple[str, int, str]] = MappingProxyType(
    {
        "QuantizedKVCache": ("KVCache", 0, "affine"),
        "QuantizedRotatingKVCache": ("RotatingKVCache", 4, "affine"),
        "BatchQuantizedKVCache": ("BatchKVCache", 1, "affine"),
        "StackedQuantizedRotatingKVCache": ("StackedRotatingKVCache", 3, "affine"),
        "TurboQuantKVCache": ("KVCache", 0, "turboquant"),
        "TurboQuantRotatingKVCache": ("RotatingKVCache", 4, "turboquant"),
        "BatchTurboQuantKVCache": ("BatchKVCache", 1, "turboquant"),
        "StackedTurboQuantRotatingKVCache": ("StackedRotatingKVCache", 3, "turboquant"),
    }
)


def _unalias(kind: str, meta_state: list[str], table: Mapping[str, type]) -> tuple[str, list[str]]:
    """A layer's kind and ``meta_state`` as files name them today (aliases resolved)."""
    alias = KIND_ALIASES.get(kind)
    if alias is None or kind in table:
        return kind, meta_state
    layout, fields, codec = alias
    return layout, [*meta_state[:fields], codec, *meta_state[fields:]]


class _Layer(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    kind: Annotated[str, StringConstraints(min_length=1, max_length=_MAX_KIND_CHARS)]
    meta_state: list[_MetaString] = Field(max_length=_MAX_META)
    n_arrays: int = Field(ge=0, le=MAX_ARRAYS_PER_LAYER)


class _Header(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    format: Literal["mlx-loom-prompt-cache"]
    version: Literal[2]
    layers: list[_Layer] = Field(max_length=MAX_LAYERS)
    metadata: dict[str, str]
    checksum: Annotated[str, StringConstraints(pattern=r"^sha256:[0-9a-f]{64}$")]

    def tensor_names(self) -> list[str]:
        """The tensors this header describes, in checksum order."""
        return [f"{i}.{j}" for i, layer in enumerate(self.layers) for j in range(layer.n_arrays)]


def _canonical(header: _Header) -> bytes:
    body = header.model_dump(exclude={"checksum"})
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _tensor_line(name: str, dtype: str, shape: Sequence[int]) -> bytes:
    return f"\n{name} {dtype} {list(shape)}\n".encode()


def array_checksum(header: _Header, arrays: Mapping[str, mx.array]) -> str:
    """The checksum a file with ``header`` and ``arrays`` carries (``"sha256:<hex>"``).

    The same digest :func:`load_prompt_cache` computes from the file's bytes:
    our header (without the checksum), then per tensor in header order its
    name, safetensors dtype, shape and raw bytes.
    """
    digest = hashlib.sha256(_canonical(header))
    for name in header.tensor_names():
        array = mx.contiguous(arrays[name])
        mx.eval(array)
        shape, code = tensor_signature(array)
        digest.update(_tensor_line(name, code, shape))
        # mx.array has the buffer protocol; its type stub does not declare it.
        digest.update(memoryview(cast(Any, array)))
    return _CHECKSUM_PREFIX + digest.hexdigest()


def kind_table(*classes: type) -> Mapping[str, type]:
    """An immutable ``kind name -> class`` table from cache classes.

    Each class must carry a string ``kind`` and a ``from_state(state,
    meta_state)`` classmethod. The core's kinds are listed where
    ``CACHE_KINDS`` is built; a plugin's join through its registry
    (``loom_cache_kinds`` or ``Family(cache_kinds=...)``).
    """
    table: dict[str, type] = {}
    for cls in classes:
        kind = getattr(cls, "kind", None)
        if not isinstance(kind, str) or not kind or not callable(getattr(cls, "from_state", None)):
            raise CacheError(
                f"cache kind table: {cls!r} has no string 'kind' or no from_state classmethod",
                fix="give the cache class a 'kind' class attribute and a from_state classmethod",
            )
        if kind in table and table[kind] is not cls:
            raise CacheError(
                f"cache kind table: kind {kind!r} is claimed by both {table[kind]!r} and {cls!r}",
                fix="give each cache class a distinct 'kind'",
            )
        table[kind] = cls
    return MappingProxyType(table)


def _default_kinds(kinds: Mapping[str, type] | None) -> Mapping[str, type]:
    if kinds is not None:
        return kinds
    from mlx_loom.cache import CACHE_KINDS  # the package's table; built after this module

    return CACHE_KINDS


def _check_path(path: str | Path, *, what: str) -> Path:
    path = Path(path)
    if path.suffix != ".safetensors":
        raise CacheError(
            f"{what}: prompt cache path {str(path)!r} does not end in .safetensors",
            fix="name the prompt cache file '<name>.safetensors'",
        )
    return path


def save_prompt_cache(
    path: str | Path,
    caches: Sequence[Any],
    metadata: Mapping[str, str] | None = None,
    *,
    kinds: Mapping[str, type] | None = None,
) -> None:
    """Write ``caches`` (one per layer) and string ``metadata`` to ``path``, with a checksum.

    Only registered kinds are written, so every saved file can be loaded.
    """
    path = _check_path(path, what="save_prompt_cache")
    table = _default_kinds(kinds)
    meta = dict(metadata or {})
    bad = {k: v for k, v in meta.items() if not (isinstance(k, str) and isinstance(v, str))}
    if bad:
        raise CacheError(
            f"save_prompt_cache: metadata entries {bad!r} are not str -> str",
            fix="convert metadata keys and values to strings",
        )
    arrays: dict[str, mx.array] = {}
    layers = []
    for i, cache in enumerate(caches):
        cls: Any = type(cache)
        kind = getattr(cls, "kind", None)
        if not isinstance(kind, str) or table.get(kind) is not cls:
            raise CacheError(
                f"save_prompt_cache: layer {i} holds a {type(cache).__name__}, which is not a "
                f"registered cache kind ({', '.join(sorted(table))})",
                fix="register the cache class through the plugin's loom_cache_kinds hook "
                "(or Family(cache_kinds=...))",
            )
        state = tuple(cache.state)
        for j, a in enumerate(state):
            if not isinstance(a, mx.array):
                raise CacheError(
                    f"save_prompt_cache: layer {i} ({kind}) state[{j}] is a "
                    f"{type(a).__name__}, not an mx.array",
                    fix="a cache's state must hold only arrays (strings go in meta_state)",
                )
            arrays[f"{i}.{j}"] = mx.contiguous(a)
        layers.append(_Layer(kind=kind, meta_state=list(cache.meta_state), n_arrays=len(state)))
    try:
        header = _Header(
            format=FORMAT,
            version=FORMAT_VERSION,
            layers=layers,
            metadata=meta,
            checksum=_CHECKSUM_PREFIX + "0" * 64,
        )
    except ValidationError as err:
        raise CacheError(
            f"save_prompt_cache: the caches cannot be described in a prompt-cache file: "
            f"{_first_error(err)}",
            fix=f"save at most {MAX_LAYERS} layers of registered kinds",
        ) from None
    header = header.model_copy(update={"checksum": array_checksum(header, arrays)})
    _write_atomically(path, arrays, {HEADER_KEY: header.model_dump_json()})


def _temp_prefix(path: Path) -> str:
    return f".{path.stem}.tmp-"


# mx.save_safetensors appends ".safetensors" to names without it, so the
# temporary name keeps the suffix.
_TEMP_SUFFIX = ".safetensors"


def _write_atomically(path: Path, arrays: dict[str, mx.array], metadata: dict[str, str]) -> None:
    """Write under a name of this writer's own, then rename into place.

    Each save gets its own temporary name (:mod:`mlx_loom.artifacts.staging`):
    threads saving to one path no longer write one file. Temporaries left
    by a writer that was killed are removed first. A failed write (a full
    disk: MLX raises ``RuntimeError``, Python ``OSError``) is a CacheError
    and leaves the target as it was.
    """
    remove_orphans(path.parent, _temp_prefix(path), _TEMP_SUFFIX)
    tmp = path.with_name(temp_name(_temp_prefix(path), _TEMP_SUFFIX))
    try:
        mx.save_safetensors(str(tmp), arrays, metadata)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise CacheError(
            f"save_prompt_cache: cannot write {str(path)!r}: {reason} "
            f"(the disk may be full; {str(path)!r} was left as it was)",
            fix="choose a writable path with enough free space",
        ) from None
    finally:
        tmp.unlink(missing_ok=True)


def load_prompt_cache(
    path: str | Path, *, kinds: Mapping[str, type] | None = None
) -> tuple[list[Any], dict[str, str]]:
    """Read and verify a file written by :func:`save_prompt_cache`: ``(caches, metadata)``."""
    path = _check_path(path, what="load_prompt_cache")
    table = _default_kinds(kinds)
    where = f"load_prompt_cache: {str(path)!r}"
    if not path.is_file():
        raise CacheError(
            f"{where} does not exist",
            fix="pass the path of a prompt cache saved with save_prompt_cache",
        )
    # Validate the safetensors header ourselves first: a hostile length or
    # offset must fail before MLX allocates anything.
    try:
        file_header = read_safetensors_header(path)
    except SafetensorsHeaderError as err:
        raise CacheError(f"load_prompt_cache: {err.message}", fix=_REBUILD) from None
    header = _read_header(file_header, where)
    names = header.tensor_names()  # bounded: MAX_LAYERS * MAX_ARRAYS_PER_LAYER
    if set(names) != set(file_header.tensors):
        missing = sorted(set(names) - set(file_header.tensors))
        extra = sorted(set(file_header.tensors) - set(names))
        raise CacheError(
            f"{where}: its tensors do not match its header "
            f"(missing {missing[:5]}, unexpected {extra[:5]})",
            fix="the file was altered or truncated; " + _REBUILD,
        )
    _verify_checksum(path, file_header, header, names, where)
    try:
        arrays = cast(dict[str, mx.array], mx.load(str(path), format="safetensors"))
    except (RuntimeError, ValueError, OSError) as err:
        raise CacheError(
            f"{where} is not a readable .safetensors file ({err})",
            fix="the file is truncated or corrupt; " + _REBUILD,
        ) from None
    caches = []
    for i, layer in enumerate(header.layers):
        kind, meta_state = _unalias(layer.kind, layer.meta_state, table)
        cls: Any = table.get(kind)
        if cls is None:
            raise CacheError(
                f"{where}: layer {i} names cache kind {layer.kind!r}, which is not "
                f"registered ({', '.join(sorted(table))})",
                fix="install the package that provides this cache kind, or re-create the cache",
            )
        state = [arrays[f"{i}.{j}"] for j in range(layer.n_arrays)]
        try:
            caches.append(cls.from_state(state, meta_state))
        except CacheError as err:
            raise CacheError(f"{where}: layer {i}: {err.message}", fix=_REBUILD) from None
        except (ValueError, TypeError, IndexError, RuntimeError) as err:
            raise CacheError(
                f"{where}: layer {i} ({layer.kind}) cannot be restored from its state: "
                f"{type(err).__name__}: {err}",
                fix=_REBUILD,
            ) from None
    return caches, dict(header.metadata)


def _first_error(err: ValidationError) -> str:
    item = err.errors()[0]
    loc = ".".join(str(p) for p in item["loc"]) or "<root>"
    return f"{loc}: {item['msg']}"


def _read_header(file_header: SafetensorsHeader, where: str) -> _Header:
    raw = file_header.metadata.get(HEADER_KEY)
    if raw is None:
        raise CacheError(
            f"{where} has no {HEADER_KEY!r} metadata entry, so it is not an mlx-loom prompt cache",
            fix="save prompt caches with mlx_loom.cache.save_prompt_cache",
        )
    fix = "the file was altered or written by another program; " + _REBUILD
    doc = parse_json(
        raw,
        source=f"{where}: the {HEADER_KEY!r} metadata",
        error=CacheError,
        fix=fix,
        limits=_HEADER_JSON,
    )
    if isinstance(doc, dict) and doc.get("format") == FORMAT and doc.get("version") == 1:
        raise CacheError(
            f"{where} is a version 1 prompt cache, written before prompt-cache files "
            "carried a checksum, so its contents cannot be verified",
            fix=_REBUILD,
        )
    try:
        return _Header.model_validate(doc)
    except ValidationError as err:
        raise CacheError(
            f"{where}: the {HEADER_KEY!r} metadata is malformed "
            f"({err.error_count()} problem(s); first: {_first_error(err)})",
            fix=fix,
        ) from None


def _verify_checksum(
    path: Path, file_header: SafetensorsHeader, header: _Header, names: list[str], where: str
) -> None:
    """Hash the body straight from the file (bounded reads) and compare with the header."""
    digest = hashlib.sha256(_canonical(header))
    try:
        with open(path, "rb") as fh:
            for name in names:
                info = file_header.tensors[name]
                begin, end = info.data_offsets  # type: ignore[misc]
                digest.update(_tensor_line(name, info.dtype, info.shape))
                fh.seek(file_header.data_start + begin)
                left = end - begin
                while left:
                    chunk = fh.read(min(left, _READ_CHUNK))
                    if not chunk:
                        raise CacheError(
                            f"{where} ends inside tensor {name!r}",
                            fix="the file is truncated; " + _REBUILD,
                        )
                    digest.update(chunk)
                    left -= len(chunk)
    except OSError as err:
        raise CacheError(f"{where} cannot be read: {err.strerror or err}", fix=_REBUILD) from None
    if _CHECKSUM_PREFIX + digest.hexdigest() != header.checksum:
        raise CacheError(
            f"{where}: its contents do not match the checksum it was saved with; the file "
            "is corrupt (a flipped bit, a partial copy) or was edited",
            fix=_REBUILD,
        )
