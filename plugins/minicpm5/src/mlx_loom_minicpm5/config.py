"""The checkpoint configs of the Llama graph: Llama (MiniCPM5), Mistral, Ministral 3.

MiniCPM5 is published as ``model_type: "llama"``, so :class:`MiniCPM5Config`
is the Llama schema; Mistral (``mistral``), Ministral 3 (``ministral3``) and
the Mistral 3 wrapper's text model (``mistral3``) are the same graph with the
differences their own classes state. All are written in the core's config
dialect (:class:`mlx_loom.plugin.FamilyConfig`).
Defaults are Hugging Face's (the checkpoint's own format); those derived from
other fields (``head_dim``, ``num_key_value_heads``, ``layer_types``) are
filled once by ``fill``, so the graph never re-derives them.
Every check that would otherwise fail deep inside the first forward — heads
that do not divide, a window without a size, an unknown RoPE type — fails
here, and every size is bounded (int32, finite floats, at most ``MAX_LAYERS``
layers): the core reports each as one ``ConfigError`` naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator

from mlx_loom.nn import RopeScaling, parse_rope_scaling
from mlx_loom.plugin import (
    FamilyConfig,
    FieldError,
    FiniteFloat,
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

    @property
    def llama4_scaling(self) -> tuple[float, int] | None:
        """Llama 4's query scaling by position, ``(beta, original_max_position_embeddings)``.

        Ministral 3 multiplies the queries by ``1 + beta * log(1 + floor(pos /
        original_max))``; Llama and Mistral do not (``None``).
        """
        return None


class MistralConfig(MiniCPM5Config):
    """``model_type: "mistral"``: the Llama graph; a ``sliding_window`` applies to every layer.

    That is Hugging Face's reading (``MistralAttention`` passes the window to
    every layer). mlx-lm maps ``mistral`` to its ``llama`` model, which
    ignores ``sliding_window`` unless ``layer_types`` lists the sliding
    layers, so past the window (4096 tokens in Mistral-7B-v0.1) it attends
    over the whole context where the checkpoint was trained not to. Explicit
    ``layer_types`` still decide; an absent ``sliding_window`` means none
    (transformers writes the field, ``null`` where the model has no window).
    """

    @classmethod
    def fill(cls, given: Given) -> Mapping[str, Any]:
        out = dict(super().fill(given))
        layers = given.get("num_hidden_layers")
        if layers is not None and given.get("sliding_window") is not None:
            out["layer_types"] = ["sliding_attention"] * layers
        return out


class Ministral3Rope(BaseModel):
    """Ministral 3's ``rope_parameters``: RoPE (usually YaRN) and Llama 4's query scaling."""

    model_config = ConfigDict(extra="allow", frozen=True)  # the RoPE kind's own fields stay

    rope_theta: PositiveFloat
    llama_4_scaling_beta: FiniteFloat
    original_max_position_embeddings: Size


#: transformers' ``Ministral3Config`` default, for a config that omits ``rope_parameters``.
MINISTRAL3_ROPE: dict[str, Any] = {
    "type": "yarn",
    "rope_theta": 1000000.0,
    "factor": 16.0,
    "original_max_position_embeddings": 16384,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale_all_dim": 1.0,
    "mscale": 1.0,
    "llama_4_scaling_beta": 0.1,
}


def _ministral3_rope(value: Any) -> Ministral3Rope | None:
    """``rope_parameters`` as Ministral 3 reads them, or ``None`` if they do not validate."""
    if isinstance(value, Ministral3Rope):
        return value
    try:
        return Ministral3Rope.model_validate(value)
    except ValidationError:
        return None


class Ministral3Config(MistralConfig):
    """``model_type: "ministral3"``: Mistral plus ``rope_parameters`` and Llama 4 query scaling.

    ``rope_parameters`` carries the RoPE base, the RoPE kind (YaRN in the
    published checkpoints) and ``llama_4_scaling_beta`` /
    ``original_max_position_embeddings`` for the query scaling; the Llama
    schema's ``rope_theta`` and ``rope_scaling`` are filled from it (given
    beside it, they must agree with it).
    """

    rope_parameters: Ministral3Rope = derived()

    @classmethod
    def fill(cls, given: Given) -> Mapping[str, Any]:
        out = dict(super().fill(given))
        raw = given.get("rope_parameters") if "rope_parameters" in given else MINISTRAL3_ROPE
        rope = _ministral3_rope(raw)
        if rope is None:
            return out  # invalid: its own error is reported
        params = rope.model_dump()
        out["rope_parameters"] = params
        out["rope_theta"] = rope.rope_theta
        out["rope_scaling"] = {k: v for k, v in params.items() if k != "rope_theta"}
        return out

    def check(self) -> None:
        super().check()
        rope = _ministral3_rope(self.rope_parameters)
        assert rope is not None  # a field (or, in the wrapper, checked before this)
        if self.rope_theta != rope.rope_theta:
            raise FieldError(
                "rope_theta",
                f"differs from rope_parameters.rope_theta = {rope.rope_theta}",
                fix="drop rope_theta (Ministral 3 reads rope_parameters)",
            )

    @property
    def llama4_scaling(self) -> tuple[float, int] | None:
        rope = _ministral3_rope(self.rope_parameters)
        assert rope is not None  # validated
        return rope.llama_4_scaling_beta, rope.original_max_position_embeddings


class Mistral3Config(Ministral3Config):
    """``model_type: "mistral3"``: the text model of the Mistral 3 wrapper, by its own type.

    The core hands this schema the ``text_config`` fields. Their
    ``model_type`` picks the text model as mlx-lm does: ``ministral3``
    (Ministral 3), or ``mistral`` / ``llama`` (Mistral Small 3.x: the Mistral
    reading above); ``mistral4`` is a different graph and is refused.
    """

    model_type: Literal["ministral3", "mistral", "llama"] = "mistral"
    # Read only for ministral3 (validated in check); other text models ignore it.
    rope_parameters: dict[str, Any] | None = None  # type: ignore[assignment]

    @classmethod
    def fill(cls, given: Given) -> Mapping[str, Any]:
        if given.get("model_type") == "ministral3":
            return super().fill(given)
        return super(Ministral3Config, cls).fill(given)  # MistralConfig's

    def check(self) -> None:
        if self.model_type != "ministral3":
            return super(Ministral3Config, self).check()  # MistralConfig's
        try:
            Ministral3Rope.model_validate(self.rope_parameters)
        except ValidationError as err:
            first = err.errors()[0]
            field = ".".join(["rope_parameters", *map(str, first["loc"])])
            raise FieldError(field, first["msg"]) from None
        super().check()

    @property
    def llama4_scaling(self) -> tuple[float, int] | None:
        return super().llama4_scaling if self.model_type == "ministral3" else None
