"""From a checkpoint directory to a graph with its weights: names, layouts, strictness.

Checkpoints come in two layouts, told apart by the convolution weight:

* **Hugging Face** (``conv1d.weight`` is torch's ``(C, 1, K)``): experts are
  separate tensors, RMSNorm gains are zero-centred (stored as ``w - 1``) except
  the delta net's gated ``linear_attn.norm``, and multi-token-prediction heads
  (``mtp.*``) ride along. :func:`sanitize` stacks the experts, moves the conv
  axes to MLX's ``(C, K, 1)``, adds 1.0 to the zero-centred gains and drops
  ``mtp.*`` — the same mapping mlx-lm's ``sanitize`` applies.
* **MLX** (already converted, possibly affine-quantized): names are mapped,
  nothing else changes.

Qwen3.5 checkpoints may nest the language model (``model.language_model.*``,
or mlx-lm's ``language_model.model.*``) and carry a vision tower; both are
normalised to this plugin's names (``model.*``, ``lm_head.*``) and the vision
tensors dropped. Loading is strict: the sanitized tensors must be exactly the
graph's parameters (after quantized layers are swapped in where the checkpoint
has scales), or one :class:`WeightsError` lists every difference.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_loom.artifacts import (
    QuantizationConfig,
    apply_quantization,
    check_weights,
    load_weights,
)
from mlx_loom.errors import WeightsError
from mlx_loom_qwen3_next.config import HybridConfig
from mlx_loom_qwen3_next.graph import HybridLM, Kernels, build_model

__all__ = ["expected_tensors", "is_hf_layout", "load_model", "sanitize"]

# Gains stored zero-centred by Hugging Face (the gated linear_attn.norm is not).
_ZERO_CENTRED = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)
_FINAL_NORM = "model.norm.weight"
_DROPPED_PREFIXES = ("model.visual.", "visual.", "vision_tower.", "model.vision_tower.")
_EXPERT = re.compile(
    r"^(model\.layers\.\d+\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$"
)


def _rename(name: str) -> str | None:
    """This plugin's name for a checkpoint tensor, or ``None`` to drop it."""
    if "mtp." in name or name.startswith(_DROPPED_PREFIXES):
        return None
    for old, new in (
        ("model.language_model.", "model."),
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
    ):
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def is_hf_layout(weights: Mapping[str, mx.array]) -> bool:
    """True when a conv weight is still in torch's ``(C, 1, K)`` layout."""
    return any(k.endswith("conv1d.weight") and v.shape[-1] != 1 for k, v in weights.items())


def _stack_experts(weights: dict[str, mx.array], cfg: HybridConfig) -> dict[str, mx.array]:
    groups: dict[tuple[str, str], dict[int, mx.array]] = {}
    rest: dict[str, mx.array] = {}
    for name, value in weights.items():
        m = _EXPERT.match(name)
        if m is None:
            rest[name] = value
        else:
            groups.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = value
    problems = []
    for (prefix, proj), experts in sorted(groups.items()):
        want = set(range(cfg.num_experts))
        if set(experts) != want:
            missing = sorted(want - set(experts))
            extra = sorted(set(experts) - want)
            problems.append(
                f"{prefix}.experts.*.{proj}.weight: missing experts {missing}"
                + (f", unexpected experts {extra}" if extra else "")
            )
            continue
        rest[f"{prefix}.switch_mlp.{proj}.weight"] = mx.stack(
            [experts[e] for e in range(cfg.num_experts)]
        )
    if problems:
        raise WeightsError(
            f"per-expert tensors do not cover num_experts = {cfg.num_experts}: "
            + "; ".join(problems[:10]),
            fix="use a complete checkpoint whose expert count matches config.json",
        )
    return rest


def sanitize(weights: Mapping[str, mx.array], cfg: HybridConfig) -> dict[str, mx.array]:
    """Map checkpoint tensors (either layout, either prefix) to this plugin's names."""
    renamed: dict[str, mx.array] = {}
    for name, value in weights.items():
        new = _rename(name)
        if new is not None:
            renamed[new] = value
    if cfg.tie_word_embeddings:
        renamed.pop("lm_head.weight", None)
    if not is_hf_layout(renamed):
        return renamed
    out = _stack_experts(renamed, cfg)
    for name, value in out.items():
        if name.endswith("conv1d.weight") and value.shape[-1] != 1:
            out[name] = value.moveaxis(2, 1)
        elif value.ndim == 1 and (name.endswith(_ZERO_CENTRED) or name == _FINAL_NORM):
            out[name] = value + 1.0
    return out


def expected_tensors(model: HybridLM) -> dict[str, tuple[tuple[int, ...], mx.Dtype | None]]:
    """Name -> (shape, dtype) of every tensor the graph needs.

    Quantized layers need ``uint32`` packed weights; floating tensors may be
    stored in any float dtype (they are used as stored), so their dtype is
    checked for being floating separately.
    """
    out = {}
    for name, value in tree_flatten(model.parameters()):
        dtype = mx.uint32 if value.dtype == mx.uint32 else None
        out[name] = (tuple(value.shape), dtype)
    return out


def _check_float(weights: Mapping[str, mx.array], expected: Mapping[str, tuple], source: Path):
    bad = [
        f"{n} {weights[n].dtype}"
        for n, (_, dtype) in expected.items()
        if dtype is None and not mx.issubdtype(weights[n].dtype, mx.floating)
    ]
    if bad:
        raise WeightsError(
            f"{source}: tensors that must be floating point are not: {', '.join(bad[:10])}",
            fix="use a checkpoint converted for this model type",
        )


def _renamed(quantization: QuantizationConfig | None) -> QuantizationConfig | None:
    """Per-module overrides name modules as the checkpoint does (mlx-lm's Qwen3.5
    writes ``language_model.model.layers.N...``); map them like the tensors."""
    if quantization is None:
        return None
    overrides = {}
    for name, spec in quantization.overrides.items():
        new = _rename(name + ".")  # a module path: renamed as its tensors' common prefix
        if new is not None:
            overrides[new[:-1]] = spec
    return quantization.model_copy(update={"overrides": overrides})


def load_model(
    model_dir: str | os.PathLike[str],
    cfg: HybridConfig,
    kernels: Kernels,
    *,
    fused: bool,
    quantization: QuantizationConfig | None,
) -> HybridLM:
    """Build the graph for ``cfg`` and install the checkpoint's weights, strictly."""
    model_dir = Path(model_dir)
    weights = sanitize(load_weights(model_dir), cfg)
    model = build_model(cfg, kernels, fused=fused)
    apply_quantization(model, _renamed(quantization), weights)
    expected = expected_tensors(model)
    check_weights(weights, expected, source=model_dir)
    _check_float(weights, expected, model_dir)
    model.load_weights(list(weights.items()), strict=True)
    model.eval()
    mx.eval(model.parameters())
    return model
