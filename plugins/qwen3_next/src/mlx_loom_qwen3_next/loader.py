"""From a checkpoint directory to a graph with its (lazy) weights: names, layouts, strictness.

Checkpoints come in two layouts, told apart by the convolution weight:

* **Hugging Face** (``conv1d.weight`` is torch's ``(C, 1, K)``): experts are
  separate tensors, RMSNorm gains are zero-centred (stored as ``w - 1``) except
  the delta net's gated ``linear_attn.norm``, and multi-token-prediction heads
  (``mtp.*``) ride along. :func:`sanitize` stacks the experts, moves the conv
  axes to MLX's ``(C, K, 1)``, adds 1.0 to the zero-centred gains and drops
  ``mtp.*`` — the same mapping mlx-lm's ``sanitize`` applies.
* **MLX** (already converted, possibly affine-quantized): nothing changes.

Wrapper checkpoints (Qwen3.5's ``model.language_model.*``, mlx-lm's
``language_model.model.*``, a vision tower beside them) reach :func:`sanitize`
already under the text model's names: the core's config view maps them. The
core's strict loader then compares the result with :func:`~.manifest.tensors`
before the graph is built, and attaches the weights lazily (nothing is
evaluated here).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import mlx.core as mx
import mlx.nn as nn

from mlx_loom.nn import load_checkpoint
from mlx_loom.plugin import BuildContext, WeightsError
from mlx_loom_qwen3_next.config import HybridConfig, Qwen3NextConfig
from mlx_loom_qwen3_next.graph import Kernels, Model
from mlx_loom_qwen3_next.manifest import tensors

__all__ = ["build", "is_hf_layout", "sanitize"]

# Gains stored zero-centred by Hugging Face (the gated linear_attn.norm is not).
_ZERO_CENTRED = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)
_FINAL_NORM = "model.norm.weight"
_EXPERT = re.compile(
    r"^(model\.layers\.\d+\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$"
)
_SHOW = 10


def is_hf_layout(weights: Mapping[str, mx.array]) -> bool:
    """True when a conv weight is still in torch's ``(C, 1, K)`` layout."""
    return any(k.endswith("conv1d.weight") and v.shape[-1] != 1 for k, v in weights.items())


def _expert_problem(prefix: str, proj: str, experts: dict[int, mx.array], n: int) -> str | None:
    """Why one projection's per-expert tensors cannot be stacked into ``n`` experts.

    Bounded by what the checkpoint stores, not by ``n`` (which a config may
    set to anything up to int32).
    """
    present = set(experts)
    extra = sorted(e for e in present if e >= n)
    have = len(present) - len(extra)
    missing: list[int] = []
    e = 0
    while e < n and len(missing) < min(_SHOW, n - have):
        if e not in present:
            missing.append(e)
        e += 1
    shapes = {tuple(v.shape) for v in experts.values()}
    if not missing and not extra and len(shapes) == 1:
        return None
    parts = []
    if missing:
        more = " ..." if n - have > len(missing) else ""
        parts.append(f"missing experts {missing}{more} ({have} of num_experts = {n} stored)")
    if extra:
        parts.append(f"unexpected experts {extra[:_SHOW]}")
    if len(shapes) > 1:
        parts.append(f"experts of different shapes {sorted(shapes)[:3]}")
    return f"{prefix}.experts.*.{proj}.weight: " + ", ".join(parts)


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
        problem = _expert_problem(prefix, proj, experts, cfg.num_experts)
        if problem is not None:
            problems.append(problem)
            continue
        rest[f"{prefix}.switch_mlp.{proj}.weight"] = mx.stack(
            [experts[e] for e in range(cfg.num_experts)]
        )
    if problems:
        raise WeightsError(
            f"per-expert tensors do not cover num_experts = {cfg.num_experts}: "
            + "; ".join(problems[:_SHOW]),
            fix="use a complete checkpoint whose expert count matches config.json",
        )
    return rest


def sanitize(weights: Mapping[str, mx.array], cfg: HybridConfig) -> dict[str, mx.array]:
    """Map checkpoint tensors (either layout) to this plugin's names and layouts (lazily)."""
    out = {k: v for k, v in weights.items() if "mtp." not in k}
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    if not is_hf_layout(out):
        return out
    out = _stack_experts(out, cfg)
    for name, value in out.items():
        if name.endswith("conv1d.weight") and value.shape[-1] != 1:
            out[name] = value.moveaxis(2, 1)
        elif value.ndim == 1 and (name.endswith(_ZERO_CENTRED) or name == _FINAL_NORM):
            out[name] = value + 1.0
    return out


def build(ctx: BuildContext) -> nn.Module:
    """The implementations' factory: the graph for the config, the checkpoint attached strictly.

    ``qwen3_next`` configs get the fused-projection graph, ``qwen3_5`` ones
    the split-projection graph (each implementation accepts only its types).
    """
    cfg = ctx.family_config
    assert isinstance(cfg, HybridConfig)
    kernels = Kernels.from_mapping(ctx.kernels)
    return load_checkpoint(
        ctx.model_dir,
        ctx.config,
        manifest=tensors(cfg),
        build=lambda: Model(cfg, kernels, fused=isinstance(cfg, Qwen3NextConfig)),
        sanitize=lambda weights: sanitize(weights, cfg),
    )
