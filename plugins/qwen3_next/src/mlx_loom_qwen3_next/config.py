"""The checkpoint configs this plugin reads: ``qwen3_next`` and ``qwen3_5`` / ``qwen3_5_text``.

Both describe the same hybrid: every ``full_attention_interval``-th layer is a
gated full-attention layer, the others are gated delta nets. Defaults a
checkpoint may omit are filled here, and every check that would otherwise fail
deep inside a forward (head counts that do not divide, a convolution width the
kernels do not implement, an interval that leaves no attention layer) fails
here, at load, naming the field.

``qwen3_next`` follows mlx-lm's ``qwen3_next.ModelArgs`` (which requires the
geometry fields); ``qwen3_5`` follows ``qwen3_5.TextModelArgs`` (every field has
a default, RoPE comes from ``rope_parameters``, and wrapper checkpoints nest the
language model under ``text_config``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt, model_validator

from mlx_loom.errors import ConfigError
from mlx_loom_qwen3_next.kernels import SUPPORTED_CONV_WIDTHS

__all__ = ["Qwen3NextConfig", "Qwen3_5Config", "HybridConfig"]

LayerKind = Literal["linear", "attention"]
MlpKind = Literal["moe", "dense"]


def _flatten_text_config(data: Any) -> Any:
    """Wrapper layouts keep the language model's fields under ``text_config``."""
    if isinstance(data, dict) and isinstance(data.get("text_config"), dict):
        return dict(data["text_config"])
    return data


