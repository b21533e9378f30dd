"""The checkpoint configs this plugin reads: ``qwen3_next`` and ``qwen3_5`` / ``qwen3_5_text``.

Both describe the same hybrid: every ``full_attention_interval``-th layer is a
gated full-attention layer, the others are gated delta nets. Defaults a
checkpoint may omit are filled here, every size is bounded (int32, finite
floats, at most ``MAX_LAYERS`` layers), and every check that would otherwise
fail deep inside a forward (head counts that do not divide, a convolution
width the kernels do not implement, an interval that leaves no attention
layer) fails here, at load, as a ``ConfigError`` naming the field. All three
are written in the core's config dialect (:class:`mlx_loom.plugin.FamilyConfig`):
omitted values derived in :meth:`~FamilyConfig.fill`, cross-field rules in
:meth:`HybridConfig.check`, pure functions of the fields as properties.

``qwen3_next`` follows mlx-lm's ``qwen3_next.ModelArgs`` (which requires the
geometry fields); ``qwen3_5`` follows ``qwen3_5.TextModelArgs`` (every field
has a default and RoPE comes from ``rope_parameters``). A wrapper checkpoint's
``text_config`` nesting is the core's business: the schema sees the flat
text fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

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
    UnitFloat,
    derived,
)
from mlx_loom_qwen3_next.kernels import SUPPORTED_CONV_WIDTHS

__all__ = ["FINGERPRINT_FIELDS", "HybridConfig", "Qwen3NextConfig", "Qwen3_5Config"]

#: The config fields that decide tensor shapes and graph structure. The config
#: fingerprint hashes exactly these (as the checkpoint spells them).
FINGERPRINT_FIELDS: tuple[str, ...] = (
    "hidden_size",
    "num_hidden_layers",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "linear_num_value_heads",
    "linear_num_key_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
    "vocab_size",
    "full_attention_interval",
    "num_experts",
    "num_experts_per_tok",
    "decoder_sparse_step",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "mlp_only_layers",
    "tie_word_embeddings",
    "partial_rotary_factor",
)

LayerKind = Literal["linear", "attention"]
MlpKind = Literal["moe", "dense"]

#: RoPE kinds mlx-lm's ``initialize_rope`` builds for these graphs (``mrope``
#: is plain RoPE for text-only input: its three position streams are equal).
ROPE_KINDS = ("default", "mrope", "linear", "dynamic", "llama3", "yarn", "longrope")


class _RopeParameters(BaseModel):
    """The two numbers a ``rope_parameters`` object gives the graph (mlx-lm's defaults)."""

    model_config = ConfigDict(extra="ignore")

    rope_theta: PositiveFloat = 100000.0
    partial_rotary_factor: UnitFloat = 0.25


class HybridConfig(FamilyConfig):
    """Fields and checks shared by both graphs; the graph reads only these."""

    model_type: str
    hidden_size: Size
    num_hidden_layers: LayerCount
    intermediate_size: Size
    num_attention_heads: Size
    num_key_value_heads: Size
    head_dim: Size
    linear_num_value_heads: Size
    linear_num_key_heads: Size
    linear_key_head_dim: Size
    linear_value_head_dim: Size
    linear_conv_kernel_dim: Size
    rms_norm_eps: PositiveFloat
    vocab_size: Size
    max_position_embeddings: Size = 131072
    rope_theta: PositiveFloat
    partial_rotary_factor: UnitFloat
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: Flag = False
    attention_bias: Flag = False
    full_attention_interval: Count = 4
    num_experts: Count = 0
    num_experts_per_tok: Count = 0
    decoder_sparse_step: Size = 1
    moe_intermediate_size: Count = 0
    shared_expert_intermediate_size: Count = 0
    norm_topk_prob: Flag = False
    mlp_only_layers: tuple[Count, ...] = ()

    @property
    def mtp_layers(self) -> int:
        """Multi-token-prediction layers the config declares (each model type names them)."""
        return 0

    @field_validator("rope_scaling", mode="before")
    @classmethod
    def _rope_scaling(cls, v: Any, info: ValidationInfo) -> Any:
        head_dim, factor = info.data.get("head_dim"), info.data.get("partial_rotary_factor")
        dims = int(head_dim * factor) if head_dim and factor else None
        return parse_rope_scaling(
            v,
            dims=dims,
            max_position_embeddings=info.data.get("max_position_embeddings"),
            kinds=ROPE_KINDS,
        )

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

    def check(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise FieldError(
                "num_attention_heads",
                f"{self.num_attention_heads} is not a multiple of num_key_value_heads = "
                f"{self.num_key_value_heads}",
                fix="grouped-query attention needs num_key_value_heads to divide "
                "num_attention_heads",
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise FieldError(
                "linear_num_value_heads",
                f"{self.linear_num_value_heads} is not a multiple of linear_num_key_heads = "
                f"{self.linear_num_key_heads}",
                fix="each key head of the gated delta net serves a whole group of value heads",
            )
        if self.linear_conv_kernel_dim not in SUPPORTED_CONV_WIDTHS:
            raise FieldError(
                "linear_conv_kernel_dim",
                f"{self.linear_conv_kernel_dim} is a convolution width the causal-conv kernels "
                f"do not implement (supported: {', '.join(map(str, SUPPORTED_CONV_WIDTHS))})",
                fix="use a checkpoint whose linear_conv_kernel_dim is supported",
            )
        if not 1 <= self.full_attention_interval <= self.num_hidden_layers:
            raise FieldError(
                "full_attention_interval",
                f"{self.full_attention_interval} leaves no full-attention layer among "
                f"num_hidden_layers = {self.num_hidden_layers} (layer i attends when "
                "(i + 1) % full_attention_interval == 0)",
                fix="set full_attention_interval between 1 and num_hidden_layers",
            )
        if self.rope_dims < 2 or self.rope_dims % 2:
            raise FieldError(
                "partial_rotary_factor",
                f"{self.partial_rotary_factor} gives {self.rope_dims} rotary dims of "
                f"head_dim = {self.head_dim}; RoPE needs an even count of at least 2",
                fix="correct partial_rotary_factor or head_dim",
            )
        out_of_range = [i for i in self.mlp_only_layers if i >= self.num_hidden_layers]
        if out_of_range:
            raise FieldError(
                "mlp_only_layers",
                f"names layer(s) {out_of_range}, beyond num_hidden_layers = "
                f"{self.num_hidden_layers}",
                fix="list only existing layer indices",
            )
        if self.num_experts > 0:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise FieldError(
                    "num_experts_per_tok",
                    f"{self.num_experts_per_tok} is not between 1 and num_experts = "
                    f"{self.num_experts}",
                    fix="correct num_experts_per_tok",
                )
            for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):
                if getattr(self, name) == 0:
                    raise FieldError(
                        name,
                        f"is 0 but num_experts = {self.num_experts} (MoE layers need it)",
                        fix=f"set {name} to the experts' hidden size",
                    )


class Qwen3NextConfig(HybridConfig):
    """``model_type: qwen3_next`` — geometry required, MoE per ``decoder_sparse_step``."""

    model_type: Literal["qwen3_next"] = "qwen3_next"
    max_position_embeddings: Size
    #: Multi-token-prediction layers the checkpoint ships (``mtp.*``); 0: none.
    num_nextn_predict_layers: Count = 0

    @property
    def mtp_layers(self) -> int:
        return self.num_nextn_predict_layers


class Qwen3_5Config(HybridConfig):
    """``model_type: qwen3_5`` / ``qwen3_5_text`` (and the ``_moe`` types): defaults for
    all fields, RoPE from ``rope_parameters`` (mlx-lm's ``qwen3_5.TextModelArgs``).

    A ``qwen3_5`` checkpoint's graph puts an MoE block on every layer when
    ``num_experts > 0`` and a dense MLP otherwise (mlx-lm's ``qwen3_5``).
    """

    # Any text model type of the wrapper reads as qwen3_5 (the graph does not branch on it).
    model_type: str = "qwen3_5"
    hidden_size: Size = 4096
    num_hidden_layers: LayerCount = 32
    intermediate_size: Size = 14336
    num_attention_heads: Size = 32
    num_key_value_heads: Size = 8
    head_dim: Size = derived()  # hidden_size // num_attention_heads
    linear_num_value_heads: Size = 64
    linear_num_key_heads: Size = 16
    linear_key_head_dim: Size = 192
    linear_value_head_dim: Size = 128
    linear_conv_kernel_dim: Size = 4
    rms_norm_eps: PositiveFloat = 1e-6
    vocab_size: Size = 151936
    # The three RoPE fields come from rope_parameters (mlx-lm's defaults when absent).
    rope_theta: PositiveFloat = derived()
    partial_rotary_factor: UnitFloat = derived()
    norm_topk_prob: Flag = True
    #: Multi-token-prediction layers the checkpoint ships (``mtp.*``); 0: none.
    mtp_num_hidden_layers: Count = 0

    @property
    def mtp_layers(self) -> int:
        return self.mtp_num_hidden_layers

    @model_validator(mode="before")
    @classmethod
    def _rope_parameters_win(cls, data: Any) -> Any:
        """mlx-lm reads RoPE from ``rope_parameters``, its default object when absent.

        So the flat spellings are dropped for :meth:`fill` to derive them from it
        (``fill`` only fills absent fields); only an explicit null (or a value that
        is no object) leaves the flat fields in charge.
        """
        if isinstance(data, Mapping) and (
            "rope_parameters" not in data or isinstance(data["rope_parameters"], Mapping)
        ):
            flat = ("rope_theta", "partial_rotary_factor", "rope_scaling")
            return {k: v for k, v in data.items() if k not in flat}
        return data

    @classmethod
    def fill(cls, given: Given) -> Mapping[str, Any]:
        """mlx-lm's ``TextModelArgs.__post_init__``: head_dim and RoPE from other fields."""
        out: dict[str, Any] = {}
        heads = given.get("num_attention_heads") if "num_attention_heads" in given else 32
        hidden = given.get("hidden_size") if "hidden_size" in given else 4096
        if heads is not None and hidden is not None:
            out["head_dim"] = hidden // heads
        params = given.get("rope_parameters")
        if isinstance(params, Mapping):
            try:
                rope = _RopeParameters.model_validate(params)
            except ValidationError as err:
                first = err.errors()[0]
                field = ".".join(["rope_parameters", *map(str, first["loc"])])
                raise FieldError(field, first["msg"]) from None
            out["rope_theta"] = rope.rope_theta
            out["partial_rotary_factor"] = rope.partial_rotary_factor
            out["rope_scaling"] = params
        else:  # absent (mlx-lm's default object) or null (the flat fields, else these)
            out["rope_theta"], out["partial_rotary_factor"] = 100000.0, 0.25
        return out

    def mlp_kind(self, i: int) -> MlpKind:
        return "moe" if self.num_experts > 0 else "dense"
