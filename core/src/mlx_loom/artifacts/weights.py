"""Which shards hold the weights, what they declare, and whether that is what a graph needs.

Everything here except :func:`load_weights` reads headers only, so ``loom
explain`` and the registry can reason about a 70B checkpoint without touching
its data. :func:`load_weights` validates every header first and only then asks
``mx.load`` for the (lazy) arrays.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any, cast

import mlx.core as mx

from mlx_loom.artifacts.safetensors_header import (
    SAFETENSORS_DTYPES,
    TensorInfo,
    read_safetensors_header,
)
from mlx_loom.bounded_json import read_json_file
from mlx_loom.errors import WeightsError

__all__ = [
    "FLOAT_CODES",
    "INDEX_FILE",
    "ExpectedTensor",
    "check_weights",
    "list_weight_files",
    "load_weights",
    "mismatch_error",
    "read_manifest",
    "recording_sources",
    "tensor_signature",
    "weight_mismatches",
]

INDEX_FILE = "model.safetensors.index.json"
_SHOW = 10  # names listed per category in one error; the rest are counted

#: What a graph expects of one tensor: its shape and dtype. The dtype may be a
#: safetensors code (``"BF16"``), a set of codes (any of them, e.g.
#: :data:`FLOAT_CODES`), an ``mx.Dtype``, or ``None`` for "any".
ExpectedTensor = tuple[Sequence[int], "str | frozenset[str] | mx.Dtype | None"]

#: The floating dtypes a checkpoint may store its float tensors in.
FLOAT_CODES: frozenset[str] = frozenset({"BF16", "F16", "F32"})

_MLX_TO_CODE: dict[mx.Dtype, str] = {}
for _code, _dt in SAFETENSORS_DTYPES.items():
    _MLX_TO_CODE.setdefault(_dt.mlx, _code)  # uint8 -> "U8", not an FP8 code


def _capped(items: list[str]) -> str:
    shown = ", ".join(items[:_SHOW])
    return shown + (f", ... ({len(items) - _SHOW} more)" if len(items) > _SHOW else "")


def _read_index(model_dir: Path) -> dict[str, str] | None:
    index_path = model_dir / INDEX_FILE
    try:
        index = read_json_file(
            index_path, error=WeightsError, fix="re-download the checkpoint's index file"
        )
    except FileNotFoundError:  # an unsharded checkpoint has no index
        return None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise WeightsError(
            f"{index_path}: weight_map is missing or does not map tensor names to file names",
            fix="re-download the checkpoint's index file",
        )
    for name, shard in weight_map.items():
        # An index is data, not a path we follow anywhere: shards live beside it.
        if Path(shard).name != shard or shard in ("", ".", ".."):
            raise WeightsError(
                f"{index_path}: tensor {name!r} is assigned to {shard!r}, "
                "which is not a plain file name in the model directory",
                fix="re-download the checkpoint's index file",
            )
    return weight_map


def list_weight_files(model_dir: str | os.PathLike[str]) -> list[Path]:
    """The safetensors shards of ``model_dir``, sorted by name.

    With ``model.safetensors.index.json`` present, exactly the shards it names
    (each must exist); otherwise every ``*.safetensors`` file in the directory.
    """
    model_dir = Path(model_dir)
    weight_map = _read_index(model_dir)
    if weight_map is not None:
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (model_dir / s).is_file()]
        if missing:
            raise WeightsError(
                f"{model_dir / INDEX_FILE} names shard(s) that do not exist: {_capped(missing)}",
                fix="the download is incomplete; re-download the checkpoint",
            )
        if not shards:
            raise WeightsError(
                f"{model_dir / INDEX_FILE} lists no tensors", fix="re-download the checkpoint"
            )
        return [model_dir / s for s in shards]
    files = sorted(p for p in model_dir.glob("*.safetensors") if p.is_file())
    if not files:
        raise WeightsError(
            f"{model_dir} contains no *.safetensors weight files",
            fix="download the checkpoint's safetensors files, or convert it to safetensors",
        )
    return files


def read_manifest(model_dir: str | os.PathLike[str]) -> dict[str, TensorInfo]:
    """Every tensor the checkpoint declares, from validated headers only.

    Raises :class:`WeightsError` when a name appears in two shards, or the
    shards and the index disagree about where a tensor lives.
    """
    model_dir = Path(model_dir)
    weight_map = _read_index(model_dir)
    manifest: dict[str, TensorInfo] = {}
    problems: list[str] = []
    for file in list_weight_files(model_dir):
        header = read_safetensors_header(file)
        for name, info in header.tensors.items():
            if name in manifest:
                raise WeightsError(
                    f"tensor {name!r} is stored twice: in {manifest[name].file} and in {file}",
                    fix="remove the stray or duplicate .safetensors file from the model directory",
                )
            manifest[name] = info
            if weight_map is not None:
                assigned = weight_map.get(name)
                if assigned is None:
                    problems.append(f"{name!r} is in {file.name} but not in the index")
                elif assigned != file.name:
                    problems.append(
                        f"{name!r} is in {file.name} but the index assigns it to {assigned}"
                    )
    if weight_map is not None:
        for name, shard in weight_map.items():
            if name not in manifest:
                problems.append(f"{name!r} is assigned to {shard} but that shard lacks it")
    if problems:
        raise WeightsError(
            f"{model_dir / INDEX_FILE} disagrees with the shards ({len(problems)} tensor(s)): "
            + _capped(problems),
            fix="the index or a shard is stale; re-download the checkpoint",
        )
    return manifest


#: Where the lazy arrays :func:`load_weights` returned live, while a build records
#: them: ``id(array) -> (array, its header entry)``. Scoped to one
#: :func:`recording_sources` block (a context variable, so one thread's build
#: never sees another's).
_SOURCES: ContextVar[dict[int, tuple[mx.array, TensorInfo]] | None] = ContextVar(
    "mlx_loom_weight_sources", default=None
)


@contextmanager
def recording_sources() -> Iterator[dict[int, tuple[mx.array, TensorInfo]]]:
    """Within the block, :func:`load_weights` notes the file and offsets of each array it returns.

    Why: ``mx.load`` reads a whole tensor when any slice of it is evaluated.
    A distributed build that needs one rank's slice of a tensor the family's
    loader passed through unchanged can read just those bytes from the file
    instead (:mod:`mlx_loom.parallel.reading`); the table says which arrays
    those are (the same object, not a transformed copy) and where they live.
    """
    table: dict[int, tuple[mx.array, TensorInfo]] = {}
    token = _SOURCES.set(table)
    try:
        yield table
    finally:
        _SOURCES.reset(token)


def load_weights(model_dir: str | os.PathLike[str]) -> dict[str, mx.array]:
    """Every tensor as a lazy ``mx.array``, after every header has been validated.

    ``mx.load`` maps the file lazily: no tensor data is read until an array is
    evaluated, so loading then dropping unused tensors costs nothing. Inside
    :func:`recording_sources` each array's header entry is recorded.
    """
    manifest = read_manifest(model_dir)
    weights: dict[str, mx.array] = {}
    for file in sorted({info.file for info in manifest.values()}):  # type: ignore[type-var]
        # Without return_metadata, mx.load of a safetensors file is a dict of arrays.
        weights.update(cast(dict[str, mx.array], mx.load(str(file), format="safetensors")))
    if weights.keys() != manifest.keys():  # mx.load must agree with our reader
        raise WeightsError(
            f"{model_dir}: mx.load returned different tensors than the headers declare",
            fix="re-download the checkpoint",
        )
    table = _SOURCES.get()
    if table is not None:
        table.update({id(array): (array, manifest[name]) for name, array in weights.items()})
    return weights


def tensor_signature(x: TensorInfo | mx.array) -> tuple[tuple[int, ...], str]:
    """``(shape, safetensors dtype code)`` of a manifest entry or an array."""
    if isinstance(x, TensorInfo):
        return x.shape, x.dtype
    return tuple(x.shape), _MLX_TO_CODE.get(x.dtype, str(x.dtype))


def _dtype_matches(actual: TensorInfo | mx.array, want: Any) -> bool:
    if want is None:
        return True
    if isinstance(want, str):
        return tensor_signature(actual)[1] == want
    if isinstance(want, frozenset):
        return tensor_signature(actual)[1] in want
    # An mx.Dtype: compare what MLX will hold (FP8 codes load as uint8).
    have = actual.mlx_dtype if isinstance(actual, TensorInfo) else actual.dtype
    return have == want


def _dtype_name(dtype: Any) -> str:
    if isinstance(dtype, frozenset):
        return " or ".join(sorted(dtype))
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("mlx.core.")


def check_weights(
    actual: Mapping[str, TensorInfo | mx.array],
    expected: Mapping[str, ExpectedTensor],
    *,
    strict: bool = True,
    source: str | os.PathLike[str] | None = None,
) -> None:
    """Compare what a checkpoint holds with what a graph needs; report every difference at once.

    ``actual`` is a manifest (:func:`read_manifest`) or loaded arrays.
    ``strict`` (the default) also refuses tensors the graph does not use: a
    stray tensor usually means a wrong mapping, and silently ignoring it hides
    that. Raises one :class:`WeightsError` listing missing, unexpected,
    mis-shaped and mis-typed tensors.
    """
    sections = weight_mismatches(actual, expected, strict=strict)
    if not sections:
        return
    raise mismatch_error(sections, source=source)


def weight_mismatches(
    actual: Mapping[str, TensorInfo | mx.array],
    expected: Mapping[str, ExpectedTensor],
    *,
    strict: bool = True,
) -> list[tuple[str, list[str]]]:
    """The differences :func:`check_weights` reports, as ``(label, items)`` sections."""
    missing = sorted(set(expected) - set(actual))
    unexpected = sorted(set(actual) - set(expected)) if strict else []
    misshaped: list[str] = []
    mistyped: list[str] = []
    for name in sorted(set(expected) & set(actual)):
        want_shape, want_dtype = expected[name]
        have_shape, have_code = tensor_signature(actual[name])
        if tuple(want_shape) != have_shape:
            misshaped.append(f"{name} {have_shape} (expected {tuple(want_shape)})")
        if not _dtype_matches(actual[name], want_dtype):
            mistyped.append(f"{name} {have_code} (expected {_dtype_name(want_dtype)})")
    sections = [
        ("missing", [*missing]),
        ("unexpected", unexpected),
        ("wrong shape", misshaped),
        ("wrong dtype", mistyped),
    ]
    return [(label, items) for label, items in sections if items]


def mismatch_error(
    sections: Sequence[tuple[str, list[str]]], *, source: str | os.PathLike[str] | None = None
) -> WeightsError:
    """One :class:`WeightsError` listing every section (at most ten names each)."""
    where = f"{source}: " if source is not None else ""
    summary = ", ".join(f"{len(items)} {label}" for label, items in sections)
    body = "\n  ".join(f"{label} ({len(items)}): {_capped(items)}" for label, items in sections)
    return WeightsError(
        f"{where}the checkpoint's tensors do not match the model ({summary}):\n  {body}",
        fix="use a checkpoint converted for this model type and config; if config.json was "
        "edited, restore it (the tensor shapes follow from it)",
    )
