"""The checkpoint config: a Hugging Face ``LlamaConfig``, validated at load.

MiniCPM5 is published as ``model_type: "llama"``, so this schema is the Llama
one. Defaults are Hugging Face's (the checkpoint's own format), filled here so
the graph never re-derives them. Every check that would otherwise fail deep
inside the first forward — heads that do not divide, a window without a size,
an unknown RoPE type — fails here, and every size is bounded (int32, finite
floats, at most ``MAX_LAYERS`` layers): the core reports each as one
``ConfigError`` naming the field.

Cross-field checks sit on the *later* field (pydantic validates fields in
declaration order and hands earlier values to later validators), so the error
names the field that is inconsistent with what came before it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from mlx_loom.nn import RopeScaling, parse_rope_scaling
from mlx_loom.plugin import Flag, LayerCount, PositiveFloat, Size

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

#: The RoPE kinds a Llama config may ask for (``mrope`` is a Qwen2-VL kind).
ROPE_KINDS = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


class MiniCPM5Config(BaseModel):
    """The fields of ``config.json`` the graph reads, with defaults filled."""

    model_config = ConfigDict(extra="ignore")

    vocab_size: Size
    hidden_size: Size
    intermediate_size: Size
    num_hidden_layers: LayerCount
    num_attention_heads: Size
    num_key_value_heads: Size | None = Field(None, validate_default=True)
    head_dim: Size | None = Field(None, validate_default=True)
    rms_norm_eps: PositiveFloat = 1e-6
    attention_bias: Flag = False
    mlp_bias: Flag = False
    # Hugging Face's LlamaConfig default. mlx-lm defaults to True instead; a
    # checkpoint that omits the field and lacks lm_head.weight is reported as
    # missing lm_head.weight, with the fix in the message.
    tie_word_embeddings: Flag = False
    rope_theta: PositiveFloat = 10000.0
    rope_traditional: Flag = False  # an mlx-lm field; Hugging Face rotates halves
    max_position_embeddings: Size | None = None
    rope_scaling: RopeScaling | None = None
    sliding_window: Size | None = None
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
        return parse_rope_scaling(
            v,
            dims=info.data.get("head_dim"),
            max_position_embeddings=info.data.get("max_position_embeddings"),
            kinds=ROPE_KINDS,
        )

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
