"""Content-free fingerprints that say whether two artifacts need the same graph.

A profile pins an artifact by what decides its graph, not by its bytes:
hashing tensor data would read the whole checkpoint, and two re-uploads of the
same weights should still match. So the artifact fingerprint covers the tensor
names, dtypes and shapes (header data only), and the config fingerprint covers
the config fields a family says decide its graph.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from typing import Any

import mlx.core as mx

from mlx_loom.artifacts.safetensors_header import TensorInfo
from mlx_loom.artifacts.weights import list_weight_files, tensor_signature
from mlx_loom.errors import ConfigError

__all__ = ["artifact_fingerprint", "config_fingerprint", "weights_identity"]

_PREFIX = "sha256:"


def _digest(text: str) -> str:
    return _PREFIX + hashlib.sha256(text.encode("utf-8")).hexdigest()


def artifact_fingerprint(manifest: Mapping[str, TensorInfo | mx.array]) -> str:
    """``"sha256:<hex>"`` over the sorted ``(name, dtype, shape)`` of every tensor.

    Independent of sharding, file names, key order and tensor values.
    """
    rows = []
    for name in sorted(manifest):
        shape, dtype = tensor_signature(manifest[name])
        rows.append([name, dtype, list(shape)])
    return _digest(json.dumps(rows, separators=(",", ":"), ensure_ascii=False))


def config_fingerprint(fields: Mapping[str, Any]) -> str:
    """``"sha256:<hex>"`` of the canonical JSON of ``fields`` (sorted keys, no spaces).

    Key order does not matter; tuples hash like lists. Values must be JSON
    data (no NaN): anything else could hash differently across runs.
    """
    try:
        text = json.dumps(
            fields, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        )
    except (TypeError, ValueError) as err:
        bad = [k for k, v in fields.items() if not _is_json(v)]
        raise ConfigError(
            f"cannot fingerprint config field(s) {bad or list(fields)}: {err}",
            fix="pass only JSON values (str, int, float, bool, None, lists, string-keyed dicts)",
        ) from err
    return _digest(text)


def _is_json(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True


def weights_identity(model_dir: str | os.PathLike[str]) -> str:
    """``"sha256:<hex>"`` over the name, size and modification time of each weight file.

    Which weights, not which graph: the artifact fingerprint stays the same
    when a directory's weights are replaced by others of the same shapes, and
    a prompt cache saved with the old ones would continue their state. Taken
    when a model is loaded (a ``stat`` per file, no data read); a copy that
    keeps both the size and the modification time (``cp -p``) is not told apart.
    """
    rows = []
    for path in list_weight_files(model_dir):
        st = path.stat()
        rows.append([os.path.relpath(path, model_dir), st.st_size, st.st_mtime_ns])
    return _digest(json.dumps(rows, separators=(",", ":")))
