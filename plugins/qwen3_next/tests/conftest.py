"""Tiny random Qwen3-Next / Qwen3.5 checkpoints in Hugging Face layout, and ways to load them.

Geometry (hidden 64, 4 layers, attention every 2nd layer, 4 experts top-2,
vocab 256) exercises both layer kinds, MoE and dense MLPs, grouped value heads
(Hv = 2 Hk) and partial RoPE while keeping every test well under a second per
forward on a shared CPU.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlx_loom.host import resolve_model
from mlx_loom.testing.oracle import oracle_options
from mlx_loom.loader import build_model
from mlx_loom_qwen3_next.graph import Model
from mlx_loom_qwen3_next.plugin import TINY_CONFIG

# The plugin's own tiny config, with head_dim 16 (more heads per byte) and an EOS id.
QWEN3_NEXT_CONFIG: dict[str, Any] = {**TINY_CONFIG, "head_dim": 16, "eos_token_id": 255}

QWEN3_5_TEXT = {
    k: v
    for k, v in QWEN3_NEXT_CONFIG.items()
    if k
    not in {
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
} | {
    "model_type": "qwen3_5_text",
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [1, 1, 0],
    },
}
QWEN3_5_CONFIG: dict[str, Any] = {
    "model_type": "qwen3_5",
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "text_config": QWEN3_5_TEXT,
    "eos_token_id": 255,
}


def _hf_tensors(cfg: dict[str, Any], seed: int, mtp: bool = False) -> dict[str, np.ndarray]:
    """Random weights named and shaped as a Hugging Face checkpoint stores them;
    ``mtp``: with a whole multi-token-prediction head (else one stray ``mtp.`` tensor)."""
    t = cfg.get("text_config", cfg)
    rng = np.random.default_rng(seed)
    D, V = t["hidden_size"], t["vocab_size"]
    H, KV, hd = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
    nk, nv, dk, dv = (
        t["linear_num_key_heads"],
        t["linear_num_value_heads"],
        t["linear_key_head_dim"],
        t["linear_value_head_dim"],
    )
    K = t["linear_conv_kernel_dim"]
    conv = 2 * nk * dk + nv * dv
    split = cfg["model_type"] != "qwen3_next"
    prefix = "model.language_model." if "text_config" in cfg else "model."

    def w(*shape: int, scale: float | None = None) -> np.ndarray:
        s = scale if scale is not None else shape[-1] ** -0.5
        return (rng.standard_normal(shape) * s).astype(np.float32)

    def zero_centred(n: int) -> np.ndarray:  # stored as gain - 1
        return (rng.standard_normal(n) * 0.1).astype(np.float32)

    out = {
        f"{prefix}embed_tokens.weight": w(V, D, scale=0.5),
        f"{prefix}norm.weight": zero_centred(D),
    }
    if not t.get("tie_word_embeddings", False):
        out["lm_head.weight"] = w(V, D)
    interval = t["full_attention_interval"]
    n_exp = t.get("num_experts", 0)

    def layer(p: str, i: int, attention: bool) -> None:
        out[p + "input_layernorm.weight"] = zero_centred(D)
        out[p + "post_attention_layernorm.weight"] = zero_centred(D)
        if not attention:
            la = p + "linear_attn."
            if split:
                out[la + "in_proj_qkv.weight"] = w(conv, D)
                out[la + "in_proj_z.weight"] = w(nv * dv, D)
                out[la + "in_proj_b.weight"] = w(nv, D)
                out[la + "in_proj_a.weight"] = w(nv, D)
            else:
                out[la + "in_proj_qkvz.weight"] = w(2 * nk * dk + 2 * nv * dv, D)
                out[la + "in_proj_ba.weight"] = w(2 * nv, D)
            out[la + "conv1d.weight"] = w(conv, 1, K, scale=0.5)
            out[la + "dt_bias"] = np.ones(nv, np.float32) + w(nv, scale=0.1)
            out[la + "A_log"] = np.log(rng.uniform(1, 16, nv)).astype(np.float32)
            out[la + "norm.weight"] = np.ones(dv, np.float32) + w(dv, scale=0.1)
            out[la + "out_proj.weight"] = w(D, nv * dv)
        else:
            sa = p + "self_attn."
            out[sa + "q_proj.weight"] = w(2 * H * hd, D)
            out[sa + "k_proj.weight"] = w(KV * hd, D)
            out[sa + "v_proj.weight"] = w(KV * hd, D)
            out[sa + "o_proj.weight"] = w(D, H * hd)
            out[sa + "q_norm.weight"] = zero_centred(hd)
            out[sa + "k_norm.weight"] = zero_centred(hd)
        sparse = (
            not split
            and n_exp > 0
            and i not in t.get("mlp_only_layers", [])
            and (i + 1) % t.get("decoder_sparse_step", 1) == 0
        )
        m = p + "mlp."
        if sparse:
            inter, shared = t["moe_intermediate_size"], t["shared_expert_intermediate_size"]
            out[m + "gate.weight"] = w(n_exp, D)
            for e in range(n_exp):
                out[m + f"experts.{e}.gate_proj.weight"] = w(inter, D)
                out[m + f"experts.{e}.up_proj.weight"] = w(inter, D)
                out[m + f"experts.{e}.down_proj.weight"] = w(D, inter)
            out[m + "shared_expert.gate_proj.weight"] = w(shared, D)
            out[m + "shared_expert.up_proj.weight"] = w(shared, D)
            out[m + "shared_expert.down_proj.weight"] = w(D, shared)
            out[m + "shared_expert_gate.weight"] = w(1, D)
        else:
            dense = t["intermediate_size"]
            out[m + "gate_proj.weight"] = w(dense, D)
            out[m + "up_proj.weight"] = w(dense, D)
            out[m + "down_proj.weight"] = w(D, dense)

    for i in range(t["num_hidden_layers"]):
        layer(f"{prefix}layers.{i}.", i, attention=(i + 1) % interval == 0)
    if not mtp:
        out["mtp.fc.weight"] = w(D, 2 * D)  # a stray MTP tensor: dropped on load
    else:  # the whole multi-token-prediction head: one attention layer with layer 0's MLP
        out["mtp.fc.weight"] = w(D, 2 * D)
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            out[f"mtp.{name}.weight"] = zero_centred(D)
        layer("mtp.layers.0.", 0, attention=True)
    if split:
        out["model.visual.patch_embed.weight"] = w(8, 8)  # vision tower: dropped on load
    return out


def with_mtp(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` declaring one MTP layer, under each model type's own field name."""
    if "text_config" in cfg:
        return {**cfg, "text_config": {**cfg["text_config"], "mtp_num_hidden_layers": 1}}
    return {**cfg, "num_nextn_predict_layers": 1}


