"""From a checkpoint directory to a graph with its (lazy) weights: names, layouts, strictness.

Checkpoints come in two layouts, told apart by the convolution weight:

* **Hugging Face** (``conv1d.weight`` is torch's ``(C, 1, K)``): experts are
  separate tensors (Qwen3-Next, Qwen3.5) or one fused ``experts.gate_up_proj``
  and ``experts.down_proj`` per layer (Qwen3.5-MoE), RMSNorm gains are zero-centred (stored as ``w - 1``) except
  the delta net's gated ``linear_attn.norm``, and multi-token-prediction heads
  (``mtp.*``) ride along. :func:`sanitize` stacks the experts, moves the conv
  axes to MLX's ``(C, K, 1)`` and adds 1.0 to the zero-centred gains — the
  same mapping mlx-lm's ``sanitize`` applies — and keeps ``mtp.*`` (mapped
  the same way) only when the graph has an MTP head (mlx-lm always drops it).
  :func:`checkpoint_tensors` is the inverse for the conformance kit: the
  graph's own tensors (read from the lazily built graph) written back in
  this layout.
* **MLX** (already converted, possibly affine-quantized): nothing changes.

The MTP head is built, and its tensors loaded, whenever the checkpoint holds
``mtp.*`` tensors and its config declares exactly one MTP layer
(:func:`mtp_missing`): it costs one decoder layer and a ``2d x d`` projection
of memory (about 1/``num_hidden_layers`` of the layers' weights) whether or
not a request drafts with it. Loading it only when asked would need a second
load, or weights left lazy until a request on the engine thread, where a
graph built on the loading thread cannot be evaluated; one layer is the
cheaper price. Otherwise ``mtp.*`` is dropped, as before, and drafting with
MTP is refused naming why.
Wrapper checkpoints (Qwen3.5's ``model.language_model.*``, mlx-lm's
``language_model.model.*``, a vision tower beside them) reach :func:`sanitize`
already under the text model's names: the core's config view maps them. The
core's strict loader then compares the result with the graph's own parameter
shapes (the tensor rule is the graph) and attaches the weights lazily
(nothing is evaluated here).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

import mlx.core as mx

from mlx_loom.nn import Entry, Matrix, Tensor, dense_tensors, graph_manifest, load_checkpoint
from mlx_loom.plugin import BuildContext, WeightsError
from mlx_loom_qwen3_next.config import HybridConfig, Qwen3_5Config, Qwen3NextConfig
from mlx_loom_qwen3_next.graph import NO_MTP_WEIGHTS, Kernels, Model
from mlx_loom_qwen3_next.kernels import ops_kernels

__all__ = ["build", "checkpoint_tensors", "is_hf_layout", "mtp_missing", "sanitize"]

# Gains stored zero-centred by Hugging Face (the gated linear_attn.norm is not).
_ZERO_CENTRED = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)
_FINAL_NORMS = (
    "model.norm.weight",
    "mtp.norm.weight",
    "mtp.pre_fc_norm_hidden.weight",
    "mtp.pre_fc_norm_embedding.weight",
)
_EXPERT = re.compile(
    r"^((?:model|mtp)\.layers\.\d+\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$"
)
_FUSED_EXPERTS = re.compile(
    r"^((?:model|mtp)\.layers\.\d+\.mlp)\.experts\.(gate_up_proj|down_proj)$"
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


def _split_fused_experts(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Qwen3.5-MoE's fused experts: ``gate_up_proj [E, 2I, D]`` halves into gate and up."""
    out: dict[str, mx.array] = {}
    for name, value in weights.items():
        m = _FUSED_EXPERTS.match(name)
        if m is None:
            out[name] = value
        elif m.group(2) == "down_proj":
            out[f"{m.group(1)}.switch_mlp.down_proj.weight"] = value
        elif value.ndim != 3 or value.shape[-2] % 2:
            raise WeightsError(
                f"{name}: shape {tuple(value.shape)} is not [experts, 2 * moe_intermediate_size, "
                "hidden_size]",
                fix="use the checkpoint as published (its fused experts are gate then up)",
            )
        else:
            mid = value.shape[-2] // 2
            out[f"{m.group(1)}.switch_mlp.gate_proj.weight"] = value[..., :mid, :]
            out[f"{m.group(1)}.switch_mlp.up_proj.weight"] = value[..., mid:, :]
    return out


def mtp_missing(weights: Mapping[str, Any], cfg: HybridConfig) -> str | None:
    """Why this checkpoint's graph gets no MTP head (``None``: it gets one)."""
    if not any(k.startswith("mtp.") for k in weights):
        return NO_MTP_WEIGHTS
    n = cfg.mtp_layers
    qwen3_next = isinstance(cfg, Qwen3NextConfig)
    field = "num_nextn_predict_layers" if qwen3_next else "mtp_num_hidden_layers"
    if n == 0:
        return f"config.json declares no MTP layers ({field} is 0 or absent): mtp.* is not loaded"
    if n > 1:
        return f"config.json declares {n} MTP layers ({field}); drafting supports exactly one"
    return None


