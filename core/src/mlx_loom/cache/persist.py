"""Saving and loading prompt caches as ``.safetensors`` files.

The arrays of each layer's cache ``state`` are stored as tensors named
``"<layer>.<i>"``; everything else (the cache kind, its ``meta_state``
strings, the array count, the caller's metadata) is one JSON document in the
file's metadata, validated with a pydantic model on load.

Unlike mlx-lm, which turns a class name from the file into code through
``globals()``, a file may only name a cache kind from a fixed table of
registered kinds (:data:`mlx_loom.cache.CACHE_KINDS`, or the table the
caller passes — :class:`mlx_loom.PromptCache` passes its model's registry
table, which adds the kinds plugins registered); any other name is a
:class:`~mlx_loom.errors.CacheError`. A hostile file therefore cannot choose
what code runs on load.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

import mlx.core as mx
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mlx_loom.errors import CacheError

__all__ = ["kind_table", "load_prompt_cache", "save_prompt_cache"]

HEADER_KEY = "mlx_loom.prompt_cache"
FORMAT_VERSION = 1


class _Layer(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    kind: str
    meta_state: list[str]
    n_arrays: int = Field(ge=0)


class _Header(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    format: Literal["mlx-loom-prompt-cache"]
    version: Literal[1]
    layers: list[_Layer]
    metadata: dict[str, str]


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
    """Write ``caches`` (one per layer) and string ``metadata`` to ``path``.

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
        kind = getattr(type(cache), "kind", None)
        if kind not in table or table[kind] is not type(cache):
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
            arrays[f"{i}.{j}"] = a
        layers.append(_Layer(kind=kind, meta_state=list(cache.meta_state), n_arrays=len(state)))
    header = _Header(
        format="mlx-loom-prompt-cache", version=FORMAT_VERSION, layers=layers, metadata=meta
    )
    mx.save_safetensors(str(path), arrays, {HEADER_KEY: header.model_dump_json()})


def load_prompt_cache(
    path: str | Path, *, kinds: Mapping[str, type] | None = None
) -> tuple[list[Any], dict[str, str]]:
    """Read a file written by :func:`save_prompt_cache`: ``(caches, metadata)``."""
    path = _check_path(path, what="load_prompt_cache")
    table = _default_kinds(kinds)
    if not path.is_file():
        raise CacheError(
            f"load_prompt_cache: {str(path)!r} does not exist",
            fix="pass the path of a prompt cache saved with save_prompt_cache",
        )
    # Validate the header ourselves first: a hostile length or offset must fail
    # before MLX allocates anything.
    from mlx_loom.artifacts.safetensors_header import read_safetensors_header
    from mlx_loom.errors import SafetensorsHeaderError

    try:
        read_safetensors_header(path)
    except SafetensorsHeaderError as err:
        raise CacheError(
            f"load_prompt_cache: {err.message}", fix="re-save the prompt cache"
        ) from None
    try:
        arrays, file_meta = mx.load(str(path), return_metadata=True)
    except (RuntimeError, ValueError, OSError) as err:
        raise CacheError(
            f"load_prompt_cache: {str(path)!r} is not a readable .safetensors file ({err})",
            fix="re-save the prompt cache; the file is truncated or corrupt",
        ) from None
    raw = file_meta.get(HEADER_KEY)
    if raw is None:
        raise CacheError(
            f"load_prompt_cache: {str(path)!r} has no {HEADER_KEY!r} metadata entry, so it "
            "is not an mlx-loom prompt cache",
            fix="save prompt caches with mlx_loom.cache.save_prompt_cache",
        )
    try:
        header = _Header.model_validate(json.loads(raw))
    except (json.JSONDecodeError, ValidationError) as err:
        raise CacheError(
            f"load_prompt_cache: the {HEADER_KEY!r} metadata of {str(path)!r} is malformed: {err}",
            fix="re-save the prompt cache with this version of mlx-loom",
        ) from None
    expected = {f"{i}.{j}" for i, layer in enumerate(header.layers) for j in range(layer.n_arrays)}
    if set(arrays) != expected:
        missing = sorted(expected - set(arrays))
        extra = sorted(set(arrays) - expected)
        raise CacheError(
            f"load_prompt_cache: tensors of {str(path)!r} do not match its header "
            f"(missing {missing[:5]}, unexpected {extra[:5]})",
            fix="re-save the prompt cache; the file was altered or truncated",
        )
    caches = []
    for i, layer in enumerate(header.layers):
        cls = table.get(layer.kind)
        if cls is None:
            raise CacheError(
                f"load_prompt_cache: layer {i} of {str(path)!r} names cache kind "
                f"{layer.kind!r}, which is not registered ({', '.join(sorted(table))})",
                fix="install the package that provides this cache kind, or re-create the cache",
            )
        state = [arrays[f"{i}.{j}"] for j in range(layer.n_arrays)]
        caches.append(cls.from_state(state, layer.meta_state))
    return caches, dict(header.metadata)
