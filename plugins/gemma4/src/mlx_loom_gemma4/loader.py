"""Hugging Face / MLX tensor names -> our module tree, and strict loading.

Accepted layouts:

* ``gemma4_text``, HF or MLX: ``model.layers.N...``, ``model.embed_tokens...``,
  ``lm_head.weight`` when the head is untied.
* ``gemma4`` (multimodal wrapper), HF: ``model.language_model.X`` -> our
  ``language_model.model.X``; ``lm_head.*`` -> ``language_model.lm_head.*``;
  the vision and audio towers (``model.vision_tower`` ...) are dropped with one
  logged notice naming how many tensors went. MLX-converted wrapper
  checkpoints already use ``language_model.model.X``.

HF stores each MoE layer's experts as two fused tensors
(``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``); we
split ``gate_up_proj`` along its second axis into gate (first half) and up.

After mapping, the checkpoint must hold exactly the tensors the graph needs
(quantized modules: ``weight`` uint32 + ``scales`` + ``biases``), or loading
fails with one :class:`~mlx_loom.errors.WeightsError` listing every
difference. Tensors we drop on purpose: rotary-embedding buffers, clipping
statistics (``input_max`` ...), and key/value weights stored for KV-shared
layers (they never run) — each drop is logged, never silent.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlx_loom.artifacts import (
    QuantizationConfig,
    apply_quantization,
    check_weights,
    load_weights,
)
from mlx_loom.errors import WeightsError
from mlx_loom_gemma4.config import Gemma4TextConfig
from mlx_loom_gemma4.graph import Gemma4LM, Gemma4TextLM, SwitchGLUKernel

logger = logging.getLogger("mlx_loom_gemma4")

#: Prefixes (after ``model.``) of the multimodal towers a text model does not use.
NON_TEXT_PREFIXES: tuple[str, ...] = (
    "vision_tower",
    "multi_modal_projector",
    "audio_tower",
    "embed_audio",
    "embed_vision",
    "vision_embedder",
)
_UNUSED_MARKERS = ("self_attn.rotary_emb", "input_max", "input_min", "output_max", "output_min")
_SHARED_KV_PARTS = (".self_attn.k_proj", ".self_attn.v_proj", ".self_attn.k_norm")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def sanitize_text(weights: Mapping[str, mx.array], cfg: Gemma4TextConfig) -> dict[str, mx.array]:
    """Map text-model tensors (``model.*``, ``lm_head.*``) to our names."""
    out: dict[str, mx.array] = {}
    unused = shared = 0
    for name, value in weights.items():
        if any(m in name for m in _UNUSED_MARKERS):
            unused += 1
            continue
        layer = _LAYER.search(name)
        if layer and any(p in name for p in _SHARED_KV_PARTS) and cfg.is_shared(int(layer[1])):
            shared += 1
            continue
        if name.endswith(".experts.gate_up_proj"):
            base = name.removesuffix(".gate_up_proj")
            gate, up = mx.split(value, 2, axis=-2)
            out[f"{base}.switch_glu.gate_proj.weight"] = mx.contiguous(gate)
            out[f"{base}.switch_glu.up_proj.weight"] = mx.contiguous(up)
        elif name.endswith(".experts.down_proj"):
            out[f"{name.removesuffix('.down_proj')}.switch_glu.down_proj.weight"] = value
        else:
            out[name] = value
    if unused:
        logger.info(
            "gemma4: dropped %d rotary/clipping-statistics tensor(s) the graph does not use", unused
        )
    if shared:
        logger.info(
            "gemma4: dropped %d key/value tensor(s) stored for KV-shared layers "
            "(those layers read an earlier layer's keys/values)",
            shared,
        )
    return out


def sanitize_wrapper(weights: Mapping[str, mx.array], cfg: Gemma4TextConfig) -> dict[str, mx.array]:
    """Map a ``gemma4`` wrapper checkpoint to ``language_model.*`` names, dropping the towers."""
    text: dict[str, mx.array] = {}
    dropped: dict[str, int] = {}
    for name, value in weights.items():
        hf = name.startswith("model.")
        short = name.removeprefix("model.")
        tower = next((p for p in NON_TEXT_PREFIXES if short.startswith(p)), None)
        if tower is not None:
            dropped[tower] = dropped.get(tower, 0) + 1
            continue
        if hf and short.startswith("language_model."):
            text["model." + short.removeprefix("language_model.")] = value
        elif name.startswith("language_model."):
            text[name.removeprefix("language_model.")] = value
        else:  # lm_head.*, or unknown: kept so the strict check names it
            text[name] = value
    if dropped:
        logger.warning(
            "gemma4: dropped %d non-text tensor(s) (%s); this plugin runs the text model only",
            sum(dropped.values()),
            ", ".join(f"{k}: {v}" for k, v in sorted(dropped.items())),
        )
    return {f"language_model.{k}": v for k, v in sanitize_text(text, cfg).items()}


def expected_tensors(model: nn.Module) -> dict[str, tuple[tuple[int, ...], mx.Dtype | None]]:
    """Every tensor the built (possibly quantized) graph loads: name -> (shape, dtype).

    Packed quantized weights must be uint32; other tensors may be any float
    dtype (checked by :func:`check_float_dtypes`).
    """
    quantized = {path for path, m in model.named_modules() if hasattr(m, "scales")}
    expected: dict[str, tuple[tuple[int, ...], mx.Dtype | None]] = {}
    for name, value in tree_flatten(model.parameters()):
        module, _, leaf = name.rpartition(".")
        packed = module in quantized and leaf == "weight"
        expected[name] = (tuple(value.shape), mx.uint32 if packed else None)
    return expected


def check_float_dtypes(
    weights: Mapping[str, mx.array], expected: Mapping[str, tuple], *, source: Path
) -> None:
    bad = [
        f"{name} {weights[name].dtype}"
        for name, (_, want) in expected.items()
        if want is None and not mx.issubdtype(weights[name].dtype, mx.floating)
    ]
    if bad:
        raise WeightsError(
            f"{source}: {len(bad)} tensor(s) should be floating point: {', '.join(bad[:10])}",
            fix="re-convert the checkpoint; only quantized weights may be integer tensors",
        )


def build(
    model_dir: Path,
    cfg: Gemma4TextConfig,
    *,
    wrapper: bool,
    quantization: QuantizationConfig | None,
    kernel: SwitchGLUKernel | None,
) -> nn.Module:
    """Build the graph and load the checkpoint into it, strictly."""
    model: nn.Module = Gemma4LM(cfg, kernel) if wrapper else Gemma4TextLM(cfg, kernel)
    raw = load_weights(model_dir)
    weights = sanitize_wrapper(raw, cfg) if wrapper else sanitize_text(raw, cfg)
    apply_quantization(model, quantization, weights)
    expected = expected_tensors(model)
    check_weights(weights, expected, source=model_dir)
    check_float_dtypes(weights, expected, source=model_dir)
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    model.eval()
    return model
