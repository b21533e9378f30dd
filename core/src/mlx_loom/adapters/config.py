"""``adapter_config.json``: what an mlx-lm adapter directory says about itself.

mlx-lm's trainer writes its whole argument namespace there (model, data,
learning rate ...). Inference reads four things and ignores the rest:

* ``fine_tune_type``: ``"lora"`` (the default when absent), ``"dora"`` or
  ``"full"`` (the file then holds replacement weights, not low-rank factors);
* ``num_layers``: how many of the last decoder layers were adapted (``<= 0``
  or more than the model has means all of them, exactly as mlx-lm slices
  ``layers[-max(num_layers, 0):]``);
* ``lora_parameters.rank`` and ``.scale``: the factor rank and the multiplier
  on the low-rank product (mlx-lm's name for what other tools derive from
  ``alpha / rank``);
* ``lora_parameters.keys``: module paths relative to a decoder layer
  (``"self_attn.q_proj"``); absent means every linear, routed-expert linear
  and embedding in the adapted layers.

``dropout`` is a training-time setting; it is read (so a malformed value is
still reported) and ignored. The file is small by construction; it is read
with the core's bounded JSON parser, and anything over
:data:`MAX_CONFIG_BYTES` is refused before it is parsed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from mlx_loom.artifacts.config import validate_family_config
from mlx_loom.artifacts.fields import FiniteFloat
from mlx_loom.bounded_json import JsonLimits, read_json_file
from mlx_loom.errors import AdapterError, ConfigError

__all__ = [
    "ADAPTER_CONFIG_FILE",
    "ADAPTER_WEIGHTS_FILE",
    "MAX_CONFIG_BYTES",
    "AdapterConfig",
    "LoraParameters",
    "read_adapter_config",
]

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapters.safetensors"
#: mlx-lm's configs are ~2 KB; a megabyte leaves room for any key list.
MAX_CONFIG_BYTES = 1 << 20
#: The largest finite float32.
FLOAT32_MAX = 3.4028234663852886e38

FineTuneType = Literal["lora", "dora", "full"]


class LoraParameters(BaseModel):
    """``lora_parameters``: the factor geometry and which modules carry factors."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    rank: StrictInt = Field(gt=0)
    scale: FiniteFloat
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    keys: tuple[str, ...] | None = None

    @field_validator("scale")
    @classmethod
    def _finite(cls, v: float) -> float:
        # The adapted layers compute in float32 (or half): a scale past its
        # range is Inf there, and every logit NaN.
        if not abs(v) <= FLOAT32_MAX:
            raise ValueError(
                f"must be a finite number within float32 (|scale| <= {FLOAT32_MAX:.4g})"
            )
        return v

    @field_validator("keys")
    @classmethod
    def _keys(cls, v: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if v is not None and any(not k.strip() for k in v):
            raise ValueError("every key must be a non-empty module path such as 'self_attn.q_proj'")
        return v


class AdapterConfig(BaseModel):
    """The parts of ``adapter_config.json`` inference needs."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    fine_tune_type: FineTuneType = "lora"
    num_layers: StrictInt | None = None
    lora_parameters: LoraParameters | None = None

    @property
    def low_rank(self) -> bool:
        """True for LoRA and DoRA (factors), False for a full fine-tune (weights)."""
        return self.fine_tune_type != "full"

    @property
    def dora(self) -> bool:
        return self.fine_tune_type == "dora"


def _load_json(path: Path) -> Any:
    try:
        return read_json_file(
            path,
            error=AdapterError,
            fix=f"repair {path.name}, or re-save the adapter",
            limits=JsonLimits(max_bytes=MAX_CONFIG_BYTES),
        )
    except FileNotFoundError:
        raise AdapterError(
            f"{path} does not exist",
            fix=f"pass the directory mlx-lm's trainer wrote (it holds {ADAPTER_CONFIG_FILE} "
            f"and {ADAPTER_WEIGHTS_FILE})",
        ) from None


def read_adapter_config(adapter_dir: Path) -> AdapterConfig:
    """Read and validate ``adapter_dir/adapter_config.json``.

    Raises :class:`AdapterError` naming the field at fault. mlx-lm's own
    hint is kept: a config with ``alpha`` but no ``scale`` comes from another
    tool's convention, and ``lora_layers`` is the older name of ``num_layers``.
    """
    path = adapter_dir / ADAPTER_CONFIG_FILE
    raw = _load_json(path)
    if not isinstance(raw, dict):
        raise AdapterError(
            f"{path}: the top level is a JSON {type(raw).__name__}, not an object",
            fix=f"{ADAPTER_CONFIG_FILE} must be a JSON object; re-save the adapter",
        )
    low_rank = raw.get("fine_tune_type", "lora") in ("lora", "dora")
    if low_rank and raw.get("num_layers") is None:
        hint = (
            " (it has 'lora_layers', the older name of the field)" if "lora_layers" in raw else ""
        )
        missing = "is null" if "num_layers" in raw else "is missing"
        raise AdapterError(
            f"{path}: num_layers {missing}{hint}",
            fix='add "num_layers": N (how many of the last layers were adapted) to '
            f"{ADAPTER_CONFIG_FILE}",
        )
    params = raw.get("lora_parameters")
    if low_rank and (not isinstance(params, dict) or "scale" not in params):
        hint = ""
        if isinstance(params, dict) and "alpha" in params:
            hint = (
                "; it has 'alpha', but mlx-lm's adapters carry 'scale' "
                "(the multiplier on the low-rank product) instead"
            )
        raise AdapterError(
            f"{path}: lora_parameters.scale is missing{hint}",
            fix="add lora_parameters with rank and scale to "
            f"{ADAPTER_CONFIG_FILE} (mlx-lm's defaults are rank 8, scale 20.0)",
        )
    try:
        return validate_family_config(AdapterConfig, raw, source=path)
    except ConfigError as err:
        raise AdapterError(err.message, fix=f"correct {ADAPTER_CONFIG_FILE}") from err
