"""Gemma 4 and Gemma 3 for mlx-loom, declared once: text models, flat or inside the multimodal wrapper.

The core derives implementation ``gemma4.text`` and family profile
``gemma4/text`` (claiming ``gemma4_text`` and ``gemma4``), and
``gemma4.gemma3-text`` / ``gemma4/gemma3-text`` (claiming ``gemma3_text`` and
``gemma3``) from :data:`FAMILY`.
Both model types share one schema: the core hands the family the text view of
a wrapper config (``text_config``), so the family never re-nests it.
"""

from __future__ import annotations

import copy
from typing import Any

from mlx_loom.plugin import (
    ADAPTERS,
    BATCH,
    COMPILED_STEP,
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

from . import kernels as _kernels
from .config import (
    FINGERPRINT_FIELDS,
    GEMMA3_FINGERPRINT_FIELDS,
    Gemma3TextConfig,
    Gemma3WrappedTextConfig,
    Gemma4TextConfig,
)
from .loader import build, build_gemma3, checkpoint_tensors, gemma3_checkpoint_tensors
from .parallel import plan, plan_gemma3

# Small but complete configs: what the conformance kit builds tiny checkpoints from.
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

# Speculative decoding: sliding layers use a rotating cache, whose trim past a
# full window raises CacheNotTrimmable (mlx-lm silently trims nothing there and
# verifies against a wrong window). Refusing is correct behaviour; the loop
# surfaces it. Within the window, and on full-attention layers, trim is exact.
CAPABILITIES = frozenset({GENERATE, BATCH, PROMPT_CACHE, KV_QUANTIZATION, SPECULATIVE, ADAPTERS})
# Gemma 3's graph touches its caches only through offset, make_mask and append
# (no KV sharing, no per-layer inputs), so the core may compile its decode step.
GEMMA3_CAPABILITIES = CAPABILITIES | {COMPILED_STEP}

#: Gemma 3 small enough for the kit: two sliding layers then a global one.
TINY_GEMMA3_TEXT_CONFIG: dict[str, Any] = {
    "model_type": "gemma3_text",
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "intermediate_size": 96,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "query_pre_attn_scalar": 32,
    "vocab_size": 256,
    "sliding_window": 8,
    "sliding_window_pattern": 3,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    "max_position_embeddings": 4096,
}

TINY_GEMMA3_CONFIG: dict[str, Any] = {
    "model_type": "gemma3",
    "vocab_size": 256,
    "text_config": copy.deepcopy(TINY_GEMMA3_TEXT_CONFIG),
}

FAMILY = Family(
    name="gemma4",
    model_types=(
        ModelType(
            name="gemma4_text",
            schema=Gemma4TextConfig,
            fingerprint_fields=FINGERPRINT_FIELDS,
            description="Gemma 4 text model (flat config)",
            tiny_config=TINY_TEXT_CONFIG,
            tool_parser="gemma4",
        ),
        ModelType(
            name="gemma4",
            schema=Gemma4TextConfig,
            fingerprint_fields=FINGERPRINT_FIELDS,
            description="Gemma 4 multimodal checkpoint; text tower only (vision/audio dropped)",
            tiny_config=TINY_WRAPPER_CONFIG,
            tool_parser="gemma4",
        ),
        ModelType(
            name="gemma3_text",
            schema=Gemma3TextConfig,
            fingerprint_fields=GEMMA3_FINGERPRINT_FIELDS,
            description="Gemma 3 text model (flat config)",
            tiny_config=TINY_GEMMA3_TEXT_CONFIG,
            tool_parser="json_tools",
            checkpoint_tensors=gemma3_checkpoint_tensors,
        ),
        ModelType(
            name="gemma3",
            schema=Gemma3WrappedTextConfig,
            fingerprint_fields=GEMMA3_FINGERPRINT_FIELDS,
            description="Gemma 3 multimodal checkpoint; text tower only (vision dropped)",
            tiny_config=TINY_GEMMA3_CONFIG,
            tool_parser="json_tools",
            checkpoint_tensors=gemma3_checkpoint_tensors,
        ),
    ),
    graphs=(
        Graph(
            "gemma4.text",
            factory=build,
            kernels=(_kernels.SWITCH_GLU,),
            parallel=plan,
            model_types=frozenset({"gemma4_text", "gemma4"}),
            capabilities=CAPABILITIES,
            description="Gemma 4 text: sliding/global attention, KV sharing, per-layer inputs, MoE",
        ),
        Graph(
            "gemma4.gemma3-text",
            factory=build_gemma3,
            model_types=frozenset({"gemma3_text", "gemma3"}),
            parallel=plan_gemma3,
            capabilities=GEMMA3_CAPABILITIES,
            description="Gemma 3 text: 1-in-N global attention, local RoPE base, GeGLU",
        ),
    ),
    loader="gemma4.hf",
    capabilities=GEMMA3_CAPABILITIES,
    kernels=tuple(_kernels.kernels()),
    checkpoint_tensors=checkpoint_tensors,
)


@hookimpl
def loom_plugin_api_version() -> str:
    return PLUGIN_API_VERSION


@hookimpl
def loom_families() -> list[Family]:
    return [FAMILY]
