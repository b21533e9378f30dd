"""Each rank reads only its slice of a tensor, straight from the safetensors file.

Why not slice the lazy array: ``mx.load`` maps a tensor to one ``Load`` and
evaluating any slice of it reads the *whole* tensor (measured, MLX 0.32.4:
evaluating half the rows of a 128 MiB bf16 tensor read 128 MiB and peaked at
192 MiB). A tensor the family's loader passed through unchanged — the same
``mx.array`` object ``load_weights`` returned, recorded by
:func:`mlx_loom.artifacts.weights.recording_sources` — is instead read here:
a slice along axis ``k`` of a row-major tensor is ``prod(shape[:k])`` runs of
contiguous bytes, read with positioned reads into one buffer. A tensor the
loader transformed (stacked per-expert tensors, a fused projection split in
two, a gain shifted by one — Hugging Face layouts) has no file range of its
own, so its lazy array is sliced instead (that reads the tensor once, whole);
:class:`SliceReader` counts both kinds so a build can report them.

Reading happens when the plan is applied, not when the core evaluates the
model: there is no lazy MLX primitive for "these byte ranges of a file".
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_loom.artifacts import SAFETENSORS_DTYPES, TensorInfo

__all__ = ["Ranges", "SliceReader"]

#: Feature ranges ``[(start, stop), ...]`` along one axis, concatenated in order.
Ranges = Sequence[tuple[int, int]]

_RAW = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


@dataclass
class SliceReader:
    """Slices of the checkpoint's tensors, read from their files where possible.

    ``sources`` is the table :func:`~mlx_loom.artifacts.weights.recording_sources`
    filled while the factory built the model.
    """

    sources: Mapping[int, tuple[mx.array, TensorInfo]]
    #: Bytes read from files for slices.
    bytes_read: int = 0
    #: Tensors that had to be sliced after a whole read (transformed by the loader).
    sliced_whole: list[str] = field(default_factory=list)
    _data_start: dict[Path, int] = field(default_factory=dict)

    def take(self, name: str, array: mx.array, axis: int, ranges: Ranges) -> mx.array:
        """``array`` restricted to ``ranges`` along ``axis`` (concatenated)."""
        axis = axis % array.ndim
        entry = self.sources.get(id(array))
        if entry is not None and entry[0] is array:
            return self._read(entry[1], axis, ranges)
        self.sliced_whole.append(name)
        index = [slice(None)] * array.ndim
        parts = []
        for start, stop in ranges:
            index[axis] = slice(start, stop)
            parts.append(array[tuple(index)])
        out = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=axis)
        return mx.contiguous(out)

    def _start_of_data(self, file: Path) -> int:
        if file not in self._data_start:
            with open(file, "rb") as fh:
                (header_len,) = struct.unpack("<Q", fh.read(8))
            self._data_start[file] = 8 + header_len
        return self._data_start[file]

    def _read(self, info: TensorInfo, axis: int, ranges: Ranges) -> mx.array:
        assert info.file is not None and info.data_offsets is not None
        dtype = SAFETENSORS_DTYPES[info.dtype]
        shape = info.shape
        outer = math.prod(shape[:axis])
        inner = math.prod(shape[axis + 1 :]) * dtype.itemsize  # bytes per index on the axis
        width = sum(stop - start for start, stop in ranges)
        out_shape = (*shape[:axis], width, *shape[axis + 1 :])
        buffer = bytearray(outer * width * inner)
        view = memoryview(buffer)
        base = self._start_of_data(info.file) + info.data_offsets[0]
        cursor = 0
        fd = os.open(info.file, os.O_RDONLY)
        try:
            for o in range(outer):
                row = base + o * shape[axis] * inner
                for start, stop in ranges:
                    n = (stop - start) * inner
                    _read_exactly(fd, view[cursor : cursor + n], row + start * inner, info.file)
                    cursor += n
        finally:
            os.close(fd)
        self.bytes_read += len(buffer)
        raw = np.frombuffer(buffer, dtype=_RAW[dtype.itemsize]).reshape(out_shape)
        return mx.array(raw).view(dtype.mlx)


def _read_exactly(fd: int, target: memoryview, offset: int, file: Path) -> None:
    done = 0
    while done < len(target):
        n = os.preadv(fd, [target[done:]], offset + done)
        if n <= 0:
            raise OSError(f"{file}: unexpected end of file at byte {offset + done}")
        done += n
