"""Hugging Face / MLX tensor names -> our module tree, loaded strictly and lazily.

Accepted layouts: ``model.layers.N...``, ``model.embed_tokens...`` and
``lm_head.weight`` when the head is untied, as transformers saves them or as
mlx-lm converts them (possibly affine-quantized). A ``gemma4`` wrapper's
``model.language_model.*`` (or mlx-lm's ``language_model.model.*``) names and
its vision/audio towers are the core's config view's business: this loader
sees text-model names only.

HF stores each MoE layer's experts as two fused tensors
(``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``); we
split ``gate_up_proj`` along its second axis into gate (first half) and up.

The core's strict loader compares the result with :func:`~.manifest.tensors`
before the graph exists and lists every difference in one ``WeightsError``.
Tensors dropped on purpose: rotary-embedding buffers, clipping statistics
(``input_max`` ...), and key/value weights stored for KV-shared layers (they
never run) — each drop is logged, never silent.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping

import mlx.core as mx
import mlx.nn as nn

from mlx_loom.nn import load_checkpoint
from mlx_loom.plugin import BuildContext
from mlx_loom_gemma4.config import Gemma4TextConfig
from mlx_loom_gemma4.graph import Model
from mlx_loom_gemma4.kernels import SWITCH_GLU
from mlx_loom_gemma4.manifest import tensors

logger = logging.getLogger("mlx_loom_gemma4")

_UNUSED_MARKERS = ("self_attn.rotary_emb", "input_max", "input_min", "output_max", "output_min")
_SHARED_KV_PARTS = (".self_attn.k_proj", ".self_attn.v_proj", ".self_attn.k_norm")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def sanitize(weights: Mapping[str, mx.array], cfg: Gemma4TextConfig) -> dict[str, mx.array]:
    """Map text-model tensors (``model.*``, ``lm_head.*``) to our names (lazily)."""
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
        if name.endswith(".experts.gate_up_proj") and value.shape[-2] % 2 == 0:
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


def build(ctx: BuildContext) -> nn.Module:
    """The implementation's factory: the graph for the config, the checkpoint attached strictly."""
    cfg = ctx.family_config
    assert isinstance(cfg, Gemma4TextConfig)
    kernel = ctx.kernels[SWITCH_GLU] if cfg.enable_moe_block else None
    return load_checkpoint(
        ctx.model_dir,
        ctx.config,
        manifest=tensors(cfg),
        build=lambda: Model(cfg, kernel),
        sanitize=lambda weights: sanitize(weights, cfg),
    )
