"""The checkpoint's recommended sampling settings, from ``generation_config.json``.

Model authors publish the settings a model is meant to be sampled with
(Qwen3: ``temperature`` 0.6, ``top_p`` 0.95, ``top_k`` 20). The file is
advisory and often hand-edited, so it is read leniently where strictness
would only stop a model from loading: the JSON itself is bounded like every
artifact file (a file past the bounds is an error at load, as the
tokenizer's own read of it already is), but a field of the wrong type is
dropped with a warning naming it, and the engine's
:class:`~mlx_loom.engine.params.SamplingParams` checks the ranges of the
rest before anything uses them (``mlx_loom.engine.defaults``).

``do_sample: false`` is transformers' "decode greedily whatever the
temperature says": then only ``repetition_penalty`` is taken.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any

from mlx_loom.bounded_json import read_json_file
from mlx_loom.errors import ConfigError

log = logging.getLogger("mlx_loom.artifacts")

GENERATION_CONFIG_FILE = "generation_config.json"

#: The fields taken from the file, with the type each must have.
SAMPLING_FIELDS: dict[str, type] = {
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "min_p": float,
    "repetition_penalty": float,
}

#: Fields kept even under ``do_sample: false`` (they shape the logits, not the draw).
_GREEDY_FIELDS = ("repetition_penalty",)


def _typed(name: str, value: Any) -> float | int | None:
    """``value`` as the field's type, or ``None`` when it is not one (booleans never are)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if SAMPLING_FIELDS[name] is int:
        if isinstance(value, float) and not value.is_integer():
            return None
        return int(value)
    return float(value) if math.isfinite(value) else None


def read_sampling_defaults(model_dir: str | os.PathLike[str]) -> dict[str, float | int]:
    """The sampling fields ``generation_config.json`` in ``model_dir`` sets ({} without one).

    Types are checked here (a wrong one is dropped with a warning); ranges
    are the engine's to check.
    """
    path = Path(model_dir) / GENERATION_CONFIG_FILE
    if not path.is_file():
        return {}
    fix = f"restore {GENERATION_CONFIG_FILE} from the original model files"
    data = read_json_file(path, error=ConfigError, fix=fix)
    if not isinstance(data, dict):
        kind = type(data).__name__
        log.warning("%s holds a %s, not an object: its sampling settings are ignored", path, kind)
        return {}
    names = tuple(SAMPLING_FIELDS)
    if data.get("do_sample") is False:
        names = _GREEDY_FIELDS
    out: dict[str, float | int] = {}
    for name in names:
        if name not in data or data[name] is None:
            continue
        value = _typed(name, data[name])
        if value is None:
            shown = repr(data[name])[:80]
            kind = SAMPLING_FIELDS[name].__name__
            log.warning("%s: %s=%s is not a finite %s; ignored", path, name, shown, kind)
            continue
        out[name] = value
    return out
