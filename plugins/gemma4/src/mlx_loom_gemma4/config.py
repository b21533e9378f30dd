"""The Gemma 4 and Gemma 3 checkpoint configs: omitted-field defaults, and the checks that must fail at load.

Two layouts reach us: ``gemma4_text`` checkpoints are flat, ``gemma4``
(multimodal) checkpoints nest the language model's fields under
``text_config``. The core's config view hands this schema the flat text
fields of either, so :class:`Gemma4TextConfig` is the one schema. (mlx-lm's
``gemma4`` wrapper forces ``text_config.vocab_size`` to the top-level
``vocab_size``, 262144 when absent; we read the text config's own value, and
the weights' headers settle any disagreement before a graph is built.)

Every size is bounded (int32, finite floats, at most ``MAX_LAYERS`` layers)
and each bad field is one ``ConfigError`` naming it.

Defaults follow mlx-lm's ``gemma4_text.ModelArgs`` (so the oracle and we read
the same directory the same way) with one deliberate exception:
``num_kv_shared_layers`` defaults to 0, as in transformers'
``Gemma4TextConfig``. mlx-lm defaults it to 20, which makes every config of 20
layers or fewer that omits the field unloadable and silently shares KV in
deeper ones; configs written by transformers always carry the field, so the
default only ever applies to hand-written configs, where "no sharing" is the
reading that cannot surprise. Parity tests set it explicitly.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from mlx_loom.nn import ProportionalScaling, RopeScaling, parse_rope_scaling
from mlx_loom.plugin import (
    Count,
    FieldError,
    Flag,
    LayerCount,
    PositiveFloat,
    Size,
)

SLIDING = "sliding_attention"
FULL = "full_attention"
AttentionKind = Literal["sliding_attention", "full_attention"]
ATTENTION_KINDS: tuple[str, ...] = (SLIDING, FULL)

#: mlx-lm's defaults for ``rope_parameters`` when a config omits it.
DEFAULT_ROPE_PARAMETERS: dict[str, dict[str, Any]] = {
    FULL: {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
    SLIDING: {"partial_rotary_factor": 1.0, "rope_theta": 10000.0, "rope_type": "default"},
}


class RopeParameters(BaseModel):
    """RoPE for one attention kind: ``default`` (all dims) or ``proportional`` (a leading part)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    rope_type: Literal["default", "proportional"] = Field(
        "default", validation_alias=AliasChoices("type", "rope_type")
    )
    rope_theta: PositiveFloat = 10000.0
    partial_rotary_factor: PositiveFloat = 1.0
    factor: PositiveFloat = 1.0

    def rotated_dims(self, head_dim: int) -> int:
        """How many leading dims of a head rotate (mlx-lm: ``int(head_dim * factor)``)."""
        if self.rope_type == "default":
            return head_dim
        return int(head_dim * self.partial_rotary_factor)

    @property
    def scaling(self) -> RopeScaling | None:
        """The core RoPE kind this is (``None``: plain RoPE over the whole head)."""
        if self.rope_type == "default":
            return None
        return ProportionalScaling(
            partial_rotary_factor=self.partial_rotary_factor, factor=self.factor
        )


