"""Qwen3 for mlx-loom, declared once: the dense decoder and its routed-expert sibling.

Entry point: ``[project.entry-points.mlx_loom] qwen3 = "mlx_loom_qwen3.plugin"``.
``qwen3`` checkpoints get graph ``qwen3.dense``, ``qwen3_moe`` ones
``qwen3.moe``; the core derives one implementation per graph (id = graph id)
and the family profiles ``qwen3/dense`` and ``qwen3/moe``. The only kernel is
the routed experts' GLU, registered per backend from the core's
:func:`~mlx_loom.nn.expert_kernels`; attention, RoPE and RMSNorm are MLX's
fused ops, which run on every backend.

Qwen3's chat template writes tool calls as ``<tool_call>{json}</tool_call>``
(the core's ``json_tools`` parser) and thinks between ``<think>`` and
``</think>`` (recognised from the template by the core).
"""

from __future__ import annotations

from mlx_loom.nn import expert_kernels
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

from .config import FINGERPRINT_FIELDS, MOE_FINGERPRINT_FIELDS, Qwen3Config, Qwen3MoeConfig
from .loader import SWITCH_GLU, build, checkpoint_tensors
from .parallel import plan

# Full caches trim exactly, so prompt caching and speculation are sound.
CAPABILITIES = frozenset({GENERATE, BATCH, PROMPT_CACHE, KV_QUANTIZATION, SPECULATIVE, ADAPTERS})
# Both graphs touch their caches only through offset, make_mask and append, so
# the core may compile their one-token forward (the routed experts run as
# native gathered products on the native CPU kernel sets, which read nothing
# on the host; a kernel that did would make the step run eager, with the reason).
COMPILED_CAPABILITIES = CAPABILITIES | {COMPILED_STEP}

# Small but complete configs: what the conformance kit builds tiny checkpoints from.
TINY_CONFIG = {
    "model_type": "qwen3",
    "architectures": ["Qwen3ForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,  # KV quantization groups need >= 32
    "vocab_size": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,  # as Qwen3-0.6B ... 4B
}
TINY_MOE_CONFIG = {
    **TINY_CONFIG,
    "model_type": "qwen3_moe",
    "architectures": ["Qwen3MoeForCausalLM"],
    "num_hidden_layers": 3,
    "tie_word_embeddings": False,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [1],  # one dense layer between routed ones
    "norm_topk_prob": True,
}

FAMILY = Family(
    name="qwen3",
    model_types=(
        ModelType(
            name="qwen3",
            schema=Qwen3Config,
            fingerprint_fields=FINGERPRINT_FIELDS,
            description="Qwen3 dense (0.6B ... 32B): GQA with per-head q/k RMSNorm",
            tiny_config=TINY_CONFIG,
            tool_parser="json_tools",
        ),
        ModelType(
            name="qwen3_moe",
            schema=Qwen3MoeConfig,
            fingerprint_fields=MOE_FINGERPRINT_FIELDS,
            description="Qwen3 MoE (30B-A3B, 235B-A22B): top-k routed experts",
            tiny_config=TINY_MOE_CONFIG,
            tool_parser="json_tools",
        ),
    ),
    graphs=(
        Graph(
            "qwen3.dense",
            factory=build,
            model_types=frozenset({"qwen3"}),
            capabilities=COMPILED_CAPABILITIES,
            parallel=plan,
            description="Qwen3 graph on MLX fused ops (attention, RoPE, RMSNorm); any backend",
        ),
        Graph(
            "qwen3.moe",
            factory=build,
            model_types=frozenset({"qwen3_moe"}),
            kernels=(SWITCH_GLU,),
            capabilities=COMPILED_CAPABILITIES,
            parallel=plan,
            description="Qwen3 graph with routed experts (SwitchGLU) on the layers the config "
            "picks",
        ),
    ),
    loader="qwen3.hf-or-mlx",
    capabilities=COMPILED_CAPABILITIES,
    kernels=tuple(expert_kernels(SWITCH_GLU)),
    checkpoint_tensors=checkpoint_tensors,
)


@hookimpl
def loom_plugin_api_version() -> str:
    return PLUGIN_API_VERSION


@hookimpl
def loom_families() -> list[Family]:
    return [FAMILY]
