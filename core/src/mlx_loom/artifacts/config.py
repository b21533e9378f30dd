"""``config.json``: read it once, check the fields the core relies on, hand the rest on.

The core needs only a handful of fields — the model type that selects a
plugin, the EOS ids, whether embeddings are tied, the quantization. Everything
else belongs to the family, which validates it with its own pydantic schema
through :func:`validate_family_config`, so every family reports a bad field the
same way: dotted path, value found, fix.

Wrapper layouts (Gemma 4, most vision-language checkpoints) nest the language
model's fields under ``text_config``; :meth:`ArtifactConfig.text_config`
returns the flat text dict for both layouts so a family's graph code never
needs to know which one it was given.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
)

from mlx_loom.artifacts.quantization import QuantizationConfig, parse_quantization
from mlx_loom.bounded_json import CONFIG_JSON, read_json_file
from mlx_loom.errors import ConfigError

__all__ = ["CONFIG_FILE", "ArtifactConfig", "read_config", "validate_family_config"]

CONFIG_FILE = "config.json"
_MAX_ERRORS = 20
_M = TypeVar("_M", bound=BaseModel)


class ArtifactConfig(BaseModel):
    """The parts of ``config.json`` the core reads, plus the raw dict for the family."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    path: Path
    raw: dict[str, Any]
    model_type: str
    text_model_type: str
    architectures: tuple[str, ...] = ()
    eos_token_id: int | list[int] | None = None
    tie_word_embeddings: bool | None = None
    quantization: QuantizationConfig | None = None

    @property
    def is_nested(self) -> bool:
        """True for wrapper layouts whose language-model fields live under ``text_config``."""
        return isinstance(self.raw.get("text_config"), dict)

    def text_config(self) -> dict[str, Any]:
        """The language model's fields as one flat dict (a copy; safe to mutate)."""
        if self.is_nested:
            return copy.deepcopy(self.raw["text_config"])
        return copy.deepcopy(self.raw)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """``eos_token_id`` as a tuple, whichever form the config used."""
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)


class _CoreFields(BaseModel):
    """Strict types for the fields the core reads (JSON gives no reason to coerce)."""

    model_type: StrictStr | None = None
    architectures: list[StrictStr] | None = None
    eos_token_id: StrictInt | list[StrictInt] | None = None
    tie_word_embeddings: StrictBool | None = None
    text_config: dict[str, Any] | None = None


def read_config(model_dir: str | os.PathLike[str]) -> ArtifactConfig:
    """Read and check ``model_dir/config.json``.

    Raises :class:`ConfigError` naming the file and, for a malformed file, the
    line and column; for a bad field, the field. The JSON is parsed within
    :data:`~mlx_loom.bounded_json.CONFIG_JSON` (size, nesting, integer length).
    """
    path = Path(model_dir) / CONFIG_FILE
    try:
        raw = read_json_file(
            path,
            error=ConfigError,
            fix=f"repair {CONFIG_FILE} (or re-download the checkpoint)",
            limits=CONFIG_JSON,
        )
    except FileNotFoundError:
        raise ConfigError(
            f"{path} does not exist",
            fix=f"point at a model directory that contains {CONFIG_FILE}",
        ) from None
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{path}: the top level is a JSON {type(raw).__name__}, not an object",
            fix=f"{CONFIG_FILE} must be a JSON object; re-download the checkpoint",
        )

    top = validate_family_config(_CoreFields, raw, source=path)
    text = None
    if top.text_config is not None:
        text = validate_family_config(
            _CoreFields, top.text_config, source=path, prefix="text_config"
        )

    model_type = top.model_type or (text.model_type if text else None)
    if model_type is None:
        raise ConfigError(
            f"{path}: model_type is missing"
            + (" (also from text_config)" if text is not None else ""),
            fix=f'add "model_type" to {CONFIG_FILE}; it names the model family',
        )
    text_model_type = (text.model_type if text else None) or model_type

    def pick(field: str) -> Any:
        value = getattr(top, field)
        if value is None and text is not None:
            value = getattr(text, field)
        return value

    eos = pick("eos_token_id")
    architectures = top.architectures or (text.architectures if text else None) or []
    return ArtifactConfig(
        path=path,
        raw=raw,
        model_type=model_type,
        text_model_type=text_model_type,
        architectures=tuple(architectures),
        eos_token_id=eos,
        tie_word_embeddings=pick("tie_word_embeddings"),
        quantization=parse_quantization(raw, source=path),
    )


def _known_keys(model: type[BaseModel]) -> set[str]:
    keys: set[str] = set()
    for name, info in model.model_fields.items():
        keys.add(name)
        for alias in (info.alias, info.validation_alias):
            if isinstance(alias, str):
                keys.add(alias)
            elif isinstance(alias, AliasChoices):
                keys.update(c for c in alias.choices if isinstance(c, str))
    return keys


def _data_path(loc: tuple[Any, ...], data: Any) -> list[str]:
    """Turn a pydantic error location into the path inside the input data.

    Union members and validator wrappers add location parts that are not keys
    in the input (``eos_token_id.int``); walking the data drops them.
    """
    parts: list[str] = []
    node = data
    for i, part in enumerate(loc):
        if isinstance(node, Mapping) and part in node:
            node = node[part]
            parts.append(str(part))
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
            parts.append(str(part))
        elif isinstance(node, Mapping) and i == len(loc) - 1 and isinstance(part, str):
            parts.append(part)  # a missing key
            node = None
        # else: a union tag or wrapper name; skip it
    return parts


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def validate_family_config(
    model: type[_M],
    data: Mapping[str, Any],
    *,
    source: Path,
    prefix: str | None = None,
) -> _M:
    """Validate ``data`` against a family's pydantic schema; bad fields become one ConfigError.

    Unknown keys are ignored even if the schema forbids extras: checkpoints
    carry many fields a family does not read. ``prefix`` names where ``data``
    sits in the file (``"text_config"``) so the reported paths are complete.
    """
    payload: Mapping[str, Any] = data
    if model.model_config.get("extra") == "forbid":
        known = _known_keys(model)
        payload = {k: v for k, v in data.items() if k in known}
    try:
        return model.model_validate(payload)
    except ValidationError as err:
        grouped: dict[str, list[str]] = {}
        values: dict[str, Any] = {}
        for item in err.errors():
            parts = _data_path(tuple(item["loc"]), payload)
            dotted = ".".join(([prefix] if prefix else []) + parts) or (prefix or "<root>")
            grouped.setdefault(dotted, [])
            if item["msg"] not in grouped[dotted]:
                grouped[dotted].append(item["msg"])
            values[dotted] = item.get("input") if item["type"] != "missing" else _MISSING
        lines = []
        for dotted, msgs in list(grouped.items())[:_MAX_ERRORS]:
            found = "missing" if values[dotted] is _MISSING else f"found {_short(values[dotted])}"
            lines.append(f"{dotted}: {found}; {' or '.join(msgs)}")
        more = len(grouped) - _MAX_ERRORS
        if more > 0:
            lines.append(f"... and {more} more")
        raise ConfigError(
            f"{source}: {len(grouped)} invalid field(s) for {model.__name__}:\n  "
            + "\n  ".join(lines),
            fix=f"correct the field(s) above in {source} (or re-download the checkpoint)",
        ) from None


_MISSING = object()
