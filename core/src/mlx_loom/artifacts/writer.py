"""Writing a checkpoint's weights: sharded safetensors and their index, tensor by tensor.

``mx.save_safetensors`` takes a whole dict and evaluates it at once, so a
writer built on it holds a shard's worth of results (mlx-lm's shards are
5 GB) on top of whatever the sources cost. This writer instead lays out each
shard's header from the *lazy* arrays' shapes and dtypes (known without
evaluating anything), then evaluates, writes and drops one tensor at a time:
peak memory is about the largest single tensor plus what its computation
reads, whatever the model's size.

Shards follow mlx-lm's rule (a new shard when the next tensor would pass the
limit; a tensor larger than the limit gets a shard of its own) and names
(``model.safetensors`` alone, else ``model-00001-of-0000N.safetensors``),
with ``model.safetensors.index.json`` listing every tensor. Each header
carries ``{"format": "mlx"}`` metadata, as MLX's own writer does, and every
shard is read back through the core's header validator once written.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, MutableMapping
from pathlib import Path

import mlx.core as mx

from mlx_loom.artifacts.safetensors_header import SAFETENSORS_DTYPES, read_safetensors_header
from mlx_loom.artifacts.weights import INDEX_FILE
from mlx_loom.errors import WeightsError

__all__ = ["MAX_SHARD_BYTES", "plan_shards", "safetensors_code", "write_weights"]

#: mlx-lm's shard limit (``MAX_FILE_SIZE_GB = 5``).
MAX_SHARD_BYTES = 5 << 30

_CODES: dict[mx.Dtype, str] = {}
for _code, _info in SAFETENSORS_DTYPES.items():
    _CODES.setdefault(_info.mlx, _code)  # uint8 is "U8", never an FP8 code


def safetensors_code(dtype: mx.Dtype) -> str:
    """The safetensors dtype code an MLX dtype is written as."""
    code = _CODES.get(dtype)
    if code is None:
        raise WeightsError(
            f"cannot write a tensor of dtype {dtype} to safetensors",
            fix="cast it to a float or integer dtype first",
        )
    return code


def _nbytes(array: mx.array) -> int:
    return math.prod(array.shape) * array.dtype.size


def plan_shards(tensors: MutableMapping[str, mx.array], max_bytes: int) -> list[list[str]]:
    """Tensor names per shard, in the mapping's order, by mlx-lm's rule."""
    shards: list[list[str]] = []
    size = 0
    for name, array in tensors.items():
        n = _nbytes(array)
        if not shards or size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def _header(names: list[str], tensors: MutableMapping[str, mx.array]) -> bytes:
    entries: dict[str, object] = {"__metadata__": {"format": "mlx"}}
    offset = 0
    for name in names:
        array = tensors[name]
        end = offset + _nbytes(array)
        entries[name] = {
            "dtype": safetensors_code(array.dtype),
            "shape": list(array.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    text = json.dumps(entries, separators=(",", ":")).encode("utf-8")
    return text + b" " * (-len(text) % 8)  # the data section starts 8-byte aligned


def _write_shard(
    path: Path,
    names: list[str],
    tensors: MutableMapping[str, mx.array],
    on_tensor: Callable[[str, int], None],
) -> None:
    header = _header(names, tensors)
    with open(path, "wb") as out:
        out.write(len(header).to_bytes(8, "little"))
        out.write(header)
        for name in names:
            array = mx.contiguous(tensors.pop(name))  # drop our reference as it is written
            mx.eval(array)
            out.write(memoryview(array))  # type: ignore[arg-type]  # mx.array exports the buffer protocol
            n = _nbytes(array)
            del array
            on_tensor(name, n)
    read_safetensors_header(path)


def write_weights(
    out_dir: str | os.PathLike[str],
    tensors: MutableMapping[str, mx.array],
    *,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    on_tensor: Callable[[str, int], None] | None = None,
    extra_metadata: dict[str, object] | None = None,
) -> dict[str, object]:
    """Write ``tensors`` (lazy arrays, consumed: the mapping is empty afterwards) as shards.

    ``on_tensor(name, nbytes)`` is called after each tensor is on disk (a
    progress bar). Returns the index that was written.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    total = sum(_nbytes(a) for a in tensors.values())
    shards = plan_shards(tensors, max_shard_bytes)
    pattern = "model-{:05d}-of-{:05d}.safetensors" if len(shards) > 1 else "model.safetensors"
    weight_map: dict[str, str] = {}
    for i, names in enumerate(shards, start=1):
        file = pattern.format(i, len(shards))
        _write_shard(out_dir / file, names, tensors, on_tensor or (lambda *_: None))
        weight_map.update(dict.fromkeys(names, file))
    index = {
        "metadata": {"total_size": total, **(extra_metadata or {})},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=4) + "\n")
    return index
