"""Every tensor of a Gemma 4 checkpoint, from the config alone: the family's one tensor rule.

:func:`tensors` lists the graph's tensors in mlx-lm's converted layout (what
the strict loader compares a checkpoint with after :func:`~.loader.sanitize`).
:func:`checkpoint_tensors` is the same rule written the way transformers
saves a checkpoint — the experts as fused ``experts.gate_up_proj`` /
``experts.down_proj``, ``model.language_model.*`` for the ``gemma4`` wrapper —
which the conformance kit and the benchmarks write. KV-shared layers own no
key/value tensors (they read a donor layer's).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any

from mlx_loom.nn import Entry, Matrix, Tensor, dense_tensors
from mlx_loom_gemma4.config import Gemma4TextConfig

S, F = "sliding_attention", "full_attention"

#: Every feature at once: sliding + global layers, per-layer inputs, KV sharing, MoE.
TINY_TEXT_CONFIG: dict[str, Any] = {
    "model_type": "gemma4_text",
    "hidden_size": 64,
    "num_hidden_layers": 5,
    "intermediate_size": 96,
    "num_attention_heads": 2,
    "head_dim": 32,
    "global_head_dim": 64,
    "num_key_value_heads": 1,
    "rms_norm_eps": 1e-6,
    "vocab_size": 256,
    "vocab_size_per_layer_input": 256,
    "hidden_size_per_layer_input": 16,
    "sliding_window": 8,
    "layer_types": [S, S, F, S, F],
    "num_kv_shared_layers": 2,
    "attention_k_eq_v": False,
    "final_logit_softcapping": 30.0,
    "use_double_wide_mlp": True,
    "enable_moe_block": True,
    "num_experts": 4,
    "top_k_experts": 2,
    "moe_intermediate_size": 32,
    "tie_word_embeddings": True,
    "max_position_embeddings": 4096,
    "rope_parameters": {
        F: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
        S: {"rope_type": "default", "rope_theta": 10000.0},
    },
}

TINY_WRAPPER_CONFIG: dict[str, Any] = {
    "model_type": "gemma4",
    "text_config": copy.deepcopy(TINY_TEXT_CONFIG),
}


def tensors(cfg: Gemma4TextConfig) -> Iterator[tuple[str, Entry]]:
    """The graph's tensors, layer by layer (a generator: the loader may stop early)."""
    D, V, n, width = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers, cfg.per_layer_width
    yield "model.embed_tokens", Matrix((V, D))
    if width:
        yield "model.embed_tokens_per_layer", Matrix((cfg.vocab_size_per_layer_input, n * width))
        yield "model.per_layer_model_projection", Matrix((n * width, D))
        yield "model.per_layer_projection_norm.weight", Tensor((width,))
    for i in range(n):
        p, kind = f"model.layers.{i}.", cfg.kinds[i]
        H, hd, KV = cfg.num_attention_heads, cfg.head_dim_for(kind), cfg.kv_heads_for(kind)
        yield p + "self_attn.q_proj", Matrix((H * hd, D))
        if not cfg.is_shared(i):
            yield p + "self_attn.k_proj", Matrix((KV * hd, D))
            if not cfg.k_eq_v_for(kind):
                yield p + "self_attn.v_proj", Matrix((KV * hd, D))
        yield p + "self_attn.o_proj", Matrix((D, H * hd))
        yield p + "self_attn.q_norm.weight", Tensor((hd,))
        if not cfg.is_shared(i):
            yield p + "self_attn.k_norm.weight", Tensor((hd,))
        inter = cfg.mlp_width(i)
        yield p + "mlp.gate_proj", Matrix((inter, D))
        yield p + "mlp.up_proj", Matrix((inter, D))
        yield p + "mlp.down_proj", Matrix((D, inter))
        for norm in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ):
            yield f"{p}{norm}.weight", Tensor((D,))
        if cfg.enable_moe_block:
            E, I = cfg.num_experts, cfg.moe_intermediate_size  # noqa: E741
            yield p + "router.proj", Matrix((E, D))  # type: ignore[arg-type]
            yield p + "router.scale", Tensor((D,))
            yield p + "router.per_expert_scale", Tensor((E,))  # type: ignore[arg-type]
            yield p + "experts.switch_glu.gate_proj", Matrix((E, I, D))  # type: ignore[arg-type]
            yield p + "experts.switch_glu.up_proj", Matrix((E, I, D))  # type: ignore[arg-type]
            yield p + "experts.switch_glu.down_proj", Matrix((E, D, I))  # type: ignore[arg-type]
            for norm in (
                "post_feedforward_layernorm_1",
                "post_feedforward_layernorm_2",
                "pre_feedforward_layernorm_2",
            ):
                yield f"{p}{norm}.weight", Tensor((D,))
        if width:
            yield p + "per_layer_input_gate", Matrix((width, D))
            yield p + "per_layer_projection", Matrix((D, width))
            yield p + "post_per_layer_input_norm.weight", Tensor((D,))
        yield p + "layer_scalar", Tensor((1,))
    yield "model.norm.weight", Tensor((D,))
    if not cfg.tie_word_embeddings:
        yield "lm_head", Matrix((V, D))


def checkpoint_tensors(config: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{hf_name: (shape, "F32")}`` for ``config`` (flat ``gemma4_text`` or ``gemma4``)."""
    nested = isinstance(config.get("text_config"), Mapping)
    text = Gemma4TextConfig.model_validate(dict(config["text_config"] if nested else config))
    ours = dense_tensors(tensors(text))
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for name, (shape, dtype) in ours.items():
        if ".switch_glu." in name:
            base = name.split(".switch_glu.")[0]
            if name.endswith("up_proj.weight"):
                continue  # fused into gate_up_proj
            if name.endswith("gate_proj.weight"):
                E, inter, hidden = shape
                name, shape = f"{base}.gate_up_proj", (E, 2 * inter, hidden)
            else:
                name = f"{base}.down_proj"
        if nested and name.startswith("model."):
            name = "model.language_model." + name.removeprefix("model.")
        out[name] = (shape, dtype)
    return out
