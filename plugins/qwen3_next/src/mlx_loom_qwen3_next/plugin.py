"""Qwen3-Next and Qwen3.5 for mlx-loom, declared once: one family, two graphs.

``qwen3_next`` checkpoints get graph ``qwen3_next.hybrid-moe`` (fused
``in_proj_qkvz``/``in_proj_ba`` delta nets, MoE beside dense layers);
``qwen3_5``/``qwen3_5_text`` get ``qwen3_next.hybrid-split`` (separate
``in_proj_qkv``/``z``/``b``/``a``). The core derives one implementation per
graph (id = graph id) and the family profiles ``qwen3_next/hybrid-moe`` and
``qwen3_next/hybrid-split``. One factory serves both: the schema the config
validated against decides the projection layout.
"""

from __future__ import annotations

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
from .loader import build
from .manifest import TINY_QWEN3_5, TINY_QWEN3_5_TEXT, TINY_QWEN3_NEXT, checkpoint_tensors
from .parallel import plan

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
            model_types=frozenset({"qwen3_5", "qwen3_5_text"}),
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
