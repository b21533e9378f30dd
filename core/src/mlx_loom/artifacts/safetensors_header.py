"""Read and validate a ``.safetensors`` header before MLX ever opens the file.

Why our own reader: ``mx.load`` trusts the header. A hostile or truncated file
can declare a header length of 2**63 bytes, tensors that run past the end of
the file, or ranges that alias each other. We read only the 8-byte length
prefix and a bounded header, check every rule below, and only then hand the
file to MLX. No tensor data is read here.

The format (https://github.com/huggingface/safetensors): an unsigned 64-bit
little-endian header length N, N bytes of UTF-8 JSON, then the data section.
The JSON object maps tensor names to ``{"dtype", "shape", "data_offsets"}``
(offsets relative to the data section) plus an optional ``__metadata__``
string-to-string map.

Rules (each failure is a :class:`SafetensorsHeaderError` naming the file, the
tensor and the rule):

* the file holds at least the 8-byte prefix; ``2 <= N <= min(file_size - 8,
  100 MiB)``;
* the header is UTF-8, a JSON object, without duplicate keys, parsed within
  the nesting and integer-length bounds of :mod:`mlx_loom.bounded_json` (so
  MLX's own parser, which reads the header again, never sees deep JSON);
* every tensor has a dtype MLX can load, a shape of non-negative integers and
  ``data_offsets = [begin, end]`` with ``0 <= begin <= end`` and
  ``end - begin == numel * itemsize``;
* sorted by offset, the tensors tile the data section exactly: no range
  overlaps another, no gap between ranges, no bytes after the last one. This
  is the rule the reference implementation enforces (it sorts the entries by
  offset, so the order of keys in the JSON text is free, and then requires
  each range to start where the previous one ended and the last to end at the
  end of the buffer);
* ``__metadata__``, when present, maps strings to strings (or is ``null``,
  which is what ``mx.save_safetensors`` writes when given no metadata).
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlx_loom.bounded_json import JsonLimits, parse_json
from mlx_loom.errors import SafetensorsHeaderError

__all__ = [
    "MAX_HEADER_BYTES",
    "SAFETENSORS_DTYPES",
    "SafetensorsHeader",
    "TensorInfo",
    "read_safetensors_header",
]

#: Upper bound on the JSON header. Real headers are a few hundred bytes per
#: tensor (a 1,000-tensor shard is ~150 KB); the reference implementation uses
#: the same 100 MB-scale cap. Anything larger is refused before it is read.
MAX_HEADER_BYTES = 100 * 1024 * 1024

#: The header's JSON: bounded in size by :data:`MAX_HEADER_BYTES` (checked
#: before it is read); a header is three levels deep (entry, field, list), so
#: the nesting and integer bounds are the standard ones.
HEADER_JSON = JsonLimits(max_bytes=MAX_HEADER_BYTES)

_FIX = "the file is truncated or corrupt; re-download it (or re-convert the checkpoint)"


@dataclass(frozen=True, slots=True)
class _DType:
    itemsize: int
    mlx: mx.Dtype


#: The safetensors dtype codes MLX 0.32 can load, with their item size and the
#: MLX dtype ``mx.load`` returns. Measured by writing one file per code and
#: loading it: the FP8 codes load as raw ``uint8`` bytes (the family decodes
#: them); ``F64``, ``F8_E5M2`` and ``F4`` raise "unsupported dtype" in
#: ``mx.load``, so we refuse them here with a clearer message.
SAFETENSORS_DTYPES: Mapping[str, _DType] = {
    "BOOL": _DType(1, mx.bool_),
    "U8": _DType(1, mx.uint8),
    "I8": _DType(1, mx.int8),
    "U16": _DType(2, mx.uint16),
    "I16": _DType(2, mx.int16),
    "F16": _DType(2, mx.float16),
    "BF16": _DType(2, mx.bfloat16),
    "U32": _DType(4, mx.uint32),
    "I32": _DType(4, mx.int32),
    "F32": _DType(4, mx.float32),
    "U64": _DType(8, mx.uint64),
    "I64": _DType(8, mx.int64),
    "C64": _DType(8, mx.complex64),
    "F8_E4M3": _DType(1, mx.uint8),
    "F8_E8M0": _DType(1, mx.uint8),
}

# Valid safetensors codes that this MLX cannot load: named separately so the
# message says "MLX cannot load F64" rather than "unknown dtype".
_KNOWN_BUT_UNLOADABLE = {"F64", "F8_E5M2", "F6_E2M3", "F6_E3M2", "F4", "E8M0"}


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """What a header says about one tensor: enough to check geometry and dtype.

    ``dtype`` is the safetensors code (``"BF16"``, ``"U32"`` ...). ``file`` and
    ``data_offsets`` say where it lives; they do not take part in equality, so
    two manifests with the same tensors compare equal however they are sharded.
    """

    dtype: str
    shape: tuple[int, ...]
    file: Path | None = field(default=None, compare=False)
    data_offsets: tuple[int, int] | None = field(default=None, compare=False)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * SAFETENSORS_DTYPES[self.dtype].itemsize

    @property
    def mlx_dtype(self) -> mx.Dtype:
        """The dtype ``mx.load`` gives this tensor."""
        return SAFETENSORS_DTYPES[self.dtype].mlx


@dataclass(frozen=True, slots=True)
class SafetensorsHeader:
    """A validated header: the tensors (in data-offset order) and the metadata."""

    path: Path
    tensors: Mapping[str, TensorInfo]
    metadata: Mapping[str, str]
    data_start: int


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        self.key = key


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _is_uint(value: Any) -> bool:
    # JSON true/false parse as bool, which is an int subclass in Python.
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_safetensors_header(path: str | os.PathLike[str]) -> SafetensorsHeader:
    """Validate ``path``'s header and return its tensor manifest.

    Reads at most ``8 + MAX_HEADER_BYTES`` bytes and never the tensor data.
    Raises :class:`SafetensorsHeaderError` on the first rule a file breaks.
    """
    path = Path(path)

    def fail(what: str, tensor: str | None = None, fix: str = _FIX) -> SafetensorsHeaderError:
        where = f"{path}" if tensor is None else f"{path}: tensor {tensor!r}"
        return SafetensorsHeaderError(f"{where}: {what}", fix=fix)

    try:
        fh = open(path, "rb")
    except OSError as err:
        raise SafetensorsHeaderError(
            f"{path}: cannot open: {err.strerror or err}",
            fix="check the path exists and is readable",
        ) from err
    with fh:
        file_size = os.fstat(fh.fileno()).st_size
        if file_size < 8:
            raise fail(f"file is {file_size} bytes, shorter than the 8-byte header-length prefix")
        (header_len,) = struct.unpack("<Q", fh.read(8))
        if header_len < 2:
            raise fail(f"header length is {header_len}; a JSON object needs at least 2 bytes")
        if header_len > file_size - 8:
            raise fail(
                f"header length {header_len} runs past the end of the file "
                f"({file_size - 8} bytes follow the prefix)"
            )
        if header_len > MAX_HEADER_BYTES:
            raise fail(
                f"header length {header_len} exceeds the {MAX_HEADER_BYTES}-byte limit "
                "on safetensors headers"
            )
        raw = fh.read(header_len)
    if len(raw) != header_len:  # the file shrank under us
        raise fail(f"header is truncated: read {len(raw)} of {header_len} bytes")

    try:
        header = parse_json(
            raw,
            source=f"{path}: header",
            error=SafetensorsHeaderError,
            fix=_FIX,
            limits=HEADER_JSON,
            object_pairs_hook=_no_duplicates,
        )
    except _DuplicateKey as dup:
        raise fail(f"header repeats the key {dup.key!r}; keys must be unique") from None
    if not isinstance(header, dict):
        raise fail(f"header is a JSON {type(header).__name__}, not an object")

    data_len = file_size - 8 - header_len
    metadata: dict[str, str] = {}
    tensors: list[tuple[str, TensorInfo]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            if entry is None:  # mx.save_safetensors writes null when given no metadata
                continue
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise fail("__metadata__ must map strings to strings")
            metadata = dict(entry)
            continue
        tensors.append((name, _check_entry(name, entry, data_len, path, fail)))

    # Tile check: sorted by offset, each range starts where the last ended.
    tensors.sort(key=lambda item: item[1].data_offsets or (0, 0))
    cursor, previous = 0, None
    for name, info in tensors:
        begin, end = info.data_offsets  # type: ignore[misc]
        if begin < cursor:
            raise fail(
                f"data_offsets [{begin}, {end}] overlap tensor {previous!r}, "
                f"which ends at {cursor}",
                name,
            )
        if begin > cursor:
            raise fail(
                f"data_offsets start at {begin}, leaving a gap after byte {cursor} "
                "of the data section",
                name,
            )
        cursor, previous = end, name
    if cursor != data_len:
        raise fail(
            f"tensors cover {cursor} bytes but the data section holds {data_len}; "
            "the header does not describe the whole file"
        )

    return SafetensorsHeader(
        path=path,
        tensors=dict(tensors),
        metadata=metadata,
        data_start=8 + header_len,
    )


def _check_entry(name: str, entry: Any, data_len: int, path: Path, fail: Any) -> TensorInfo:
    if not isinstance(entry, dict):
        raise fail(f"entry is a JSON {type(entry).__name__}, not an object", name)
    for key in ("dtype", "shape", "data_offsets"):
        if key not in entry:
            raise fail(f"entry has no {key!r}", name)

    dtype = entry["dtype"]
    if not isinstance(dtype, str):
        raise fail(f"dtype {dtype!r} is not a string", name)
    if dtype not in SAFETENSORS_DTYPES:
        if dtype in _KNOWN_BUT_UNLOADABLE:
            raise fail(
                f"dtype {dtype} is valid safetensors but MLX cannot load it",
                name,
                fix=f"convert the checkpoint to one of {', '.join(SAFETENSORS_DTYPES)}",
            )
        raise fail(
            f"unknown dtype {dtype!r}; expected one of {', '.join(SAFETENSORS_DTYPES)}", name
        )

    shape = entry["shape"]
    if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
        raise fail(f"shape {shape!r} is not a list of non-negative integers", name)

    offsets = entry["data_offsets"]
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_uint(o) for o in offsets):
        raise fail(f"data_offsets {offsets!r} is not a pair of non-negative integers", name)
    begin, end = offsets
    if end < begin:
        raise fail(f"data_offsets [{begin}, {end}] end before they begin", name)
    if end > data_len:
        raise fail(
            f"data_offsets [{begin}, {end}] run past the end of the data section "
            f"({data_len} bytes)",
            name,
        )
    nbytes = math.prod(shape) * SAFETENSORS_DTYPES[dtype].itemsize
    if end - begin != nbytes:
        raise fail(
            f"data_offsets [{begin}, {end}] span {end - begin} bytes but shape {shape} "
            f"of {dtype} needs {nbytes}",
            name,
        )
    return TensorInfo(dtype=dtype, shape=tuple(shape), file=path, data_offsets=(begin, end))
