"""The checkpoint config: a Hugging Face ``GptOssConfig``, validated at load.

Defaults are those of the published gpt-oss checkpoints (and of mlx-lm's
``gpt_oss`` model args, which agree), filled here so the graph never
re-derives them: alternating sliding/full layers starting with a sliding one,
a 128-token window, 4 experts per token. Every size is bounded by the core's
field types; a cross-field inconsistency is one ``ConfigError`` naming the
later field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from mlx_loom.nn import RopeScaling, parse_rope_scaling
from mlx_loom.plugin import LayerCount, PositiveFloat, Size

LayerType = Literal["full_attention", "sliding_attention"]

#: The config fields that decide tensor shapes and graph structure.
FINGERPRINT_FIELDS: tuple[str, ...] = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_local_experts",
    "num_experts_per_tok",
    "vocab_size",
)

#: gpt-oss publishes YaRN; the plain kinds are accepted as any RoPE graph takes them.
ROPE_KINDS = ("default", "linear", "yarn")


class GptOssConfig(BaseModel):
    """The fields of ``config.json`` the graph reads, with defaults filled."""

    model_config = ConfigDict(extra="ignore")

    vocab_size: Size
    hidden_size: Size
    intermediate_size: Size
    num_hidden_layers: LayerCount
    num_attention_heads: Size
    num_key_value_heads: Size
    head_dim: Size = 64
    num_local_experts: Size
    num_experts_per_tok: Size = 4
    rms_norm_eps: PositiveFloat = 1e-5
    sliding_window: Size = 128
    rope_theta: PositiveFloat = 150000.0
    # The clamp of the SwiGLU variant (Hugging Face's swiglu_limit); mlx-lm
    # hard-codes 7.0, the value every published checkpoint carries.
    swiglu_limit: PositiveFloat = 7.0
    max_position_embeddings: Size | None = None
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: Literal[False] = False
    layer_types: list[LayerType] | None = Field(None, validate_default=True)

    @field_validator("num_key_value_heads")
    @classmethod
    def _kv_heads_divide_heads(cls, v: int, info: ValidationInfo) -> int:
        heads = info.data.get("num_attention_heads")
        if heads is not None and heads % v:
            raise ValueError(f"must divide num_attention_heads = {heads} (grouped-query attention)")
        return v

    @field_validator("head_dim")
    @classmethod
    def _head_dim_even(cls, v: int) -> int:
        if v % 2:
            raise ValueError("must be even: RoPE rotates pairs of dimensions")
        return v

    @field_validator("num_experts_per_tok")
    @classmethod
    def _top_k(cls, v: int, info: ValidationInfo) -> int:
        experts = info.data.get("num_local_experts")
        if experts is not None and v > experts:
            raise ValueError(f"= {v} exceeds num_local_experts = {experts}")
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
            # The published default: sliding, full, sliding, full, ...
            return [("sliding_attention", "full_attention")[i % 2] for i in range(layers)]
        if len(v) != layers:
            raise ValueError(f"has {len(v)} entries; num_hidden_layers = {layers}")
        return v

    @property
    def sliding(self) -> list[bool]:
        """Per layer: does it attend over a sliding window (rotating cache)?"""
        return [t == "sliding_attention" for t in self.layer_types or ()]