def write_checkpoint(
    path: Path,
    cfg: dict[str, Any],
    *,
    seed: int = 0,
    dtype: mx.Dtype = mx.float32,
    round_to: mx.Dtype | None = None,
    drop: tuple[str, ...] = (),
    mtp: bool = False,
) -> Path:
    """Write ``cfg`` and random HF-layout tensors; ``round_to`` first rounds them to that dtype;
    ``mtp``: with a multi-token-prediction head (and the config field that declares it)."""
    path.mkdir(parents=True, exist_ok=True)
    if mtp:
        cfg = with_mtp(cfg)
    tensors = {}
    for k, v in _hf_tensors(cfg, seed, mtp).items():
        if k in drop:
            continue
        a = mx.array(v)
        tensors[k] = (a.astype(round_to) if round_to is not None else a).astype(dtype)
    mx.save_safetensors(str(path / "model.safetensors"), tensors, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    return path


def load_ours(path: Path) -> Model:
    """The plugin's graph as ``mlx_loom.load`` builds it (core resolution, kernels, loader)."""
    # The checkpoint's dtype on MLX operations: the oracle's own arithmetic, so
    # parity is bit-equal (the CPU compute paths have their own parity tests).
    return build_model(resolve_model(path, **oracle_options())).module


def load_reference(path: Path):
    from mlx_lm.utils import load_model as lm_load

    model, _ = lm_load(path)
    return model


def quantize_checkpoint(src: Path, dst: Path, *, group_size: int = 32, bits: int = 4) -> Path:
    """An MLX affine-quantized checkpoint made from ``src`` with mlx-lm's own converter."""
    from mlx_lm.utils import load_model as lm_load
    from mlx_lm.utils import quantize_model, save_config, save_model

    model, config = lm_load(src)
    model, config = quantize_model(model, copy.deepcopy(config), group_size, bits)
    dst.mkdir(parents=True, exist_ok=True)
    save_model(dst, model)
    save_config(config, config_path=dst / "config.json")
    return dst


@pytest.fixture(scope="session")
def ckpt_dir(tmp_path_factory) -> Callable[..., Path]:
    """``ckpt_dir(kind)`` -> a cached checkpoint dir: qwen3_next / qwen3_5, fp32 / q4 / bf16;
    a family suffixed ``_mtp`` (``qwen3_next_mtp-fp32``) ships a multi-token-prediction head."""
    cache: dict[str, Path] = {}
    root = tmp_path_factory.mktemp("qwen3_next_ckpts")

    def get(kind: str) -> Path:
        if kind not in cache:
            family, _, fmt = kind.partition("-")
            mtp = family.endswith("_mtp")  # with a multi-token-prediction head
            family = family.removesuffix("_mtp")
            cfg = {
                "qwen3_next": QWEN3_NEXT_CONFIG,
                "qwen3_5": QWEN3_5_CONFIG,
                # head_dim 32: KV quantization needs group size (>= 32) to divide head_dim
                "qwen3_next_hd32": {**QWEN3_NEXT_CONFIG, "head_dim": 32},
            }[family]
            if fmt in ("", "fp32"):
                cache[kind] = write_checkpoint(root / kind, cfg, seed=1, mtp=mtp)
            elif fmt == "bf16":
                cache[kind] = write_checkpoint(root / kind, cfg, seed=1, dtype=mx.bfloat16)
            elif fmt == "bf16weights-fp32":  # the bf16 checkpoint's values, stored in fp32
                cache[kind] = write_checkpoint(root / kind, cfg, seed=1, round_to=mx.bfloat16)
            elif fmt == "q4":
                cache[kind] = quantize_checkpoint(get(f"{family}-fp32"), root / kind)
            else:
                raise ValueError(kind)
        return cache[kind]

    return get


@pytest.fixture(scope="session")
def loaders(ckpt_dir) -> Callable[[str], tuple[Model, Any]]:
    """``loaders(kind)`` -> (our model, mlx-lm's model) for the same checkpoint, cached."""
    cache: dict[str, tuple[Model, Any]] = {}

    def get(kind: str):
        if kind not in cache:
            path = ckpt_dir(kind)
            cache[kind] = (load_ours(path), load_reference(path))
        return cache[kind]

    return get


@pytest.fixture(scope="session")
def qn():
    """The helpers above, for test modules (conftest is not importable under importlib mode)."""
    import types

    return types.SimpleNamespace(
        QWEN3_NEXT_CONFIG=QWEN3_NEXT_CONFIG,
        QWEN3_5_CONFIG=QWEN3_5_CONFIG,
        write_checkpoint=write_checkpoint,
        with_mtp=with_mtp,
        load_ours=load_ours,
        load_reference=load_reference,
        quantize_checkpoint=quantize_checkpoint,
    )
