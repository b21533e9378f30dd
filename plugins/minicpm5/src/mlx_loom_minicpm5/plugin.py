"""What this plugin registers with mlx-loom: one model type, one implementation, two profiles.

Entry point: ``[project.entry-points.mlx_loom] minicpm5 = "mlx_loom_minicpm5.plugin"``.
The family needs no custom kernels: attention, RoPE and RMSNorm are MLX's
fused ops, which run on every backend, so ``loom_kernels`` is not implemented.
"""

from __future__ import annotations

from mlx_loom.hookspecs import PLUGIN_API_VERSION, hookimpl
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

from .config import FINGERPRINT_FIELDS, MiniCPM5Config
from .loader import build
from .manifest import checkpoint_tensors

MODEL_TYPE = "llama"
GRAPH = "minicpm5.llama"
LOADER = "minicpm5.hf-safetensors"

# Full caches trim exactly, so prompt caching and speculation are sound; a
# sliding-window cache that has wrapped refuses to trim (never trims wrongly).
CAPABILITIES = frozenset({GENERATE, BATCH, PROMPT_CACHE, KV_QUANTIZATION, SPECULATIVE, ADAPTERS})

IMPLEMENTATION = Implementation(
    id="minicpm5.llama.mlx",
    graph=GRAPH,
    loader=LOADER,
    model_types=frozenset({MODEL_TYPE}),
    factory=build,
    capabilities=CAPABILITIES,
    description="Llama graph on MLX fused ops (attention, RoPE, RMSNorm); any backend.",
)

FAMILY_PROFILE = Profile(
    id="minicpm5/llama",
    model_types=frozenset({MODEL_TYPE}),
    execution=Execution(graph=GRAPH, loader=LOADER),
    capabilities=CAPABILITIES,
    description="Any Llama-architecture checkpoint (LlamaForCausalLM).",
)

# openbmb/MiniCPM5-1B, bf16: hidden 1536, intermediate 4608, 24 layers, 16 heads,
# 2 KV heads, head_dim 128, vocab 130560, untied lm_head. Intermediate size and
# untied head follow from the published counts (1,080,632,832 parameters,
# 679,552,512 non-embedding). Both fingerprints are derived, not downloaded:
# config = config_fingerprint over FINGERPRINT_FIELDS of that config;
# artifact = artifact_fingerprint of manifest.checkpoint_tensors(config, "BF16").
# tests/test_profiles.py recomputes them.
MINICPM5_1B_PROFILE = Profile(
    id="minicpm5/minicpm5-1b",
    model_types=frozenset({MODEL_TYPE}),
    execution=Execution(
        graph=GRAPH, loader=LOADER, specialization="artifact", implementation=IMPLEMENTATION.id
    ),
    config_fingerprint="sha256:543c14a0bd2bfbce1bda4a427455f705e666114c0f6c421f7ced2f59fadf12b6",
    artifact_fingerprint="sha256:b2f5ca8d8f115370abc5d28e3af4d750b09854eedf2a3c6d0dcae44af054d447",
    capabilities=CAPABILITIES,
    description="openbmb/MiniCPM5-1B in bf16.",
)


# A small but complete config: what the conformance kit builds tiny checkpoints from.
TINY_CONFIG = {
    "model_type": MODEL_TYPE,
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


@hookimpl
def loom_plugin_api_version() -> str:
    return PLUGIN_API_VERSION


@hookimpl
def loom_model_types() -> list[ModelType]:
    return [
        ModelType(
            name=MODEL_TYPE,
            schema=MiniCPM5Config,
            fingerprint_fields=FINGERPRINT_FIELDS,
            description="Llama architecture (MiniCPM5 is published as model_type 'llama').",
            tiny_config=TINY_CONFIG,
            checkpoint_tensors=checkpoint_tensors,
        )
    ]


@hookimpl
def loom_implementations() -> list[Implementation]:
    return [IMPLEMENTATION]


@hookimpl
def loom_profiles() -> list[Profile]:
    return [FAMILY_PROFILE, MINICPM5_1B_PROFILE]
