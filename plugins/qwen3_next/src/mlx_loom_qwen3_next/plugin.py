"""Qwen3-Next and Qwen3.5 for mlx-loom, declared once: one family, two graphs.

``qwen3_next`` checkpoints get graph ``qwen3_next.hybrid-moe`` (fused
``in_proj_qkvz``/``in_proj_ba`` delta nets, MoE beside dense layers);
``qwen3_5``/``qwen3_5_text`` and ``qwen3_5_moe``/``qwen3_5_moe_text`` get
``qwen3_next.hybrid-split`` (separate ``in_proj_qkv``/``z``/``b``/``a``; the
MoE types put experts on every layer). The core derives one implementation per
graph (id = graph id) and the family profiles ``qwen3_next/hybrid-moe`` and
``qwen3_next/hybrid-split``. One factory serves both: the schema the config
validated against decides the projection layout.
"""

from __future__ import annotations

import copy
from typing import Any

from mlx_loom.plugin import (
    ADAPTERS,
    BATCH,
    GENERATE,
    KV_QUANTIZATION,
    PLUGIN_API_VERSION,
    PROMPT_CACHE,
    SPECULATIVE,
    Family,
    Graph,
    ModelType,
    hookimpl,
)

from .config import FINGERPRINT_FIELDS, Qwen3_5Config, Qwen3NextConfig
from .kernels import KERNEL_NAMES, kernels
from .loader import build, checkpoint_tensors
from .parallel import plan

# Small but complete configs: what the conformance kit builds tiny checkpoints from.
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

# Qwen3.5-MoE (the 35B-A3B class): the Qwen3.5 graph with experts on every layer.
TINY_QWEN3_5_MOE_TEXT: dict[str, Any] = TINY_QWEN3_5_TEXT | {
    "model_type": "qwen3_5_moe_text",
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
}

TINY_QWEN3_5_MOE: dict[str, Any] = {
    "model_type": "qwen3_5_moe",
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "text_config": copy.deepcopy(TINY_QWEN3_5_MOE_TEXT),
}

# Speculative decoding goes through RecurrentCache rounds (begin_round/commit);
# prompt-cache reuse never trims (the loop reuses exact prefixes only).
CAPABILITIES = frozenset({GENERATE, BATCH, PROMPT_CACHE, KV_QUANTIZATION, SPECULATIVE, ADAPTERS})

FAMILY = Family(
    name="qwen3_next",
    model_types=(
        ModelType(
            name="qwen3_next",
            schema=Qwen3NextConfig,
            fingerprint_fields=FINGERPRINT_FIELDS,
            description="Qwen3-Next: gated delta nets + gated attention, sparse MoE",
            tiny_config=TINY_QWEN3_NEXT,
            tool_parser="json_tools",
        ),
        ModelType(
            name="qwen3_5",
            schema=Qwen3_5Config,
            fingerprint_fields=FINGERPRINT_FIELDS,
            description="Qwen3.5 (text): gated delta nets + gated attention",
            tiny_config=TINY_QWEN3_5,
            tool_parser="qwen3_coder",
        ),
        ModelType(
            name="qwen3_5_text",
            schema=Qwen3_5Config,
            fingerprint_fields=FINGERPRINT_FIELDS,
            description="Qwen3.5 text config",
            tiny_config=TINY_QWEN3_5_TEXT,
            tool_parser="qwen3_coder",
        ),
        ModelType(
            name="qwen3_5_moe",
            schema=Qwen3_5Config,
            fingerprint_fields=FINGERPRINT_FIELDS,
            description="Qwen3.5/3.6-MoE (text): gated delta nets + gated attention, experts on every layer",
            tiny_config=TINY_QWEN3_5_MOE,
            tool_parser="qwen3_coder",
        ),
        ModelType(
            name="qwen3_5_moe_text",
            schema=Qwen3_5Config,
            fingerprint_fields=FINGERPRINT_FIELDS,
            description="Qwen3.5-MoE text config",
            tiny_config=TINY_QWEN3_5_MOE_TEXT,
            tool_parser="qwen3_coder",
        ),
    ),
    graphs=(
        Graph(
            "qwen3_next.hybrid-moe",
            factory=build,
            model_types=frozenset({"qwen3_next"}),
            kernels=KERNEL_NAMES,
            parallel=plan,
            description="fused in_proj_qkvz/in_proj_ba delta nets, MoE beside dense layers",
        ),
        Graph(
            "qwen3_next.hybrid-split",
            factory=build,
            model_types=frozenset({"qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"}),
            kernels=KERNEL_NAMES,
            parallel=plan,
            description="separate in_proj_qkv/z/b/a delta nets (Qwen3.5)",
        ),
    ),
    loader="qwen3_next.hf-or-mlx",
    capabilities=CAPABILITIES,
    kernels=tuple(kernels()),
    checkpoint_tensors=checkpoint_tensors,
)


@hookimpl
def loom_plugin_api_version() -> str:
    return PLUGIN_API_VERSION


@hookimpl
def loom_families() -> list[Family]:
    return [FAMILY]
