"""The checkpoint config: a Hugging Face ``LlamaConfig``, validated at load.

MiniCPM5 is published as ``model_type: "llama"``, so this schema is the Llama
one. Defaults are Hugging Face's (the checkpoint's own format), filled here so
the graph never re-derives them. Every check that would otherwise fail deep
inside the first forward — heads that do not divide, a window without a size,
an unknown RoPE type — fails here, as a ``ConfigError`` naming the field.

Cross-field checks sit on the *later* field (pydantic validates fields in
declaration order and hands earlier values to later validators), so the error
names the field that is inconsistent with what came before it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveFloat,
    PositiveInt,
    ValidationInfo,
    field_validator,
)

LayerType = Literal["full_attention", "sliding_attention"]

#: The config fields that decide tensor shapes and graph structure. The config
#: fingerprint hashes exactly these (as the checkpoint spells them).
FINGERPRINT_FIELDS: tuple[str, ...] = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "tie_word_embeddings",
)


class _Scaling(BaseModel):
    # Checkpoints carry both "type" and "rope_type" plus fields other runtimes
    # read (attention_factor ...); what we do not use is ignored, not refused.
    model_config = ConfigDict(extra="ignore", frozen=True)


class LinearScaling(_Scaling):
    """Positions divided by ``factor`` (position interpolation)."""

    kind: Literal["linear"] = "linear"
    factor: PositiveFloat


class DynamicScaling(_Scaling):
    """Dynamic NTK: the base grows once the sequence passes ``max_position_embeddings``."""

    kind: Literal["dynamic"] = "dynamic"
    factor: PositiveFloat


class Llama3Scaling(_Scaling):
    """Llama 3.1's frequency-band scaling."""

    kind: Literal["llama3"] = "llama3"
    factor: PositiveFloat
    low_freq_factor: PositiveFloat = 1.0
    high_freq_factor: PositiveFloat = 4.0
    original_max_position_embeddings: PositiveInt = 8192


class YarnScaling(_Scaling):
    """YaRN: ramped interpolation between extrapolated and interpolated frequencies."""

    kind: Literal["yarn"] = "yarn"
    factor: PositiveFloat
    original_max_position_embeddings: PositiveInt = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


class LongRopeScaling(_Scaling):
    """LongRoPE (Phi-3 style): per-frequency long factors and an input scale."""

    kind: Literal["longrope"] = "longrope"
    original_max_position_embeddings: PositiveInt
    short_factor: list[float] | float = 1.0
    long_factor: list[float] | float = 1.0


RopeScaling = LinearScaling | DynamicScaling | Llama3Scaling | YarnScaling | LongRopeScaling
_SCALINGS: dict[str, type[_Scaling]] = {
    "linear": LinearScaling,
    "dynamic": DynamicScaling,
    "llama3": Llama3Scaling,
    "yarn": YarnScaling,
    "longrope": LongRopeScaling,
}


class MiniCPM5Config(BaseModel):
    """The fields of ``config.json`` the graph reads, with defaults filled."""

    model_config = ConfigDict(extra="ignore")

    vocab_size: PositiveInt
    hidden_size: PositiveInt
    intermediate_size: PositiveInt
    num_hidden_layers: PositiveInt
    num_attention_heads: PositiveInt
    num_key_value_heads: PositiveInt | None = Field(None, validate_default=True)
    head_dim: PositiveInt | None = Field(None, validate_default=True)
    rms_norm_eps: PositiveFloat = 1e-6
    attention_bias: bool = False
    mlp_bias: bool = False
    # Hugging Face's LlamaConfig default. mlx-lm defaults to True instead; a
    # checkpoint that omits the field and lacks lm_head.weight is reported as
    # missing lm_head.weight, with the fix in the message.
    tie_word_embeddings: bool = False
    rope_theta: PositiveFloat = 10000.0
    rope_traditional: bool = False  # an mlx-lm field; Hugging Face rotates halves
    max_position_embeddings: PositiveInt | None = None
    rope_scaling: RopeScaling | None = None
    sliding_window: PositiveInt | None = None
    layer_types: list[LayerType] | None = Field(None, validate_default=True)

    @field_validator("num_key_value_heads")
    @classmethod
    def _kv_heads_divide_heads(cls, v: int | None, info: ValidationInfo) -> int | None:
        heads = info.data.get("num_attention_heads")
        if heads is None:
            return v
        if v is None:
            return heads
        if heads % v:
            raise ValueError(f"must divide num_attention_heads = {heads} (grouped-query attention)")
        return v

    @field_validator("head_dim")
    @classmethod
    def _head_dim(cls, v: int | None, info: ValidationInfo) -> int | None:
        hidden, heads = info.data.get("hidden_size"), info.data.get("num_attention_heads")
        if v is None and hidden is not None and heads is not None:
            if hidden % heads:
                raise ValueError(
                    f"is absent and hidden_size = {hidden} is not divisible by "
                    f"num_attention_heads = {heads}; set head_dim explicitly"
                )
            v = hidden // heads
        if v is not None and v % 2:
            raise ValueError("must be even: RoPE rotates pairs of dimensions")
        return v

    @field_validator("rope_scaling", mode="before")
    @classmethod
    def _rope_scaling(cls, v: Any, info: ValidationInfo) -> Any:
        if v is None:
            return None
        if not isinstance(v, dict):
            raise ValueError("must be an object with a 'rope_type' (or 'type') key")
        # mlx-lm's lookup order: "type" first, then "rope_type".
        kind = v.get("type") or v.get("rope_type") or "default"
        if kind == "default":
            return None
        schema = _SCALINGS.get(kind)
        if schema is None:
            raise ValueError(
                f"rope type {kind!r} is not supported (supported: default, {', '.join(_SCALINGS)})"
            )
        needs_max = kind in ("dynamic", "longrope")
        if needs_max and info.data.get("max_position_embeddings") is None:
            raise ValueError(f"rope type {kind!r} needs max_position_embeddings, which is absent")
        scaling = schema.model_validate({k: x for k, x in v.items() if k not in ("type", "kind")})
        if (
            isinstance(scaling, Llama3Scaling)
            and scaling.low_freq_factor == scaling.high_freq_factor
        ):
            raise ValueError("llama3 low_freq_factor must differ from high_freq_factor")
        half = (info.data.get("head_dim") or 0) // 2
        if isinstance(scaling, LongRopeScaling):
            for name in ("short_factor", "long_factor"):
                factors = getattr(scaling, name)
                if isinstance(factors, list) and len(factors) != half:
                    raise ValueError(f"{name} has {len(factors)} entries; head_dim / 2 = {half}")
        return scaling

    @field_validator("layer_types")
    @classmethod
    def _layer_types(cls, v: list[str] | None, info: ValidationInfo) -> list[str] | None:
        layers = info.data.get("num_hidden_layers")
        if layers is None:
            return v
        if v is None:
            return ["full_attention"] * layers
        if len(v) != layers:
            raise ValueError(f"has {len(v)} entries; num_hidden_layers = {layers}")
        if "sliding_attention" in v and info.data.get("sliding_window") is None:
            raise ValueError("has sliding_attention layers but sliding_window is absent")
        return v

    @property
    def sliding(self) -> list[bool]:
        """Per layer: does it attend over a sliding window (rotating cache)?"""
        return [t == "sliding_attention" for t in self.layer_types or ()]
