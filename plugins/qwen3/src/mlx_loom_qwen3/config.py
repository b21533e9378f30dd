"""The checkpoint configs: Hugging Face ``Qwen3Config`` and ``Qwen3MoeConfig``, validated at load.

Both are the Llama-shaped decoder plus a per-head RMSNorm on queries and keys
(``q_norm``/``k_norm``); the MoE config adds routed experts on the layers
``decoder_sparse_step`` and ``mlp_only_layers`` pick. Defaults are Hugging
Face's, filled here so the graph never re-derives them; ``head_dim`` has no
default (Hugging Face's is 128 whatever the width, mlx-lm requires the field,
and every published config states it), so a config without it is refused
rather than guessed. Every size is bounded (int32, finite floats, at most
``MAX_LAYERS`` layers); each problem is one ``ConfigError`` naming the field.

transformers >= 5 nests ``rope_theta`` and the scaling under
``rope_parameters``; :meth:`Qwen3Config._rope_parameters` reads that form
into the flat fields, as mlx-lm's ``qwen3`` does.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator, model_validator

from mlx_loom.nn import RopeScaling, parse_rope_scaling
from mlx_loom.plugin import Count, FieldError, Flag, LayerCount, PositiveFloat, Size

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


class Qwen3Config(BaseModel):
    """``model_type: qwen3`` — the dense decoder (Qwen3-0.6B ... 32B)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

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
    use_sliding_window: Flag = False

    @model_validator(mode="before")
    @classmethod
    def _rope_parameters(cls, data: Any) -> Any:
        """transformers >= 5: ``rope_parameters`` carries the base and the scaling."""
        if not isinstance(data, dict) or not isinstance(data.get("rope_parameters"), dict):
            return data
        data, params = dict(data), data["rope_parameters"]
        if data.get("rope_theta") is None and "rope_theta" in params:
            data["rope_theta"] = params["rope_theta"]
        if data.get("rope_scaling") is None:
            data["rope_scaling"] = params
        return data

    @field_validator("head_dim")
    @classmethod
    def _even_head_dim(cls, v: int) -> int:
        if v % 2:
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

    @field_validator("use_sliding_window")
    @classmethod
    def _no_sliding_window(cls, v: bool) -> bool:
        # Hugging Face would give layers from max_window_layers on a sliding
        # window; no published Qwen3 turns it on and mlx-lm ignores it, so it
        # is refused rather than run without the window.
        if v:
            raise ValueError("true is not supported (no published Qwen3 uses a sliding window)")
        return v

    @model_validator(mode="after")
    def _grouped_query_attention(self) -> Qwen3Config:
        if self.num_attention_heads % self.num_key_value_heads:
            raise FieldError(
                "num_key_value_heads",
                f"{self.num_key_value_heads} does not divide num_attention_heads = "
                f"{self.num_attention_heads}",
                fix="grouped-query attention needs num_key_value_heads to divide "
                "num_attention_heads",
            )
        return self

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

    @model_validator(mode="after")
    def _experts(self) -> Qwen3MoeConfig:
        if self.num_experts and self.num_experts_per_tok > self.num_experts:
            raise FieldError(
                "num_experts_per_tok",
                f"{self.num_experts_per_tok} exceeds num_experts = {self.num_experts}",
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
        return self

    def mlp_kind(self, i: int) -> MlpKind:
        sparse = (
            self.num_experts > 0
            and i not in self.mlp_only_layers
            and (i + 1) % self.decoder_sparse_step == 0
        )
        return "moe" if sparse else "dense"
