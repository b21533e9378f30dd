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

The core's strict loader compares the result with the graph's own parameter
shapes (built lazily, after the config's layer count is held to the
checkpoint's) and lists every difference in one ``WeightsError``;
:func:`checkpoint_tensors` writes the graph's tensors back in the layout
transformers saves (fused experts, the wrapper's ``model.language_model.*``),
which is what the conformance kit writes.
Tensors dropped on purpose: rotary-embedding buffers, clipping statistics
(``input_max`` ...), and key/value weights stored for KV-shared layers (they
never run) — each drop is logged, never silent.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator, Mapping
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlx_loom.nn import (
    Entry,
    Tensor,
    dense_tensors,
    graph_manifest,
    load_checkpoint,
    switch_glu,
)
from mlx_loom.plugin import BuildContext
from mlx_loom_gemma4.config import Gemma3TextConfig, Gemma3WrappedTextConfig, Gemma4TextConfig
from mlx_loom_gemma4.gemma3 import Gemma3Model
from mlx_loom_gemma4.graph import Model
from mlx_loom_gemma4.kernels import SWITCH_GLU

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
        build=lambda: Model(cfg, kernel),
        layers=("model.layers", cfg.num_hidden_layers),
        sanitize=lambda weights: sanitize(weights, cfg),
    )


def _hf_layout(manifest: list[tuple[str, Entry]]) -> Iterator[tuple[str, Entry]]:
    """Undo :func:`sanitize`'s expert split: one fused ``gate_up_proj`` and ``down_proj``."""
    for name, entry in manifest:
        base, stacked, proj = name.partition(".switch_glu.")
        if not stacked:
            yield name, entry
        elif proj == "gate_proj":
            E, inter, hidden = entry.shape
            yield f"{base}.gate_up_proj", Tensor((E, 2 * inter, hidden))
        elif proj == "down_proj":
            yield f"{base}.down_proj", Tensor(entry.shape)
        # up_proj: fused into gate_up_proj above


def checkpoint_tensors(
    config: Mapping[str, Any], dtype: str = "F32"
) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{hf_name: (shape, dtype)}`` for ``config`` (flat ``gemma4_text`` or ``gemma4``)."""
    nested = isinstance(config.get("text_config"), Mapping)
    cfg = Gemma4TextConfig.model_validate(dict(config["text_config"] if nested else config))
    # Shapes only: the expert kernel is never called, so the core's MLX-ops one serves.
    graph = Model(cfg, switch_glu if cfg.enable_moe_block else None)
    out = dense_tensors(_hf_layout(graph_manifest(graph)), dtype)
    if not nested:
        return out
    return {
        ("model.language_model." + n.removeprefix("model.")) if n.startswith("model.") else n: v
        for n, v in out.items()
    }



# --- Gemma 3 -------------------------------------------------------------------------


def build_gemma3(ctx: BuildContext) -> nn.Module:
    """The ``gemma4.gemma3-text`` factory: names are the checkpoint's, so only tied heads
    and rotary buffers need dropping."""
    cfg = ctx.family_config
    assert isinstance(cfg, Gemma3TextConfig)

    def sanitize_gemma3(weights: dict[str, mx.array]) -> dict[str, mx.array]:
        out = {k: v for k, v in weights.items() if "self_attn.rotary_emb" not in k}
        if cfg.tie_word_embeddings:
            # Tied means lm_head *is* embed_tokens; a stored copy is what transformers
            # overwrites at load, so it is ignored here too.
            out.pop("lm_head.weight", None)
        return out

    return load_checkpoint(
        ctx.model_dir,
        ctx.config,
        build=lambda: Gemma3Model(cfg),
        layers=("model.layers", cfg.num_hidden_layers),
        sanitize=sanitize_gemma3,
    )


def gemma3_checkpoint_tensors(
    config: Mapping[str, Any], dtype: str = "F32"
) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{name: (shape, dtype)}`` for a ``gemma3_text`` or ``gemma3`` config.

    A ``gemma3`` wrapper's text tower is written under ``language_model.*``,
    as the published Gemma 3 checkpoints store it (and as mlx-lm reads it).
    """
    nested = isinstance(config.get("text_config"), Mapping)
    schema = Gemma3WrappedTextConfig if nested else Gemma3TextConfig
    cfg = schema.model_validate(dict(config["text_config"] if nested else config))
    out = dense_tensors(graph_manifest(Gemma3Model(cfg)), dtype)
    return {f"language_model.{n}": v for n, v in out.items()} if nested else out
