"""The plugin's registrations: model types, kernels, implementations, profiles."""

from __future__ import annotations

from mlx_loom.hookspecs import PLUGIN_API_VERSION, hookimpl
from mlx_loom.kernels import Kernel
from mlx_loom.plugin import ADAPTERS
from mlx_loom.profiles import (
    BATCH,
    GENERATE,
    KV_QUANTIZATION,
    PROMPT_CACHE,
    SPECULATIVE,
    Execution,
    Profile,
)
from mlx_loom.registry import Implementation, ModelType
from mlx_loom_qwen3_next.config import Qwen3_5Config, Qwen3NextConfig
from mlx_loom_qwen3_next.kernels import KERNEL_NAMES, kernels
from mlx_loom_qwen3_next.loader import build
from mlx_loom_qwen3_next.manifest import (
    TINY_QWEN3_5,
    TINY_QWEN3_5_TEXT,
    TINY_QWEN3_NEXT,
    checkpoint_tensors,
)

LOADER = "qwen3_next.hf-or-mlx"
QWEN3_NEXT_GRAPH = "qwen3_next.hybrid-moe"
QWEN3_5_GRAPH = "qwen3_next.hybrid-split"
QWEN3_5_TYPES = frozenset({"qwen3_5", "qwen3_5_text"})

# Speculative decoding goes through RecurrentCache rounds (begin_round/commit);
# prompt-cache reuse never trims (the loop reuses exact prefixes only).
CAPABILITIES = frozenset({GENERATE, BATCH, PROMPT_CACHE, KV_QUANTIZATION, SPECULATIVE, ADAPTERS})

_FINGERPRINT = (
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


@hookimpl
def loom_plugin_api_version() -> str:
    return PLUGIN_API_VERSION


@hookimpl
def loom_model_types() -> list[ModelType]:
    return [
        ModelType(
            "qwen3_next",
            Qwen3NextConfig,
            _FINGERPRINT,
            description="Qwen3-Next: gated delta nets + gated attention, sparse MoE",
            tiny_config=TINY_QWEN3_NEXT,
            checkpoint_tensors=checkpoint_tensors,
        ),
        ModelType(
            "qwen3_5",
            Qwen3_5Config,
            _FINGERPRINT,
            description="Qwen3.5 (text): gated delta nets + gated attention",
            tiny_config=TINY_QWEN3_5,
            checkpoint_tensors=checkpoint_tensors,
        ),
        ModelType(
            "qwen3_5_text",
            Qwen3_5Config,
            _FINGERPRINT,
            description="Qwen3.5 text config",
            tiny_config=TINY_QWEN3_5_TEXT,
            checkpoint_tensors=checkpoint_tensors,
        ),
    ]


@hookimpl
def loom_kernels() -> list[Kernel]:
    return kernels()


@hookimpl
def loom_implementations() -> list[Implementation]:
    return [
        Implementation(
            id="qwen3_next.hybrid-moe.default",
            graph=QWEN3_NEXT_GRAPH,
            loader=LOADER,
            model_types=frozenset({"qwen3_next"}),
            factory=build,
            kernels=KERNEL_NAMES,
            capabilities=CAPABILITIES,
            description="fused in_proj_qkvz/in_proj_ba delta nets, MoE beside dense layers",
        ),
        Implementation(
            id="qwen3_next.hybrid-split.default",
            graph=QWEN3_5_GRAPH,
            loader=LOADER,
            model_types=QWEN3_5_TYPES,
            factory=build,
            kernels=KERNEL_NAMES,
            capabilities=CAPABILITIES,
            description="separate in_proj_qkv/z/b/a delta nets (Qwen3.5)",
        ),
    ]


@hookimpl
def loom_profiles() -> list[Profile]:
    return [
        Profile(
            id="qwen3_next/family",
            model_types=frozenset({"qwen3_next"}),
            execution=Execution(graph=QWEN3_NEXT_GRAPH, loader=LOADER),
            capabilities=CAPABILITIES,
            description="every qwen3_next checkpoint",
        ),
        Profile(
            id="qwen3_next/qwen3_5-family",
            model_types=QWEN3_5_TYPES,
            execution=Execution(graph=QWEN3_5_GRAPH, loader=LOADER),
            capabilities=CAPABILITIES,
            description="every qwen3_5 / qwen3_5_text checkpoint",
        ),
    ]