class Gemma4TextConfig(BaseModel):
    """The language model's fields. Field order matters: validators read earlier fields."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    model_type: str = "gemma4_text"
    hidden_size: Size = 1536
    num_hidden_layers: LayerCount = 35
    intermediate_size: Size = 6144
    num_attention_heads: Size = 8
    head_dim: Size = 256
    global_head_dim: Count | None = 512
    num_key_value_heads: Size = 1
    num_global_key_value_heads: Size | None = None
    rms_norm_eps: PositiveFloat = 1e-6
    vocab_size: Size = 262144
    vocab_size_per_layer_input: Size = 262144
    hidden_size_per_layer_input: Count | None = 256
    rope_traditional: Flag = False
    sliding_window: Size = 512
    sliding_window_pattern: Size = 5
    max_position_embeddings: Size = 131072
    attention_k_eq_v: Flag = False
    #: ``cap * tanh(logits / cap)``: 0 zeroes every logit and a negative cap
    #: flips them, so only a positive cap (or none) is accepted.
    final_logit_softcapping: PositiveFloat | None = 30.0
    use_double_wide_mlp: Flag = True
    enable_moe_block: Flag = False
    num_experts: Size | None = None
    top_k_experts: Size | None = None
    moe_intermediate_size: Size | None = None
    tie_word_embeddings: Flag = True
    num_kv_shared_layers: Count = 0
    layer_types: list[str] | None = Field(None, validate_default=True)
    rope_parameters: dict[str, RopeParameters] | None = Field(None, validate_default=True)

    # --- checks that must fail at load -----------------------------------

    @field_validator("num_kv_shared_layers")
    @classmethod
    def _shared_below_layer_count(cls, v: int, info: ValidationInfo) -> int:
        n = info.data.get("num_hidden_layers")
        if n is not None and v >= n:
            raise ValueError(
                f"num_kv_shared_layers={v} must be smaller than num_hidden_layers={n}: "
                "at least one earlier layer must own the keys/values the shared layers read"
            )
        return v

    @field_validator("layer_types", mode="after")
    @classmethod
    def _layer_types_match_layers(cls, v: list[str] | None, info: ValidationInfo) -> list[str]:
        n = info.data.get("num_hidden_layers")
        if n is None:  # num_hidden_layers itself failed; that error is reported
            return v or []
        if v is None:
            # Every pattern-th layer is global; O(layers), whatever the pattern.
            pattern = info.data.get("sliding_window_pattern") or 5
            v = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(n)]
        unknown = sorted({k for k in v if k not in ATTENTION_KINDS})
        if unknown:
            raise ValueError(
                f"unknown layer kind(s) {unknown}; "
                f"each entry must be one of {list(ATTENTION_KINDS)}"
            )
        if len(v) != n:
            raise ValueError(
                f"has {len(v)} entries but num_hidden_layers={n}; give one kind per layer"
            )
        shared = info.data.get("num_kv_shared_layers")
        if shared:
            owners = set(v[: n - shared])
            orphans = sorted(set(v[n - shared :]) - owners)
            if orphans:
                raise ValueError(
                    f"the last {shared} (KV-shared) layers include kind(s) {orphans} that no "
                    "earlier layer has, so they would have no keys/values to read"
                )
        return v

    @field_validator("rope_parameters", mode="after")
    @classmethod
    def _rope_splits_heads(
        cls, v: dict[str, RopeParameters] | None, info: ValidationInfo
    ) -> dict[str, RopeParameters]:
        if v is None:
            v = {k: RopeParameters.model_validate(p) for k, p in DEFAULT_ROPE_PARAMETERS.items()}
        head_dim, global_head_dim = info.data.get("head_dim"), info.data.get("global_head_dim")
        if head_dim is None:
            return v
        for kind in ATTENTION_KINDS:
            rope = v.get(kind, RopeParameters())
            dim = global_head_dim if kind == FULL and global_head_dim else head_dim
            name = "global_head_dim" if dim is global_head_dim else "head_dim"
            if rope.rope_type == "default" and rope.partial_rotary_factor != 1.0:
                raise ValueError(
                    f"{kind}: rope_type 'default' with partial_rotary_factor="
                    f"{rope.partial_rotary_factor}; only 'proportional' RoPE rotates part of a "
                    "head (mlx-lm ignores the factor here, so its meaning is ambiguous)"
                )
            rotated = rope.rotated_dims(dim)
            if dim % 2 or rotated <= 0 or rotated > dim or rotated % 2:
                raise ValueError(
                    f"{kind}: {name}={dim} with partial_rotary_factor="
                    f"{rope.partial_rotary_factor} gives {rotated} rotated dims; RoPE needs an "
                    f"even head dim and an even rotary dim in (0, {dim}]"
                )
        return v

    @model_validator(mode="after")
    def _heads_and_experts(self) -> Gemma4TextConfig:
        for kind in sorted(set(self.layer_types or [])):
            kv = self.kv_heads_for(kind)
            if self.num_attention_heads % kv:
                raise FieldError(
                    "num_attention_heads",
                    f"{self.num_attention_heads} is not a multiple of the {kv} key/value heads "
                    f"of {kind} layers",
                    fix="grouped-query attention needs the key/value heads to divide the heads",
                )
        if self.enable_moe_block:
            missing = [
                f
                for f in ("num_experts", "top_k_experts", "moe_intermediate_size")
                if getattr(self, f) is None
            ]
            if missing:
                raise FieldError(
                    "enable_moe_block",
                    f"is true but {missing} are not set",
                    fix="set the expert fields, or enable_moe_block to false",
                )
            if self.top_k_experts > self.num_experts:  # type: ignore[operator]
                raise FieldError(
                    "top_k_experts",
                    f"{self.top_k_experts} exceeds num_experts={self.num_experts}",
                    fix="route each token to at most num_experts experts",
                )
        return self

    # --- derived geometry (the graph never re-derives these) -------------

    @property
    def kinds(self) -> list[str]:
        return list(self.layer_types or [])

    @property
    def first_shared_layer(self) -> int:
        """Index of the first layer that reads another layer's keys/values."""
        return self.num_hidden_layers - self.num_kv_shared_layers

    def is_shared(self, layer: int) -> bool:
        return self.num_kv_shared_layers > 0 and layer >= self.first_shared_layer

    def kv_donor(self, layer: int) -> int:
        """The layer whose keys/values ``layer`` attends over: itself, or the last
        non-shared layer of the same kind."""
        if not self.is_shared(layer):
            return layer
        kind = self.kinds[layer]
        return max(i for i in range(self.first_shared_layer) if self.kinds[i] == kind)

    def head_dim_for(self, kind: str) -> int:
        return self.global_head_dim if kind == FULL and self.global_head_dim else self.head_dim

    def k_eq_v_for(self, kind: str) -> bool:
        return self.attention_k_eq_v and kind != SLIDING

    def kv_heads_for(self, kind: str) -> int:
        if self.k_eq_v_for(kind) and self.num_global_key_value_heads is not None:
            return self.num_global_key_value_heads
        return self.num_key_value_heads

    def rope_for(self, kind: str) -> RopeParameters:
        return (self.rope_parameters or {}).get(kind, RopeParameters())

    def mlp_width(self, layer: int) -> int:
        """KV-shared layers use a double-wide MLP when ``use_double_wide_mlp`` is set."""
        wide = self.use_double_wide_mlp and self.is_shared(layer)
        return self.intermediate_size * (2 if wide else 1)

    @property
    def per_layer_width(self) -> int:
        return self.hidden_size_per_layer_input or 0


