"""The checkpoint config: a Hugging Face ``GptOssConfig``, validated at load.

Defaults are those of the published gpt-oss checkpoints (and of mlx-lm's
``gpt_oss`` model args, which agree), filled here so the graph never
re-derives them: alternating sliding/full layers starting with a sliding one,
a 128-token window, 4 experts per token. Every size is bounded by the core's
field types; a cross-field inconsistency is one ``ConfigError`` naming the
field it blames (the core's config dialect, :class:`mlx_loom.plugin.FamilyConfig`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import ValidationInfo, field_validator

from mlx_loom.nn import RopeScaling, parse_rope_scaling
from mlx_loom.plugin import (
    FamilyConfig,
    FieldError,
    Given,
    LayerCount,
    PositiveFloat,
    Size,
    derived,
)

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


class GptOssConfig(FamilyConfig):
    """The fields of ``config.json`` the graph reads, with defaults filled."""

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
    layer_types: list[LayerType] = derived()  # sliding, full, sliding, full, ...

    @classmethod
    def fill(cls, given: Given) -> Mapping[str, Any]:
        layers = given.get("num_hidden_layers")
        if layers is None:
            return {}
        # The published default: sliding, full, sliding, full, ...
        kinds = ("sliding_attention", "full_attention")
        return {"layer_types": [kinds[i % 2] for i in range(layers)]}

    @field_validator("rope_scaling", mode="before")
    @classmethod
    def _rope_scaling(cls, v: Any, info: ValidationInfo) -> Any:
        return parse_rope_scaling(
            v,
            dims=info.data.get("head_dim"),
            max_position_embeddings=info.data.get("max_position_embeddings"),
            kinds=ROPE_KINDS,
        )

    def check(self) -> None:
        heads = self.num_attention_heads
        if heads % self.num_key_value_heads:
            raise FieldError(
                "num_key_value_heads",
                f"must divide num_attention_heads = {heads}",
                fix="grouped-query attention needs the key/value heads to divide the heads",
            )
        if self.head_dim % 2:
            raise FieldError("head_dim", "must be even: RoPE rotates pairs of dimensions")
        if self.num_experts_per_tok > self.num_local_experts:
            raise FieldError(
                "num_experts_per_tok",
                f"exceeds num_local_experts = {self.num_local_experts}",
                fix="route each token to at most as many experts as there are",
            )
        if len(self.layer_types) != self.num_hidden_layers:
            raise FieldError(
                "layer_types",
                f"has {len(self.layer_types)} entries; num_hidden_layers = "
                f"{self.num_hidden_layers}",
                fix="give one kind per layer",
            )

    @property
    def sliding(self) -> list[bool]:
        """Per layer: does it attend over a sliding window (rotating cache)?"""
        return [t == "sliding_attention" for t in self.layer_types]
