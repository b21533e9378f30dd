"""Qwen3-Next and Qwen3.5 for mlx-loom, declared once: one family, two graphs.

``qwen3_next`` checkpoints get graph ``qwen3_next.hybrid-moe`` (fused
``in_proj_qkvz``/``in_proj_ba`` delta nets, MoE beside dense layers);
``qwen3_5``/``qwen3_5_text`` get ``qwen3_next.hybrid-split`` (separate
``in_proj_qkv``/``z``/``b``/``a``). The core derives one implementation per
graph (id = graph id) and the family profiles ``qwen3_next/hybrid-moe`` and
``qwen3_next/hybrid-split``.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.nn as nn

from mlx_loom.plugin import (
    BATCH,
    GENERATE,
    KV_QUANTIZATION,
    PLUGIN_API_VERSION,
    PROMPT_CACHE,
    SPECULATIVE,
    BuildContext,
    Family,
    Graph,
    ModelType,
    hookimpl,
)

from .config import HybridConfig, Qwen3_5Config, Qwen3NextConfig
from .graph import Kernels
from .kernels import KERNEL_NAMES, cpu_kernels, metal_kernels
from .manifest import TINY_QWEN3_5, TINY_QWEN3_5_TEXT, TINY_QWEN3_NEXT, checkpoint_tensors

# Speculative decoding goes through RecurrentCache rounds (begin_round/commit);
# prompt-cache reuse never trims (the loop reuses exact prefixes only).
CAPABILITIES = frozenset({GENERATE, BATCH, PROMPT_CACHE, KV_QUANTIZATION, SPECULATIVE})

FINGERPRINT_FIELDS = (
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


def _factory(*, fused: bool) -> Callable[[BuildContext], nn.Module]:
    def build(ctx: BuildContext) -> nn.Module:
        from .loader import load_model

        cfg = ctx.family_config
        assert isinstance(cfg, HybridConfig)
        return load_model(
            ctx.model_dir,
            cfg,
            Kernels.from_mapping(ctx.kernels),
            fused=fused,
            quantization=ctx.config.quantization,
        )

    return build


def _model_type(name: str, schema: type[HybridConfig], tiny: dict, description: str) -> ModelType:
    return ModelType(
        name=name,
        schema=schema,
        fingerprint_fields=FINGERPRINT_FIELDS,
        description=description,
        tiny_config=tiny,
    )


FAMILY = Family(
    name="qwen3_next",
    model_types=(
        _model_type(
            "qwen3_next",
            Qwen3NextConfig,
            TINY_QWEN3_NEXT,
            "Qwen3-Next: gated delta nets + gated attention, sparse MoE",
        ),
        _model_type(
            "qwen3_5",
            Qwen3_5Config,
            TINY_QWEN3_5,
            "Qwen3.5 (text): gated delta nets + gated attention",
        ),
        _model_type("qwen3_5_text", Qwen3_5Config, TINY_QWEN3_5_TEXT, "Qwen3.5 text config"),
    ),
    graphs=(
        Graph(
            "qwen3_next.hybrid-moe",
            factory=_factory(fused=True),
            model_types=frozenset({"qwen3_next"}),
            kernels=KERNEL_NAMES,
            description="fused in_proj_qkvz/in_proj_ba delta nets, MoE beside dense layers",
        ),
        Graph(
            "qwen3_next.hybrid-split",
            factory=_factory(fused=False),
            model_types=frozenset({"qwen3_5", "qwen3_5_text"}),
            kernels=KERNEL_NAMES,
            description="separate in_proj_qkv/z/b/a delta nets (Qwen3.5)",
        ),
    ),
    loader="qwen3_next.hf-or-mlx",
    capabilities=CAPABILITIES,
    kernels=(*cpu_kernels(), *metal_kernels()),
    checkpoint_tensors=checkpoint_tensors,
)


@hookimpl
def loom_plugin_api_version() -> str:
    return PLUGIN_API_VERSION


@hookimpl
def loom_families() -> list[Family]:
    return [FAMILY]
