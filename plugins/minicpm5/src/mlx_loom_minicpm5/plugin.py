"""MiniCPM5 for mlx-loom, declared once: the Llama architecture it is published in.

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

from .config import FINGERPRINT_FIELDS, MiniCPM5Config
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
    ),
    graphs=(
        Graph(
            GRAPH,
            factory=build,
            parallel=plan,
            description="Llama graph on MLX fused ops (attention, RoPE, RMSNorm); any backend.",
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