#: Config fields that decide the graph (the config fingerprint covers exactly these).
FINGERPRINT_FIELDS: tuple[str, ...] = (
    "hidden_size",
    "num_hidden_layers",
    "intermediate_size",
    "num_attention_heads",
    "head_dim",
    "global_head_dim",
    "num_key_value_heads",
    "num_global_key_value_heads",
    "rms_norm_eps",
    "vocab_size",
    "vocab_size_per_layer_input",
    "hidden_size_per_layer_input",
    "rope_traditional",
    "rope_parameters",
    "sliding_window",
    "sliding_window_pattern",
    "layer_types",
    "attention_k_eq_v",
    "final_logit_softcapping",
    "use_double_wide_mlp",
    "enable_moe_block",
    "num_experts",
    "top_k_experts",
    "moe_intermediate_size",
    "tie_word_embeddings",
    "num_kv_shared_layers",
)


# --- Gemma 3 ---------------------------------------------------------------------------

#: The RoPE kinds a Gemma 3 config may ask for on its global layers (4B and up
#: publish ``linear`` with factor 8; the local layers never scale).
GEMMA3_ROPE_KINDS = ("default", "linear", "dynamic", "yarn", "llama3")

GEMMA3_FINGERPRINT_FIELDS: tuple[str, ...] = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "sliding_window_pattern",
    "tie_word_embeddings",
)