def sanitize(
    weights: Mapping[str, mx.array], cfg: HybridConfig, *, mtp: bool = False
) -> dict[str, mx.array]:
    """Map checkpoint tensors (either layout) to this plugin's names and layouts (lazily).

    ``mtp``: keep the ``mtp.*`` head (the graph has one); otherwise it is dropped.
    """
    out = {k: v for k, v in weights.items() if (mtp and k.startswith("mtp.")) or "mtp." not in k}
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    if not is_hf_layout(out):
        return out
    out = _stack_experts(_split_fused_experts(out), cfg)
    for name, value in out.items():
        if name.endswith("conv1d.weight") and value.shape[-1] != 1:
            out[name] = value.moveaxis(2, 1)
        elif value.ndim == 1 and (name.endswith(_ZERO_CENTRED) or name in _FINAL_NORMS):
            out[name] = value + 1.0
    return out


def build(ctx: BuildContext) -> Model:
    """The implementations' factory: the graph for the config, the checkpoint attached strictly.

    ``qwen3_next`` configs get the fused-projection graph, ``qwen3_5`` ones
    the split-projection graph (each implementation accepts only its types).
    """
    cfg = ctx.family_config
    assert isinstance(cfg, HybridConfig)
    kernels = Kernels.from_mapping(ctx.kernels)
    # The core sanitizes before it builds: the names decide whether the graph has a head.
    missing: list[str | None] = [NO_MTP_WEIGHTS]

    def sanitize_names(weights: dict[str, mx.array]) -> dict[str, mx.array]:
        missing[0] = mtp_missing(weights, cfg)
        return sanitize(weights, cfg, mtp=missing[0] is None)

    return load_checkpoint(
        ctx.model_dir,
        ctx.config,
        build=lambda: Model(
            cfg, kernels, fused=isinstance(cfg, Qwen3NextConfig), mtp_missing=missing[0]
        ),
        layers=("model.layers", cfg.num_hidden_layers),
        sanitize=sanitize_names,
    )


# --- the conformance kit's writer: the graph's tensors in the Hugging Face layout ---

_STACKED = re.compile(r"^(.*\.mlp)\.switch_mlp\.(gate_proj|up_proj|down_proj)$")


def _hf_layout(manifest: list[tuple[str, Entry]], fused_experts: bool) -> Iterator[tuple[str, Entry]]:
    """Undo :func:`sanitize`: per-expert (or fused) experts, torch's ``(C, 1, K)`` conv."""
    for name, entry in manifest:
        stacked = _STACKED.match(name)
        if stacked and isinstance(entry, Matrix):
            base, proj = stacked.groups()
            E, *rest = entry.shape
            if not fused_experts:
                for e in range(E):
                    yield f"{base}.experts.{e}.{proj}", Matrix(tuple(rest))
            elif proj == "gate_proj":  # gate and up stored as one [E, 2I, D] tensor
                yield f"{base}.experts.gate_up_proj", Tensor((E, 2 * rest[0], rest[1]))
            elif proj == "down_proj":
                yield f"{base}.experts.down_proj", Tensor(entry.shape)
        elif name.endswith("conv1d.weight"):
            C, K, _ = entry.shape
            yield name, Tensor((C, 1, K))
        else:
            yield name, entry


def checkpoint_tensors(config: Mapping[str, Any], dtype: str = "F32") -> dict[str, tuple[tuple[int, ...], str]]:
    """``{hf_name: (shape, dtype)}`` of an unquantized Hugging Face checkpoint for ``config``.

    Any of the family's model types, flat or inside a ``text_config`` wrapper
    (whose tensors then live under ``model.language_model.*``); with the
    ``mtp.*`` head when the config declares one MTP layer.
    """
    nested = isinstance(config.get("text_config"), Mapping)
    text = dict(config["text_config"] if nested else config)
    qwen3_next = config.get("model_type") == "qwen3_next"
    cfg = (Qwen3NextConfig if qwen3_next else Qwen3_5Config).model_validate(text)
    # Shapes only: the kernels are never called, so the MLX-ops set serves.
    ops = Kernels.from_mapping({k.name: k.fn for k in ops_kernels() if k.backend == "cpu"})
    head = None if cfg.mtp_layers == 1 else NO_MTP_WEIGHTS
    graph = Model(cfg, ops, fused=qwen3_next, mtp_missing=head)
    fused = str(config.get("model_type", "")).startswith("qwen3_5_moe")
    hf = dense_tensors(_hf_layout(graph_manifest(graph), fused), dtype)
    if not nested:
        return hf
    return {
        ("model.language_model." + n.removeprefix("model.")) if n.startswith("model.") else n: v
        for n, v in hf.items()
    }
