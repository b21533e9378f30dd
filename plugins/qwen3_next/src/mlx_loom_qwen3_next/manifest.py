"""The tensors a Hugging Face-layout checkpoint holds for a config, and tiny configs.

Names and shapes as the published checkpoints store them (fused
``in_proj_qkvz``/``in_proj_ba`` for ``qwen3_next``, split projections for
``qwen3_5``; per-expert MLP tensors; torch's ``(C, 1, K)`` conv layout). The
conformance kit and the benchmarks write random checkpoints from it; the
loader maps them to this plugin's names.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

Shape = tuple[int, ...]

TINY_QWEN3_NEXT: dict[str, Any] = {
    "model_type": "qwen3_next",
    "architectures": ["Qwen3NextForCausalLM"],
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,  # KV quantization groups need >= 32
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "shared_expert_intermediate_size": 32,
    "mlp_only_layers": [2],
    "moe_intermediate_size": 32,
    "norm_topk_prob": True,
    "rms_norm_eps": 1e-6,
    "vocab_size": 256,
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.25,
    "max_position_embeddings": 4096,
    "full_attention_interval": 2,
    "tie_word_embeddings": False,
}

_MOE_KEYS = {
    "num_experts",
    "num_experts_per_tok",
    "decoder_sparse_step",
    "mlp_only_layers",
    "shared_expert_intermediate_size",
    "moe_intermediate_size",
    "norm_topk_prob",
    "rope_theta",
    "partial_rotary_factor",
    "architectures",
    "model_type",
}

TINY_QWEN3_5_TEXT: dict[str, Any] = {
    k: v for k, v in TINY_QWEN3_NEXT.items() if k not in _MOE_KEYS
} | {
    "model_type": "qwen3_5_text",
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
    },
}

TINY_QWEN3_5: dict[str, Any] = {
    "model_type": "qwen3_5",
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "text_config": copy.deepcopy(TINY_QWEN3_5_TEXT),
}


def checkpoint_tensors(config: Mapping[str, Any]) -> dict[str, tuple[Shape, str]]:
    """``{hf_name: (shape, "F32")}`` for a qwen3_next, qwen3_5 or qwen3_5_text config."""
    t = config.get("text_config", config)
    D, V = t["hidden_size"], t["vocab_size"]
    H, KV = t["num_attention_heads"], t["num_key_value_heads"]
    hd = t.get("head_dim") or D // H
    nk, nv = t["linear_num_key_heads"], t["linear_num_value_heads"]
    dk, dv = t["linear_key_head_dim"], t["linear_value_head_dim"]
    K = t["linear_conv_kernel_dim"]
    conv = 2 * nk * dk + nv * dv
    split = config["model_type"] != "qwen3_next"
    prefix = "model.language_model." if "text_config" in config else "model."
    out: dict[str, Shape] = {f"{prefix}embed_tokens.weight": (V, D), f"{prefix}norm.weight": (D,)}
    if not t.get("tie_word_embeddings", False):
        out["lm_head.weight"] = (V, D)
    n_exp = 0 if split else t.get("num_experts", 0)
    for i in range(t["num_hidden_layers"]):
        p = f"{prefix}layers.{i}."
        out[p + "input_layernorm.weight"] = (D,)
        out[p + "post_attention_layernorm.weight"] = (D,)
        if (i + 1) % t["full_attention_interval"]:
            la = p + "linear_attn."
            if split:
                out |= {
                    la + "in_proj_qkv.weight": (conv, D),
                    la + "in_proj_z.weight": (nv * dv, D),
                    la + "in_proj_b.weight": (nv, D),
                    la + "in_proj_a.weight": (nv, D),
                }
            else:
                out |= {
                    la + "in_proj_qkvz.weight": (2 * nk * dk + 2 * nv * dv, D),
                    la + "in_proj_ba.weight": (2 * nv, D),
                }
            out |= {
                la + "conv1d.weight": (conv, 1, K),
                la + "dt_bias": (nv,),
                la + "A_log": (nv,),
                la + "norm.weight": (dv,),
                la + "out_proj.weight": (D, nv * dv),
            }
        else:
            sa = p + "self_attn."
            out |= {
                sa + "q_proj.weight": (2 * H * hd, D),
                sa + "k_proj.weight": (KV * hd, D),
                sa + "v_proj.weight": (KV * hd, D),
                sa + "o_proj.weight": (D, H * hd),
                sa + "q_norm.weight": (hd,),
                sa + "k_norm.weight": (hd,),
            }
        m = p + "mlp."
        sparse = (
            n_exp > 0
            and i not in t.get("mlp_only_layers", [])
            and (i + 1) % t.get("decoder_sparse_step", 1) == 0
        )
        if sparse:
            inter, shared = t["moe_intermediate_size"], t["shared_expert_intermediate_size"]
            out[m + "gate.weight"] = (n_exp, D)
            for e in range(n_exp):
                out |= {
                    m + f"experts.{e}.gate_proj.weight": (inter, D),
                    m + f"experts.{e}.up_proj.weight": (inter, D),
                    m + f"experts.{e}.down_proj.weight": (D, inter),
                }
            out |= {
                m + "shared_expert.gate_proj.weight": (shared, D),
                m + "shared_expert.up_proj.weight": (shared, D),
                m + "shared_expert.down_proj.weight": (D, shared),
                m + "shared_expert_gate.weight": (1, D),
            }
        else:
            inter = t["intermediate_size"]
            out |= {
                m + "gate_proj.weight": (inter, D),
                m + "up_proj.weight": (inter, D),
                m + "down_proj.weight": (D, inter),
            }
    return {name: (shape, "F32") for name, shape in out.items()}
