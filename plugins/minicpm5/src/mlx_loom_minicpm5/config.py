"""The checkpoint config: a Hugging Face ``LlamaConfig``, validated at load.

MiniCPM5 is published as ``model_type: "llama"``, so this schema is the Llama
one, written in the core's config dialect (:class:`mlx_loom.plugin.FamilyConfig`).
Defaults are Hugging Face's (the checkpoint's own format); those derived from
other fields (``head_dim``, ``num_key_value_heads``, ``layer_types``) are
filled once by :meth:`LlamaConfig.fill`, so the graph never re-derives them.
Every check that would otherwise fail deep inside the first forward — heads
that do not divide, a window without a size, an unknown RoPE type — fails
here, and every size is bounded (int32, finite floats, at most ``MAX_LAYERS``
layers): the core reports each as one ``ConfigError`` naming the field.
"""

from __future__ import annotations

from typing import Any, Literal

from collections.abc import Mapping

from pydantic import ValidationInfo, field_validator

from mlx_loom.nn import RopeScaling, parse_rope_scaling
from mlx_loom.plugin import (
    FamilyConfig,
    FieldError,
    Flag,
    Given,
    LayerCount,
    PositiveFloat,
    Size,
    derived,
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

#: The RoPE kinds a Llama config may ask for (``mrope`` is a Qwen2-VL kind).
ROPE_KINDS = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


class MiniCPM5Config(FamilyConfig):
    """The fields of ``config.json`` the graph reads, with defaults filled."""

    vocab_size: Size
    hidden_size: Size
    intermediate_size: Size
    num_hidden_layers: LayerCount
    num_attention_heads: Size
    num_key_value_heads: Size = derived()  # num_attention_heads (multi-head attention)
    head_dim: Size = derived()  # hidden_size / num_attention_heads
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
    layer_types: list[LayerType] = derived()  # every layer full attention

    @classmethod
    def fill(cls, given: Given) -> Mapping[str, Any]:
        hidden, heads = given.get("hidden_size"), given.get("num_attention_heads")
        layers = given.get("num_hidden_layers")
        out: dict[str, Any] = {"num_key_value_heads": heads}
        if layers is not None:
            out["layer_types"] = ["full_attention"] * layers
        if "head_dim" not in given and hidden is not None and heads is not None:
            if hidden % heads:
                raise FieldError(
                    "head_dim",
                    f"is absent and hidden_size = {hidden} is not divisible by "
                    f"num_attention_heads = {heads}",
                    fix="set head_dim explicitly",
                )
            out["head_dim"] = hidden // heads
        return out

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
        heads, kv = self.num_attention_heads, self.num_key_value_heads
        if heads % kv:
            raise FieldError(
                "num_key_value_heads",
                f"must divide num_attention_heads = {heads}",
                fix="grouped-query attention needs the key/value heads to divide the heads",
            )
        if self.head_dim % 2:
            raise FieldError("head_dim", "must be even: RoPE rotates pairs of dimensions")
        if len(self.layer_types) != self.num_hidden_layers:
            raise FieldError(
                "layer_types",
                f"has {len(self.layer_types)} entries; num_hidden_layers = "
                f"{self.num_hidden_layers}",
                fix="give one kind per layer",
            )
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise FieldError(
                "sliding_window",
                "is absent but layer_types has sliding_attention layers",
                fix="set sliding_window, or make every layer full_attention",
            )

    @property
    def sliding(self) -> list[bool]:
        """Per layer: does it attend over a sliding window (rotating cache)?"""
        return [t == "sliding_attention" for t in self.layer_types]
