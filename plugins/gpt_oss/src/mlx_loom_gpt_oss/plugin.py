"""gpt-oss for mlx-loom, declared once: one model type, one graph, the expert kernels.

Entry point: ``[project.entry-points.mlx_loom] gpt_oss = "mlx_loom_gpt_oss.plugin"``.
The core derives implementation ``gpt_oss.moe`` and family profile
``gpt_oss/moe`` from :data:`FAMILY`. Attention (with sinks), RoPE and RMSNorm
are MLX's fused ops; the routed experts run the core's per-backend expert
kernels (``mlx_loom.nn.expert_kernels``).
"""

from __future__ import annotations

from mlx_loom.nn import expert_kernels
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

from .config import FINGERPRINT_FIELDS, GptOssConfig
from .graph import SWITCH_GLU
from .loader import build, checkpoint_tensors
from .parallel import plan

GRAPH = "gpt_oss.moe"
LOADER = "gpt_oss.hf-or-mlx"

# Full caches trim exactly; a window cache that has wrapped refuses to trim
# (never trims wrongly), so speculation and prompt reuse stay sound on the
# sliding layers. KV quantization: the TurboQuant codec attends with sinks;
# the affine codec refuses them by name (as mlx-lm's quantized attention does).
CAPABILITIES = frozenset({GENERATE, BATCH, PROMPT_CACHE, KV_QUANTIZATION, SPECULATIVE, ADAPTERS})

# A small but complete config: what the conformance kit builds tiny checkpoints from.
TINY_CONFIG = {
    "model_type": "gpt_oss",
    "architectures": ["GptOssForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,  # KV quantization groups need >= 32
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "vocab_size": 256,
    "rms_norm_eps": 1e-5,
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "full_attention"],
    "max_position_embeddings": 512,
    "rope_theta": 150000.0,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "original_max_position_embeddings": 128,
    },
}

FAMILY = Family(
    name="gpt_oss",
    model_types=(
        ModelType(
            name="gpt_oss",
            schema=GptOssConfig,
            fingerprint_fields=FINGERPRINT_FIELDS,
            description="gpt-oss: attention sinks, alternating window/full layers, biased MoE",
            tiny_config=TINY_CONFIG,
            tool_parser="harmony",
        ),
    ),
    graphs=(
        Graph(
            GRAPH,
            factory=build,
            kernels=(SWITCH_GLU,),
            parallel=plan,
            description="gpt-oss on MLX fused ops (attention with sinks, YaRN RoPE, RMSNorm) "
            "and the core's routed-expert kernels",
        ),
    ),
    loader=LOADER,
    capabilities=CAPABILITIES,
    kernels=tuple(expert_kernels(SWITCH_GLU)),
    checkpoint_tensors=checkpoint_tensors,
)


@hookimpl
def loom_plugin_api_version() -> str:
    return PLUGIN_API_VERSION


@hookimpl
def loom_families() -> list[Family]:
    return [FAMILY]
