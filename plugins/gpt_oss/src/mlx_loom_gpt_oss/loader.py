"""A gpt-oss checkpoint in (Hugging Face or MLX layout), the graph with its weights out.

Two layouts reach this loader, and :func:`sanitize` tells them apart by name:

* **MLX** (what ``mlx_lm.convert`` writes, dense or quantized): the graph's
  own names — ``mlp.experts.gate_proj`` / ``up_proj`` / ``down_proj``, each
  ``[experts, out, in]`` with a ``bias [experts, out]``. Nothing to do.
* **Hugging Face** (as OpenAI publishes it): the gate and up projections
  fused as ``mlp.experts.gate_up_proj [experts, 2 * hidden, in]`` with rows
  *interleaved* (gate, up, gate, up, ...) and ``gate_up_proj_bias``;
  ``down_proj`` with ``down_proj_bias``. Expert weights are stored as MXFP4
  (``*_blocks`` uint8 ``[..., in / 32, 16]`` and ``*_scales``): the blocks
  are reinterpreted as the packed ``uint32`` words MLX's quantized matmul
  reads and renamed ``.weight`` / ``.scales``, with no arithmetic. Dense
  fused experts are read under ``gate_up_proj.weight`` / ``down_proj.weight``,
  the names mlx-lm's ``sanitize`` reads; transformers' bare ``gate_up_proj``
  parameter (stored transposed, ``[experts, in, 2 * hidden]``) is not a
  layout mlx-lm reads either, and is refused by the strict loader.

Everything is lazy (slices and views of the memory-mapped tensors). The
core's strict loader then compares the result with the graph's tensors.
"""

from __future__ import annotations

from collections.abc import Mapping

import mlx.core as mx

from mlx_loom.nn import Entry, Manifest, Matrix, Tensor, graph_checkpoint_tensors, load_checkpoint
from mlx_loom.plugin import BuildContext

from .config import GptOssConfig
from .graph import SWITCH_GLU, Model

_GATE_UP = "gate_up_proj"


def is_hf_layout(weights: Mapping[str, object]) -> bool:
    """Whether the expert tensors are in the fused Hugging Face layout (no ``gate_proj`` yet)."""
    return not any(".experts.gate_proj." in k for k in weights)


def _mxfp4_name(name: str) -> tuple[str, bool]:
    """``X_blocks`` -> ``X.weight`` (and whether it was blocks); ``X_scales`` -> ``X.scales``."""
    if name.endswith("_blocks"):
        return name[: -len("_blocks")] + ".weight", True
    if name.endswith("_scales"):
        return name[: -len("_scales")] + ".scales", False
    return name, False


def sanitize(weights: Mapping[str, mx.array]) -> dict[str, mx.array]:
    """Map a checkpoint's tensors (either layout) to the graph's names and layouts."""
    if not is_hf_layout(weights):
        return dict(weights)
    out: dict[str, mx.array] = {}
    for name, value in weights.items():
        prefix, _, leaf = name.rpartition(".experts.")
        if not prefix or not leaf.startswith((_GATE_UP, "down_proj")):
            out[name] = value
            continue
        base = f"{prefix}.experts."
        if leaf == f"{_GATE_UP}_bias":
            out[base + "gate_proj.bias"] = mx.contiguous(value[..., ::2])
            out[base + "up_proj.bias"] = mx.contiguous(value[..., 1::2])
        elif leaf == "down_proj_bias":
            out[base + "down_proj.bias"] = value
        else:
            renamed, blocks = _mxfp4_name(leaf)
            if blocks:  # [..., in / 32, 16] bytes -> [..., in / 8] uint32 words
                value = value.view(mx.uint32).flatten(-2)
            if leaf.startswith(_GATE_UP):
                # Rows alternate gate, up: split on the output axis.
                gate, up = value[..., ::2, :], value[..., 1::2, :]
                out[base + renamed.replace(_GATE_UP, "gate_proj")] = mx.contiguous(gate)
                out[base + renamed.replace(_GATE_UP, "up_proj")] = mx.contiguous(up)
            else:
                out[base + renamed] = value
    return out


def build(ctx: BuildContext) -> Model:
    """The implementation's factory: what :func:`mlx_loom.load` calls."""
    cfg = ctx.family_config
    assert isinstance(cfg, GptOssConfig)
    return load_checkpoint(
        ctx.model_dir,
        ctx.config,
        build=lambda: Model(cfg, ctx.kernels),
        layers=("model.layers", cfg.num_hidden_layers),
        sanitize=sanitize,
    )


def to_hf(manifest: list[tuple[str, Entry]], cfg: GptOssConfig) -> Manifest:
    """The graph's tensors in the Hugging Face layout (:func:`sanitize` is the inverse)."""
    out: list[tuple[str, Entry]] = []
    for name, entry in manifest:
        prefix, _, proj = name.rpartition(".experts.")
        if not prefix or not isinstance(entry, Matrix):
            out.append((name, entry))
        elif proj == "gate_proj":
            E, hidden, dims = entry.shape
            out.append((f"{prefix}.experts.{_GATE_UP}.weight", Tensor((E, 2 * hidden, dims))))
            out.append((f"{prefix}.experts.{_GATE_UP}_bias", Tensor((E, 2 * hidden))))
        elif proj == "down_proj":
            out.append((f"{prefix}.experts.down_proj.weight", Tensor(entry.shape)))
            out.append((f"{prefix}.experts.down_proj_bias", Tensor(entry.shape[:-1])))
        # up_proj is half of gate_up_proj: written with the gate.
    return out


def _graph(cfg: GptOssConfig) -> Model:
    return Model(cfg, {SWITCH_GLU: lambda *args: None})


#: The Hugging Face-layout tensors of an unquantized checkpoint for a config
#: (what the conformance kit writes).
checkpoint_tensors = graph_checkpoint_tensors(
    GptOssConfig.model_validate, _graph, to_checkpoint=to_hf
)