class Gemma3TextConfig(BaseModel):
    """Gemma 3's language model (``gemma3_text``, or ``text_config`` of a ``gemma3`` wrapper).

    Defaults are mlx-lm's ``gemma3_text.ModelArgs`` (Gemma 3 1B), so a
    directory both engines read means the same thing to both. Layer ``i`` is
    global (full attention) when ``(i + 1) % sliding_window_pattern == 0``,
    sliding otherwise. Fields mlx-lm ignores but that would change the
    arithmetic if honoured are refused rather than ignored: a non-null
    ``attn_logit_softcapping``/``final_logit_softcapping``, an activation other
    than tanh-GELU, and a ``layer_types`` list that disagrees with the pattern.
    """

    model_config = ConfigDict(frozen=True, extra="ignore")

    model_type: str = "gemma3_text"
    hidden_size: Size = 1152
    num_hidden_layers: LayerCount = 26
    intermediate_size: Size = 6912
    num_attention_heads: Size = 4
    head_dim: Size = 256
    num_key_value_heads: Size = 1
    rms_norm_eps: PositiveFloat = 1e-6
    vocab_size: Size = 262144
    rope_theta: PositiveFloat = 1_000_000.0
    rope_local_base_freq: PositiveFloat = 10_000.0
    query_pre_attn_scalar: PositiveFloat = 256.0
    sliding_window: Size = 512
    sliding_window_pattern: Size = 6
    max_position_embeddings: Size = 32768
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: Flag = True
    hidden_activation: Literal["gelu_pytorch_tanh"] = "gelu_pytorch_tanh"
    attn_logit_softcapping: None = None
    final_logit_softcapping: None = None
    layer_types: list[AttentionKind] | None = None

    @field_validator("rope_scaling", mode="before")
    @classmethod
    def _rope_scaling(cls, v: Any, info: ValidationInfo) -> Any:
        return parse_rope_scaling(
            v,
            dims=info.data.get("head_dim"),
            max_position_embeddings=info.data.get("max_position_embeddings"),
            kinds=GEMMA3_ROPE_KINDS,
        )

    @model_validator(mode="after")
    def _geometry(self) -> Gemma3TextConfig:
        if self.num_attention_heads % self.num_key_value_heads:
            raise FieldError(
                "num_key_value_heads",
                f"{self.num_key_value_heads} does not divide num_attention_heads = "
                f"{self.num_attention_heads} (grouped-query attention)",
            )
        if self.head_dim % 2:
            raise FieldError("head_dim", f"{self.head_dim} is odd; RoPE rotates pairs")
        if self.layer_types is not None and list(self.layer_types) != self.kinds:
            raise FieldError(
                "layer_types",
                f"disagrees with sliding_window_pattern = {self.sliding_window_pattern} "
                "(Gemma 3 makes every pattern-th layer global)",
                fix="drop layer_types or make it match sliding_window_pattern",
            )
        return self

    @property
    def kinds(self) -> list[str]:
        """Per layer: ``sliding_attention`` or ``full_attention``."""
        p = self.sliding_window_pattern
        return [FULL if (i + 1) % p == 0 else SLIDING for i in range(self.num_hidden_layers)]


class Gemma3WrappedTextConfig(Gemma3TextConfig):
    """The ``text_config`` of a ``gemma3`` (multimodal) checkpoint: its text tower only.

    Omitted fields take the wrapper's defaults, which differ from the flat
    text model's: 8 query and 4 key/value heads and a 262,208-token
    vocabulary (transformers' and mlx-lm's ``gemma3`` wrapper agree on these).
    """

    model_type: str = "gemma3"
    num_attention_heads: Size = 8
    num_key_value_heads: Size = 4
    vocab_size: Size = 262208
