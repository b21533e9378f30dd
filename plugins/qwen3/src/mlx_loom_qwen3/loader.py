"""A Qwen3 checkpoint in, the graph with its (lazy) weights out — strictly, in either layout.

* **Hugging Face**: every expert is its own tensors
  (``model.layers.N.mlp.experts.E.gate_proj.weight``, ``[out, in]``);
  :func:`sanitize` stacks each projection's experts into the graph's
  ``mlp.switch_mlp.gate_proj.weight`` (``[experts, out, in]``), as mlx-lm's
  ``qwen3_moe`` does. Dense checkpoints only lose what the graph does not read.
* **MLX** (``mlx_lm.convert``, possibly affine-quantized): already stacked;
  nothing changes.

The core's strict loader then compares the result with the tensors the graph
declares (read from the lazily built graph) before any weight is attached:
a missing layer, a stray tensor or a shape that contradicts the config is one
``WeightsError`` listing them. Float tensors must all share the final norm's
dtype (a checkpoint mixing them would compute in whatever dtype promotion
picks); it is refused instead.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
import mlx.core as mx
import mlx.nn as nn

from mlx_loom.nn import Entry, Matrix, graph_checkpoint_tensors, load_checkpoint
from mlx_loom.plugin import BuildContext, WeightsError

from .config import Qwen3Config, Qwen3MoeConfig
from .graph import Model

__all__ = ["SWITCH_GLU", "build", "checkpoint_tensors", "sanitize"]

#: The kernel name the routed experts resolve through (one per backend).
SWITCH_GLU = "qwen3.switch_glu"

_EXPERT = re.compile(
    r"^(model\.layers\.\d+\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$"
)
_SHOW = 10


def _stack_experts(weights: dict[str, mx.array], n: int) -> dict[str, mx.array]:
    """Per-expert tensors stacked per (layer, projection); all experts or a WeightsError."""
    groups: dict[tuple[str, str], dict[int, mx.array]] = {}
    out: dict[str, mx.array] = {}
    for name, value in weights.items():
        m = _EXPERT.match(name)
        if m is None:
            out[name] = value
        else:
            groups.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = value
    problems = []
    for (prefix, proj), experts in sorted(groups.items()):
        # Bounded by what the checkpoint stores, not by n (a config may claim int32 experts).
        wrong = sorted(e for e in experts if e >= n)[:_SHOW]
        shapes = {tuple(v.shape) for v in experts.values()}
        if len(experts) != n or wrong or len(shapes) != 1:
            problems.append(
                f"{prefix}.experts.*.{proj}.weight: {len(experts)} stored"
                + (f", unexpected experts {wrong}" if wrong else "")
                + (f", shapes {sorted(shapes)[:3]}" if len(shapes) > 1 else "")
            )
            continue
        out[f"{prefix}.switch_mlp.{proj}.weight"] = mx.stack([experts[e] for e in range(n)])
    if problems:
        raise WeightsError(
            f"per-expert tensors do not stack into num_experts = {n} of one shape: "
            + "; ".join(problems[:_SHOW]),
            fix="use a complete checkpoint whose expert count matches config.json",
        )
    return out


def sanitize(weights: Mapping[str, mx.array], cfg: Qwen3Config) -> dict[str, mx.array]:
    """Map checkpoint tensors (either layout) to the graph's names and layouts (lazily)."""
    out = {k: v for k, v in weights.items() if not k.endswith("self_attn.rotary_emb.inv_freq")}
    if cfg.tie_word_embeddings:
        # Tied means lm_head *is* embed_tokens; transformers overwrites a stored
        # copy at load, so ignoring it here matches how the checkpoint is meant.
        out.pop("lm_head.weight", None)
    if isinstance(cfg, Qwen3MoeConfig) and any(".mlp.experts." in k for k in out):
        out = _stack_experts(out, cfg.num_experts)
    return out


def to_checkpoint(
    manifest: list[tuple[str, Entry]], cfg: Qwen3Config
) -> Iterator[tuple[str, Entry]]:
    """The graph's stacked experts as Hugging Face stores them: one tensor per expert."""
    for name, entry in manifest:
        prefix, stacked, proj = name.partition(".switch_mlp.")
        if not stacked or not isinstance(entry, Matrix):
            yield name, entry
            continue
        experts, *shape = entry.shape
        for e in range(experts):
            yield f"{prefix}.experts.{e}.{proj}", Matrix(tuple(shape))


def build(ctx: BuildContext) -> nn.Module:
    """The implementations' factory: what :func:`mlx_loom.load` calls."""
    cfg = ctx.family_config
    assert isinstance(cfg, Qwen3Config)
    # The MoE graph declares the expert kernel, so the core resolved it for this backend.
    moe = isinstance(cfg, Qwen3MoeConfig)
    return load_checkpoint(
        ctx.model_dir,
        ctx.config,
        build=lambda: Model(cfg, ctx.kernels[SWITCH_GLU]) if moe else Model(cfg),
        layers=("model.layers", cfg.num_hidden_layers),
        sanitize=lambda weights: sanitize(weights, cfg),
        uniform_dtype_of="model.norm.weight",
    )


def _schema(config: Mapping[str, object]) -> Qwen3Config:
    moe = config.get("model_type") == "qwen3_moe"
    return (Qwen3MoeConfig if moe else Qwen3Config).model_validate(config)


#: The Hugging Face-layout tensors of an unquantized checkpoint for a config
#: (what the conformance kit writes): the graph's, with experts one by one.
checkpoint_tensors = graph_checkpoint_tensors(_schema, Model, to_checkpoint=to_checkpoint)
