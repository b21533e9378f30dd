"""``config.json``: read it once, check the fields the core relies on, hand the rest on.

The core needs only a handful of fields — the model type that selects a
plugin, the EOS ids, whether embeddings are tied, the quantization. Everything
else belongs to the family, which validates it with its own pydantic schema
through :func:`validate_family_config`, so every family reports a bad field the
same way: dotted path, value found, fix.

Wrapper layouts (Gemma 4, Qwen3.5, most vision-language checkpoints) nest the
language model's fields under ``text_config`` and its tensors under a prefix
(``model.language_model.``). Both are handled here, once: a family's schema
is validated against :meth:`ArtifactConfig.text_config` (the flat text fields,
whichever layout), and :meth:`ArtifactConfig.view` gives the
:class:`ConfigView` the strict loader uses to map wrapper tensor names and
quantization overrides to the text model's own names. A family's code never
learns which layout it was given.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
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

from mlx_loom.artifacts.fields import FieldError
from mlx_loom.artifacts.quantization import QuantizationConfig, parse_quantization
from mlx_loom.bounded_json import CONFIG_JSON, read_json_file
from mlx_loom.errors import ConfigError

__all__ = [
    "CONFIG_FILE",
    "TEXT_LAYOUT",
    "ArtifactConfig",
    "ConfigView",
    "TextLayout",
    "read_config",
    "validate_family_config",
]

CONFIG_FILE = "config.json"
_MAX_ERRORS = 20
_M = TypeVar("_M", bound=BaseModel)
_T = TypeVar("_T")
logger = logging.getLogger("mlx_loom.artifacts")


@dataclass(frozen=True)
class TextLayout:
    """Where a wrapper checkpoint keeps its language model's tensors.

    ``prefixes`` map a wrapper tensor-name prefix to the text model's own
    (tried in order, first match wins). ``towers`` name the other encoders a
    multimodal checkpoint carries (vision, audio, projectors), with or without
    a leading ``model.``; their tensors are dropped, with one log line saying
    how many. Every other name is kept as it is, so the strict check names
    anything unexpected. The default, :data:`TEXT_LAYOUT`, covers the Hugging
    Face layout (``model.language_model.*``) and mlx-lm's converted one
    (``language_model.model.*``, ``language_model.lm_head.*``).
    """

    prefixes: tuple[tuple[str, str], ...] = (
        ("model.language_model.", "model."),
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
    )
    towers: tuple[str, ...] = (
        "visual.",
        "vision_tower.",
        "vision_model.",
        "multi_modal_projector.",
        "audio_tower.",
        "embed_audio.",
        "embed_vision.",
        "vision_embedder.",
    )

    def tower_of(self, name: str) -> str | None:
        """The other tower a wrapper tensor belongs to (``"vision_tower"``), if any."""
        short = name.removeprefix("model.")
        return next((t.rstrip(".") for t in self.towers if short.startswith(t)), None)

    def text_name(self, name: str) -> str | None:
        """The text model's name for a wrapper tensor, or ``None`` for another tower's."""
        if self.tower_of(name) is not None:
            return None
        for old, new in self.prefixes:
            if name.startswith(old):
                return new + name[len(old) :]
        return name


TEXT_LAYOUT = TextLayout()


@dataclass(frozen=True)
class ConfigView:
    """The language model of a checkpoint, as a family sees it, whatever the layout.

    The family schema validates the flat text fields
    (:meth:`ArtifactConfig.text_config`); :meth:`text_weights` and
    :attr:`quantization` give tensor names and per-module quantization
    overrides in the text model's own names (``model.layers.0...``,
    ``lm_head``). For a flat checkpoint every name is already that, and the
    view changes nothing.
    """

    config: ArtifactConfig
    layout: TextLayout = TEXT_LAYOUT

    @property
    def nested(self) -> bool:
        return self.config.is_nested

    def text_weights(self, weights: Mapping[str, _T]) -> dict[str, _T]:
        """``weights`` under the text model's names.

        The wrapper prefixes are mapped whatever the config's layout (mlx-lm
        saves a converted wrapper's tensors under ``language_model.`` even
        when it flattens the config). Other towers' tensors are dropped, and
        counted in one log line, only for a wrapper config: in a flat
        checkpoint they are unexpected, and the strict check says so.
        """
        out: dict[str, _T] = {}
        dropped: dict[str, int] = {}
        for name, value in weights.items():
            tower = self.layout.tower_of(name)
            if tower is not None and self.nested:
                dropped[tower] = dropped.get(tower, 0) + 1
                continue
            new = self.layout.text_name(name)
            out[name if new is None else new] = value
        if dropped:
            logger.warning(
                "%s: dropped %d non-text tensor(s) (%s); the language model runs alone",
                self.config.path.parent,
                sum(dropped.values()),
                ", ".join(f"{k}: {v}" for k, v in sorted(dropped.items())),
            )
        return out

    @property
    def quantization(self) -> QuantizationConfig | None:
        """The checkpoint's quantization, overrides keyed by text-model module paths."""
        q = self.config.quantization
        if q is None:
            return q
        overrides = {}
        for path, spec in q.overrides.items():
            new = self.layout.text_name(path + ".")
            overrides[path if new is None else new.removesuffix(".")] = spec
        return q.model_copy(update={"overrides": overrides})


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

    def view(self, layout: TextLayout = TEXT_LAYOUT) -> ConfigView:
        """The language model's view of this checkpoint (see :class:`ConfigView`)."""
        return ConfigView(self, layout)

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

    This is the one place pydantic errors turn into the project's error: every
    bad field is named by its dotted path in the file, with the value found and
    what is wrong. A validator that raises
    :class:`~mlx_loom.artifacts.fields.FieldError` names its own field and
    fix; other validator errors are reported at the validator's location.

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
        fixes: list[str] = []
        for item in err.errors():
            cause = (item.get("ctx") or {}).get("error")
            if isinstance(cause, FieldError):
                parts = cause.field.split(".")
                msg, value = cause.message, _lookup(payload, parts)
                value = _UNSET if value is _MISSING else value
                if cause.fix and cause.fix not in fixes:
                    fixes.append(cause.fix)
            else:
                parts = _data_path(tuple(item["loc"]), payload)
                msg = item["msg"]
                value = item.get("input") if item["type"] != "missing" else _MISSING
            dotted = ".".join(([prefix] if prefix else []) + parts) or (prefix or "<root>")
            grouped.setdefault(dotted, [])
            if msg not in grouped[dotted]:
                grouped[dotted].append(msg)
            values[dotted] = value
        lines = []
        for dotted, msgs in list(grouped.items())[:_MAX_ERRORS]:
            value = values[dotted]
            if value is _MISSING:
                found = "missing"
            elif value is _UNSET:
                found = "not set (its default applies)"
            else:
                found = f"found {_short(value)}"
            lines.append(f"{dotted}: {found}; {' or '.join(msgs)}")
        more = len(grouped) - _MAX_ERRORS
        if more > 0:
            lines.append(f"... and {more} more")
        general = f"correct the field(s) above in {source} (or re-download the checkpoint)"
        raise ConfigError(
            f"{source}: {len(grouped)} invalid field(s) for {model.__name__}:\n  "
            + "\n  ".join(lines),
            fix="; ".join([*fixes, general]),
        ) from None


def _lookup(data: Any, parts: list[str]) -> Any:
    """The value at a dotted path of the input, or the missing marker."""
    node = data
    for part in parts:
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        else:
            return _MISSING
    return node


_MISSING = object()
_UNSET = object()
