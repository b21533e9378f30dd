"""The checkpoint configs: Hugging Face ``Qwen3Config`` and ``Qwen3MoeConfig``, validated at load.

Both are the Llama-shaped decoder plus a per-head RMSNorm on queries and keys
(``q_norm``/``k_norm``); the MoE config adds routed experts on the layers
``decoder_sparse_step`` and ``mlp_only_layers`` pick. Defaults are Hugging
Face's, filled here so the graph never re-derives them; ``head_dim`` has no
default (Hugging Face's is 128 whatever the width, mlx-lm requires the field,
and every published config states it), so a config without it is refused
rather than guessed. Both are written in the core's config dialect
(:class:`mlx_loom.plugin.FamilyConfig`): bounded field types (int32, finite
floats, at most ``MAX_LAYERS`` layers), cross-field rules in :meth:`check`,
each problem one ``ConfigError`` naming the field.

transformers >= 5 nests ``rope_theta`` and the scaling under
``rope_parameters``; :meth:`Qwen3Config.fill` reads that form into the flat
fields when they are absent, as mlx-lm's ``qwen3`` does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import ValidationInfo, field_validator

from mlx_loom.nn import RopeScaling, parse_rope_scaling
from mlx_loom.plugin import (
    Count,
    FamilyConfig,
    FieldError,
    Flag,
    Given,
    LayerCount,
    PositiveFloat,
    Size,
)

#: The config fields that decide tensor shapes and graph structure; the config
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
    "attention_bias",
)
#: ``qwen3_moe`` adds the experts' geometry and where they sit.
MOE_FINGERPRINT_FIELDS: tuple[str, ...] = (
    *FINGERPRINT_FIELDS,
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "decoder_sparse_step",
    "mlp_only_layers",
)

#: The RoPE kinds a Qwen3 config may ask for (published ones use plain RoPE or YaRN).
ROPE_KINDS = ("default", "linear", "dynamic", "yarn")

MlpKind = Literal["moe", "dense"]


class Qwen3Config(FamilyConfig):
    """``model_type: qwen3`` — the dense decoder (Qwen3-0.6B ... 32B)."""

    vocab_size: Size
    hidden_size: Size
    intermediate_size: Size
    num_hidden_layers: LayerCount
    num_attention_heads: Size
    num_key_value_heads: Size
    head_dim: Size
    rms_norm_eps: PositiveFloat = 1e-6
    attention_bias: Flag = False
    tie_word_embeddings: Flag = False
    rope_theta: PositiveFloat = 10000.0
    max_position_embeddings: Size | None = None
    rope_scaling: RopeScaling | None = None
    # Hugging Face would give layers from max_window_layers on a sliding
    # window; no published Qwen3 turns it on and mlx-lm ignores it, so it is
    # refused (check) rather than run without the window.
    use_sliding_window: Flag = False

    @classmethod
    def fill(cls, given: Given) -> Mapping[str, Any]:
        """transformers >= 5: ``rope_parameters`` carries the base and the scaling."""
        params = given.get("rope_parameters")
        if not isinstance(params, dict):
            return {}
        return {"rope_theta": params.get("rope_theta"), "rope_scaling": params}

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
        if self.num_attention_heads % self.num_key_value_heads:
            raise FieldError(
                "num_key_value_heads",
                f"does not divide num_attention_heads = {self.num_attention_heads}",
                fix="grouped-query attention needs the key/value heads to divide the heads",
            )
        if self.head_dim % 2:
            raise FieldError("head_dim", "must be even: RoPE rotates pairs of dimensions")
        if self.use_sliding_window:
            raise FieldError(
                "use_sliding_window",
                "true is not supported (no published Qwen3 uses a sliding window)",
                fix="set use_sliding_window to false",
            )

    def mlp_kind(self, i: int) -> MlpKind:
        """Which MLP layer ``i`` has: always dense here."""
        return "dense"


class Qwen3MoeConfig(Qwen3Config):
    """``model_type: qwen3_moe`` — routed experts (Qwen3-30B-A3B, 235B-A22B).

    Layer ``i`` routes when ``num_experts > 0``, ``i`` is not in
    ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``; the other
    layers keep the dense ``intermediate_size`` MLP.
    """

    num_experts: Count
    num_experts_per_tok: Size
    moe_intermediate_size: Size
    decoder_sparse_step: Size = 1
    # A set: each layer asks whether it is listed (a hostile list stays linear).
    mlp_only_layers: frozenset[Count] = frozenset()
    norm_topk_prob: Flag = False

    def check(self) -> None:
        super().check()
        if self.num_experts and self.num_experts_per_tok > self.num_experts:
            raise FieldError(
                "num_experts_per_tok",
                f"exceeds num_experts = {self.num_experts}",
                fix="route each token to at most num_experts experts",
            )
        beyond = sorted(i for i in self.mlp_only_layers if i >= self.num_hidden_layers)
        if beyond:
            raise FieldError(
                "mlp_only_layers",
                f"names layer(s) {beyond[:10]}, beyond num_hidden_layers = "
                f"{self.num_hidden_layers}",
                fix="list only existing layer indices",
            )

    def mlp_kind(self, i: int) -> MlpKind:
        sparse = (
            self.num_experts > 0
            and i not in self.mlp_only_layers
            and (i + 1) % self.decoder_sparse_step == 0
        )
        return "moe" if sparse else "dense"
