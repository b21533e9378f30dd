"""MiniCPM5 for mlx-loom, declared once: the Llama graph, also serving Mistral and Ministral 3.

Entry point: ``[project.entry-points.mlx_loom] minicpm5 = "mlx_loom_minicpm5.plugin"``.
The core derives implementation ``minicpm5.llama`` and family profile
``minicpm5/llama`` from :data:`FAMILY`. No custom kernels: attention, RoPE and
RMSNorm are MLX's fused ops, which run on every backend.
"""

from __future__ import annotations

from mlx_loom.plugin import (
    ADAPTERS,
    BATCH,
    COMPILED_STEP,
    GENERATE,
    KV_QUANTIZATION,
    PLUGIN_API_VERSION,
    PROMPT_CACHE,
    SPECULATIVE,
    Execution,
    Family,
    Graph,
    ModelType,
    Profile,
    hookimpl,
)

from .config import (
    FINGERPRINT_FIELDS,
    MiniCPM5Config,
    Ministral3Config,
    Mistral3Config,
    MistralConfig,
)
from .loader import build, checkpoint_tensors
from .parallel import plan

GRAPH = "minicpm5.llama"
LOADER = "minicpm5.hf-safetensors"

# Full caches trim exactly, so prompt caching and speculation are sound; a
# sliding-window cache that has wrapped refuses to trim (never trims wrongly).
# COMPILED_STEP: the graph touches its caches only through offset, make_mask
# and append, so the core may compile its one-token forward.
CAPABILITIES = frozenset(
    {GENERATE, BATCH, PROMPT_CACHE, KV_QUANTIZATION, SPECULATIVE, ADAPTERS, COMPILED_STEP}
)

# A small but complete config: what the conformance kit builds tiny checkpoints from.
TINY_CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,  # head_dim 32: KV quantization groups need >= 32
    "num_key_value_heads": 1,
    "vocab_size": 256,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}

# Mistral: every layer slides over a window (8 < the kit's longer prompts, so
# rotating caches wrap), no biases, head_dim 32 for KV quantization groups.
TINY_MISTRAL_CONFIG = {
    **{k: v for k, v in TINY_CONFIG.items() if k not in ("model_type", "architectures")},
    "model_type": "mistral",
    "architectures": ["MistralForCausalLM"],
    "sliding_window": 8,
}

# Ministral 3: YaRN and Llama 4 query scaling from rope_parameters; an original
# context of 8 positions so the scaling changes within a short prompt.
TINY_MINISTRAL3_CONFIG = {
    **{k: v for k, v in TINY_CONFIG.items() if k not in ("model_type", "architectures")},
    "model_type": "ministral3",
    "architectures": ["Ministral3ForCausalLM"],
    "sliding_window": None,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 1000000.0,
        "factor": 16.0,
        "original_max_position_embeddings": 8,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "llama_4_scaling_beta": 0.1,
    },
}

# The Mistral 3 wrapper (a vision-language checkpoint; the text model is served).
TINY_MISTRAL3_CONFIG = {
    "model_type": "mistral3",
    "architectures": ["Mistral3ForConditionalGeneration"],
    "text_config": TINY_MINISTRAL3_CONFIG,
    "vision_config": {"model_type": "pixtral"},
}


# openbmb/MiniCPM5-1B, bf16: hidden 1536, intermediate 4608, 24 layers, 16 heads,
# 2 KV heads, head_dim 128, vocab 130560, untied lm_head. Intermediate size and
# untied head follow from the published counts (1,080,632,832 parameters,
# 679,552,512 non-embedding). Both fingerprints are derived, not downloaded:
# config = config_fingerprint over FINGERPRINT_FIELDS of that config;
# artifact = artifact_fingerprint of loader.checkpoint_tensors(config, "BF16").
# tests/test_profiles.py recomputes them.
MINICPM5_1B_PROFILE = Profile(
    id="minicpm5/minicpm5-1b",
    model_types=frozenset({"llama"}),
    execution=Execution(graph=GRAPH, loader=LOADER, specialization="artifact"),
    config_fingerprint="sha256:543c14a0bd2bfbce1bda4a427455f705e666114c0f6c421f7ced2f59fadf12b6",
    artifact_fingerprint="sha256:b2f5ca8d8f115370abc5d28e3af4d750b09854eedf2a3c6d0dcae44af054d447",
    capabilities=CAPABILITIES,
    description="openbmb/MiniCPM5-1B in bf16.",
)

FAMILY = Family(
    name="minicpm5",
    model_types=(
        ModelType(
            name="llama",
            schema=MiniCPM5Config,
            fingerprint_fields=FINGERPRINT_FIELDS,
            description="Llama architecture (MiniCPM5 is published as model_type 'llama').",
            tiny_config=TINY_CONFIG,
            tool_parser="minicpm5",
        ),
        ModelType(
            name="mistral",
            schema=MistralConfig,
            fingerprint_fields=FINGERPRINT_FIELDS,
            description="Mistral (Llama graph; a sliding_window applies to every layer).",
            tiny_config=TINY_MISTRAL_CONFIG,
            tool_parser="mistral",
        ),
        ModelType(
            name="ministral3",
            schema=Ministral3Config,
            fingerprint_fields=FINGERPRINT_FIELDS,
            description="Ministral 3 text (Llama graph, YaRN, Llama 4 query scaling).",
            tiny_config=TINY_MINISTRAL3_CONFIG,
            tool_parser="mistral",
        ),
        ModelType(
            name="mistral3",
            schema=Mistral3Config,
            fingerprint_fields=FINGERPRINT_FIELDS,
            description="Mistral 3 wrapper: its text model (ministral3, mistral); vision dropped.",
            tiny_config=TINY_MISTRAL3_CONFIG,
            tool_parser="mistral",
        ),
    ),
    graphs=(
        Graph(
            GRAPH,
            factory=build,
            parallel=plan,
            description="Llama graph on MLX fused ops (attention, RoPE, RMSNorm); any backend; "
            "also Mistral and Ministral 3.",
        ),
    ),
    loader=LOADER,
    capabilities=CAPABILITIES,
    checkpoint_tensors=checkpoint_tensors,
    profiles=(MINICPM5_1B_PROFILE,),
)


@hookimpl
def loom_plugin_api_version() -> str:
    return PLUGIN_API_VERSION


@hookimpl
def loom_families() -> list[Family]:
    return [FAMILY]
