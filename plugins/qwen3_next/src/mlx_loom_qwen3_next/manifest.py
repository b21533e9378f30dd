"""Every tensor of a checkpoint, from the config alone: the family's one tensor rule.

:func:`tensors` lists the graph's tensors (MLX layout: stacked
``switch_mlp`` experts, ``(C, K, 1)`` convolution weights); the strict loader
compares every checkpoint with it after :func:`~.loader.sanitize`.
:func:`checkpoint_tensors` is the same rule written the way a Hugging Face
checkpoint stores it — per-expert MLP tensors, torch's ``(C, 1, K)`` conv
layout, ``model.language_model.*`` inside a ``text_config`` wrapper — which is
what the conformance kit and the benchmarks write. Both derive from one
function, so a checkpoint the kit writes is one the loader accepts.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator, Mapping
from typing import Any

from mlx_loom.nn import Entry, Matrix, Tensor, dense_tensors
from mlx_loom_qwen3_next.config import HybridConfig, Qwen3_5Config, Qwen3NextConfig

Shape = tuple[int, ...]

TINY_QWEN3_NEXT: dict[str, Any] = {
    "model_type": "qwen3_next",
    "architectures": ["Qwen3NextForCausalLM"],
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,  # KV quantization groups need >= 32
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "shared_expert_intermediate_size": 32,
    "mlp_only_layers": [2],
    "moe_intermediate_size": 32,
    "norm_topk_prob": True,
    "rms_norm_eps": 1e-6,
    "vocab_size": 256,
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.25,
    "max_position_embeddings": 4096,
    "full_attention_interval": 2,
    "tie_word_embeddings": False,
}

_MOE_KEYS = {
    "num_experts",
    "num_experts_per_tok",
    "decoder_sparse_step",
    "mlp_only_layers",
    "shared_expert_intermediate_size",
    "moe_intermediate_size",
    "norm_topk_prob",
    "rope_theta",
    "partial_rotary_factor",
    "architectures",
    "model_type",
}

TINY_QWEN3_5_TEXT: dict[str, Any] = {
    k: v for k, v in TINY_QWEN3_NEXT.items() if k not in _MOE_KEYS
} | {
    "model_type": "qwen3_5_text",
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
    },
}

TINY_QWEN3_5: dict[str, Any] = {
    "model_type": "qwen3_5",
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "text_config": copy.deepcopy(TINY_QWEN3_5_TEXT),
}


def tensors(cfg: HybridConfig) -> Iterator[tuple[str, Entry]]:
    """The graph's tensors, layer by layer (a generator: the loader may stop early)."""
    D, V, H, KV, hd = (
        cfg.hidden_size,
        cfg.vocab_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
    )
    nk, nv, dk, dv = (
        cfg.linear_num_key_heads,
        cfg.linear_num_value_heads,
        cfg.linear_key_head_dim,
        cfg.linear_value_head_dim,
    )
    fused = isinstance(cfg, Qwen3NextConfig)
    yield "model.embed_tokens", Matrix((V, D))
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", Tensor((D,))
        yield p + "post_attention_layernorm.weight", Tensor((D,))
        if cfg.layer_kind(i) == "linear":
            la = p + "linear_attn."
            if fused:
                yield la + "in_proj_qkvz", Matrix((2 * nk * dk + 2 * nv * dv, D))
                yield la + "in_proj_ba", Matrix((2 * nv, D))
            else:
                yield la + "in_proj_qkv", Matrix((cfg.conv_dim, D))
                yield la + "in_proj_z", Matrix((nv * dv, D))
                yield la + "in_proj_b", Matrix((nv, D))
                yield la + "in_proj_a", Matrix((nv, D))
            yield la + "conv1d.weight", Tensor((cfg.conv_dim, cfg.linear_conv_kernel_dim, 1))
            yield la + "dt_bias", Tensor((nv,))
            yield la + "A_log", Tensor((nv,))
            yield la + "norm.weight", Tensor((dv,))
            yield la + "out_proj", Matrix((D, nv * dv))
        else:
            sa, bias = p + "self_attn.", cfg.attention_bias
            yield sa + "q_proj", Matrix((2 * H * hd, D), bias)
            yield sa + "k_proj", Matrix((KV * hd, D), bias)
            yield sa + "v_proj", Matrix((KV * hd, D), bias)
            yield sa + "o_proj", Matrix((D, H * hd), bias)
            yield sa + "q_norm.weight", Tensor((hd,))
            yield sa + "k_norm.weight", Tensor((hd,))
        m = p + "mlp."
        if cfg.mlp_kind(i) == "moe":
            E, inter, shared = (
                cfg.num_experts,
                cfg.moe_intermediate_size,
                cfg.shared_expert_intermediate_size,
            )
            yield m + "gate", Matrix((E, D))
            yield m + "switch_mlp.gate_proj", Matrix((E, inter, D))
            yield m + "switch_mlp.up_proj", Matrix((E, inter, D))
            yield m + "switch_mlp.down_proj", Matrix((E, D, inter))
            yield m + "shared_expert.gate_proj", Matrix((shared, D))
            yield m + "shared_expert.up_proj", Matrix((shared, D))
            yield m + "shared_expert.down_proj", Matrix((D, shared))
            yield m + "shared_expert_gate", Matrix((1, D))
        else:
            inter = cfg.intermediate_size
            yield m + "gate_proj", Matrix((inter, D))
            yield m + "up_proj", Matrix((inter, D))
            yield m + "down_proj", Matrix((D, inter))
    yield "model.norm.weight", Tensor((D,))
    if not cfg.tie_word_embeddings:
        yield "lm_head", Matrix((V, D))


_STACKED = re.compile(r"^(.*\.mlp)\.switch_mlp\.(gate_proj|up_proj|down_proj)\.weight$")


def checkpoint_tensors(config: Mapping[str, Any]) -> dict[str, tuple[Shape, str]]:
    """``{hf_name: (shape, "F32")}`` for a qwen3_next, qwen3_5 or qwen3_5_text config."""
    nested = isinstance(config.get("text_config"), Mapping)
    text = dict(config["text_config"] if nested else config)
    schema = Qwen3NextConfig if config.get("model_type") == "qwen3_next" else Qwen3_5Config
    hf: dict[str, tuple[Shape, str]] = {}
    for name, (shape, dtype) in dense_tensors(tensors(schema.model_validate(text))).items():
        stacked = _STACKED.match(name)
        if stacked:
            base, proj = stacked.groups()
            for e in range(shape[0]):
                hf[f"{base}.experts.{e}.{proj}.weight"] = (shape[1:], dtype)
        elif name.endswith("conv1d.weight"):
            hf[name] = ((shape[0], 1, shape[1]), dtype)  # torch's (C, 1, K)
        else:
            hf[name] = (shape, dtype)
    if not nested:
        return hf
    return {
        ("model.language_model." + n.removeprefix("model.")) if n.startswith("model.") else n: v
        for n, v in hf.items()
    }