class HybridConfig(BaseModel):
    """Fields and checks shared by both graphs; the graph reads only these."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    model_type: str
    hidden_size: PositiveInt
    num_hidden_layers: PositiveInt
    intermediate_size: PositiveInt
    num_attention_heads: PositiveInt
    num_key_value_heads: PositiveInt
    head_dim: PositiveInt
    linear_num_value_heads: PositiveInt
    linear_num_key_heads: PositiveInt
    linear_key_head_dim: PositiveInt
    linear_value_head_dim: PositiveInt
    linear_conv_kernel_dim: PositiveInt
    rms_norm_eps: float = Field(gt=0)
    vocab_size: PositiveInt
    max_position_embeddings: PositiveInt = 131072
    rope_theta: float = Field(gt=0)
    partial_rotary_factor: float = Field(gt=0, le=1)
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    full_attention_interval: int = 4
    num_experts: NonNegativeInt = 0
    num_experts_per_tok: NonNegativeInt = 0
    decoder_sparse_step: PositiveInt = 1
    moe_intermediate_size: NonNegativeInt = 0
    shared_expert_intermediate_size: NonNegativeInt = 0
    norm_topk_prob: bool = False
    mlp_only_layers: tuple[NonNegativeInt, ...] = ()

    # --- derived geometry ----------------------------------------------------

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal convolution: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim

    @property
    def rope_dims(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_kind(self, i: int) -> LayerKind:
        return "attention" if (i + 1) % self.full_attention_interval == 0 else "linear"

    @property
    def layer_kinds(self) -> tuple[LayerKind, ...]:
        return tuple(self.layer_kind(i) for i in range(self.num_hidden_layers))

    def mlp_kind(self, i: int) -> MlpKind:
        sparse = (
            i not in self.mlp_only_layers
            and self.num_experts > 0
            and (i + 1) % self.decoder_sparse_step == 0
        )
        return "moe" if sparse else "dense"

    # --- checks that must fail at load ------------------------------------------

    @model_validator(mode="after")
    def _check_geometry(self) -> HybridConfig:
        def bad(field: str, found: str, fix: str) -> ConfigError:
            return ConfigError(f"config.json: {field} {found}", fix=fix)

        if self.num_attention_heads % self.num_key_value_heads:
            raise bad(
                "num_attention_heads",
                f"= {self.num_attention_heads} is not a multiple of num_key_value_heads = "
                f"{self.num_key_value_heads}",
                "grouped-query attention needs num_key_value_heads to divide "
                "num_attention_heads; correct the config",
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise bad(
                "linear_num_value_heads",
                f"= {self.linear_num_value_heads} is not a multiple of linear_num_key_heads = "
                f"{self.linear_num_key_heads}",
                "each key head of the gated delta net serves a whole group of value heads; "
                "correct the config",
            )
        if self.linear_conv_kernel_dim not in SUPPORTED_CONV_WIDTHS:
            raise bad(
                "linear_conv_kernel_dim",
                f"= {self.linear_conv_kernel_dim} is a convolution width the causal-conv "
                "kernels do not implement (supported: "
                f"{', '.join(map(str, SUPPORTED_CONV_WIDTHS))})",
                "use a checkpoint whose linear_conv_kernel_dim is supported",
            )
        if not 1 <= self.full_attention_interval <= self.num_hidden_layers:
            raise bad(
                "full_attention_interval",
                f"= {self.full_attention_interval} leaves no full-attention layer among "
                f"num_hidden_layers = {self.num_hidden_layers} (layer i attends when "
                "(i + 1) % full_attention_interval == 0)",
                "set full_attention_interval between 1 and num_hidden_layers",
            )
        if self.rope_dims < 2 or self.rope_dims % 2:
            raise bad(
                "partial_rotary_factor",
                f"= {self.partial_rotary_factor} gives {self.rope_dims} rotary dims of "
                f"head_dim = {self.head_dim}; RoPE needs an even count of at least 2",
                "correct partial_rotary_factor or head_dim",
            )
        rope_type = None
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("type") or self.rope_scaling.get("rope_type")
        if rope_type not in (None, "default"):
            raise bad(
                "rope_scaling",
                f"has type {rope_type!r}; this plugin implements only the default RoPE",
                "use a checkpoint with default RoPE, or extend the plugin for this scaling",
            )
        out_of_range = [i for i in self.mlp_only_layers if i >= self.num_hidden_layers]
        if out_of_range:
            raise bad(
                "mlp_only_layers",
                f"names layer(s) {out_of_range}, beyond num_hidden_layers = "
                f"{self.num_hidden_layers}",
                "list only existing layer indices",
            )
        if self.num_experts > 0:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise bad(
                    "num_experts_per_tok",
                    f"= {self.num_experts_per_tok} is not between 1 and num_experts = "
                    f"{self.num_experts}",
                    "correct num_experts_per_tok",
                )
            for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):
                if getattr(self, name) == 0:
                    raise bad(
                        name,
                        f"is 0 but num_experts = {self.num_experts} (MoE layers need it)",
                        f"set {name} to the experts' hidden size",
                    )
        return self


class Qwen3NextConfig(HybridConfig):
    """``model_type: qwen3_next`` — geometry required, MoE per ``decoder_sparse_step``."""

    model_type: Literal["qwen3_next"] = "qwen3_next"
    head_dim: PositiveInt
    max_position_embeddings: PositiveInt


class Qwen3_5Config(HybridConfig):
    """``model_type: qwen3_5`` / ``qwen3_5_text``: defaults for all fields, RoPE from
    ``rope_parameters``.

    A ``qwen3_5`` checkpoint's graph puts an MoE block on every layer when
    ``num_experts > 0`` and a dense MLP otherwise.
    """

    model_type: Literal["qwen3_5", "qwen3_5_text"] = "qwen3_5"
    hidden_size: PositiveInt = 4096
    num_hidden_layers: PositiveInt = 32
    intermediate_size: PositiveInt = 14336
    num_attention_heads: PositiveInt = 32
    num_key_value_heads: PositiveInt = 8
    head_dim: PositiveInt = 0  # type: ignore[assignment]  # filled from hidden/heads below
    linear_num_value_heads: PositiveInt = 64
    linear_num_key_heads: PositiveInt = 16
    linear_key_head_dim: PositiveInt = 192
    linear_value_head_dim: PositiveInt = 128
    linear_conv_kernel_dim: PositiveInt = 4
    rms_norm_eps: float = Field(default=1e-6, gt=0)
    vocab_size: PositiveInt = 151936
    rope_theta: float = Field(default=100000.0, gt=0)
    partial_rotary_factor: float = Field(default=0.25, gt=0, le=1)
    norm_topk_prob: bool = True

    def mlp_kind(self, i: int) -> MlpKind:
        # mlx-lm's qwen3_5 puts MoE on every layer when num_experts > 0.
        return "moe" if self.num_experts > 0 else "dense"

    @model_validator(mode="before")
    @classmethod
    def _from_checkpoint(cls, data: Any) -> Any:
        data = _flatten_text_config(data)
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if data.get("model_type") not in ("qwen3_5", "qwen3_5_text"):
            data["model_type"] = "qwen3_5"
        if data.get("head_dim") is None:
            heads = data.get("num_attention_heads", 32)
            hidden = data.get("hidden_size", 4096)
            if isinstance(heads, int) and isinstance(hidden, int) and heads > 0:
                data["head_dim"] = hidden // heads
        # mlx-lm reads RoPE from rope_parameters (default: theta 1e5, factor 0.25).
        params = data.get("rope_parameters")
        if params is None and "rope_parameters" not in data:
            params = {"type": "default", "rope_theta": 100000, "partial_rotary_factor": 0.25}
        if isinstance(params, dict):
            params = dict(params)
            if "type" not in params and "rope_type" in params:
                params["type"] = params.pop("rope_type")
            data["partial_rotary_factor"] = params.get("partial_rotary_factor", 0.25)
            data["rope_theta"] = params.get("rope_theta", 100000.0)
            # mrope_section is ignored for text-only input: all three position
            # streams are equal, which makes multimodal RoPE the plain RoPE.
            data["rope_scaling"] = {"type": params.get("type", "default")}
        return data
