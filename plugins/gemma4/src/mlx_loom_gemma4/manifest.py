"""The tensors a Hugging Face-layout Gemma 4 checkpoint holds for a config.

The inverse of :mod:`mlx_loom_gemma4.loader`'s name mapping: build the graph
for the config (parameters stay lazy, nothing is computed), list what it
loads, and name each tensor as a Hugging Face checkpoint stores it — MoE
experts as the fused ``experts.gate_up_proj`` / ``experts.down_proj``, and
``model.language_model.*`` for the ``gemma4`` wrapper. The conformance kit
and the benchmarks write random checkpoints from it.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from mlx_loom_gemma4.config import Gemma4TextConfig
from mlx_loom_gemma4.graph import Gemma4TextLM
from mlx_loom_gemma4.kernels import cpu_switch_glu
from mlx_loom_gemma4.loader import expected_tensors

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


def checkpoint_tensors(config: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{hf_name: (shape, "F32")}`` for ``config`` (flat ``gemma4_text`` or ``gemma4``)."""
    wrapper = config.get("model_type") == "gemma4"
    text = config.get("text_config", config) if wrapper else config
    # No forward runs here, so which expert kernel the graph holds does not matter.
    graph = Gemma4TextLM(Gemma4TextConfig.model_validate(dict(text)), kernel=cpu_switch_glu)
    ours = expected_tensors(graph)
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for name, (shape, _) in ours.items():
        if ".switch_glu." in name:
            base = name.split(".switch_glu.")[0]
            if name.endswith("gate_proj.weight"):
                up = ours[f"{base}.switch_glu.up_proj.weight"][0]
                out[f"{base}.gate_up_proj"] = ((shape[0], shape[1] + up[1], shape[2]), "F32")
            elif name.endswith("down_proj.weight"):
                out[f"{base}.down_proj"] = (shape, "F32")
            continue
        out[name] = (shape, "F32")
    if wrapper:
        out = {
            ("model.language_model." + n.removeprefix("model.")) if n.startswith("model.") else n: v
            for n, v in out.items()
        }
    return out
