"""Shared helpers of the gpt-oss tests: the tiny config and the Hugging Face layouts.

Checkpoints are written by the core's parity harness (:mod:`mlx_loom.testing.parity`)
from mlx-lm's own ``gpt_oss.Model`` with random weights, in either layout:
**MLX** (its parameters as they are, what ``mlx_lm.convert`` writes; quantized
through mlx-lm's ``quantize_model`` with the model's own recipe: an 8-bit
router) and **Hugging Face** (:func:`hf_layout`: the fused, row-interleaved
``gate_up_proj`` with ``*_bias`` tensors that mlx-lm's ``sanitize`` undoes;
:func:`mxfp4_layout`: the same with MXFP4 ``*_blocks``/``*_scales`` experts,
as OpenAI publishes gpt-oss).

Imported by name (conftest puts this folder on ``sys.path``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlx_loom.testing import parity

TINY: dict[str, Any] = {
    "model_type": "gpt_oss",
    "architectures": ["GptOssForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 256,
    "rms_norm_eps": 1e-5,
    "sliding_window": 8,
    "rope_theta": 150000.0,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "original_max_position_embeddings": 128,
        "truncate": False,
    },
    "layer_types": ["sliding_attention", "full_attention"] * 2,
}


def _interleave(a: mx.array, b: mx.array, axis: int) -> mx.array:
    """Rows (or columns) ``a0, b0, a1, b1, ...`` along ``axis``: Hugging Face's gate_up order."""
    stacked = mx.stack([a, b], axis=axis + 1 if axis >= 0 else axis)
    shape = list(a.shape)
    shape[axis] *= 2
    return stacked.reshape(shape)


def hf_layout(params: dict[str, mx.array]) -> dict[str, mx.array]:
    """mlx-lm's parameters in the fused Hugging Face layout (its ``sanitize`` is the inverse)."""
    out = {}
    for name, value in params.items():
        if ".experts.up_proj." in name:
            continue
        if ".experts.gate_proj." in name:
            up = params[name.replace("gate_proj", "up_proj")]
            if name.endswith(".weight"):
                out[name.replace("gate_proj", "gate_up_proj")] = _interleave(value, up, -2)
            else:
                out[name.replace("gate_proj.bias", "gate_up_proj_bias")] = _interleave(
                    value, up, -1
                )
        elif ".experts.down_proj." in name:
            out[name.replace("down_proj.bias", "down_proj_bias")] = value
        else:
            out[name] = value
    return out


def mxfp4_layout(params: dict[str, mx.array]) -> dict[str, mx.array]:
    """The Hugging Face layout with MXFP4 experts, as OpenAI publishes gpt-oss:
    ``*_blocks`` (uint8 ``[..., in / 32, 16]``) and ``*_scales`` beside the biases."""
    out = {}
    for name, value in hf_layout(params).items():
        if name.endswith(("experts.gate_up_proj.weight", "experts.down_proj.weight")):
            packed, scales = mx.quantize(value, group_size=32, bits=4, mode="mxfp4")
            base = name[: -len(".weight")]
            out[base + "_blocks"] = packed.view(mx.uint8).reshape(*packed.shape[:-1], -1, 16)
            out[base + "_scales"] = scales
        else:
            out[name] = value
    return out


def write(directory: Path, cfg: dict[str, Any], tensors: dict[str, mx.array]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg, indent=1))
    mx.save_safetensors(str(directory / "model.safetensors"), tensors, metadata={"format": "mlx"})
    return directory


def write_tiny(
    directory: Path,
    layout: str,
    *,
    dtype: mx.Dtype = mx.float32,
    bits: int | None = None,
    seed: int = 0,
    **overrides: Any,
) -> Path:
    """The tiny checkpoint in ``layout``: "hf", "mlx" (``bits``: mlx-lm-quantized, affine)
    or "mlx-mxfp4" (``mlx_lm.convert --q-mode mxfp4``: experts and attention in MXFP4,
    the router at 8-bit affine by the model's recipe)."""
    cfg = TINY | overrides
    if layout == "mlx-mxfp4":
        from mlx_lm.utils import quantize_model, save_config, save_model

        model = parity.oracle_model(cfg, dtype=dtype, seed=seed)
        model, cfg = quantize_model(model, dict(cfg), 32, 4, mode="mxfp4")
        save_model(directory, model)
        save_config(cfg, directory / "config.json")
        return directory
    if layout == "hf":
        return parity.write_hf_checkpoint(directory, cfg, dtype=dtype, seed=seed, to_hf=hf_layout)
    return parity.write_mlx_checkpoint(
        directory, cfg, dtype=dtype, seed=seed, bits=bits, group_size=32
    )
