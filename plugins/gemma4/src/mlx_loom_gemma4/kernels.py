"""The expert (MoE) kernel, per backend, and the small fused activations the graph shares.

Kernel ``gemma4.switch_glu`` computes, for every token and each of its top-k
experts, ``down_e(gelu_tanh(gate_e(x)) * up_e(x))`` and returns
``[..., k, hidden]`` (the router weights are applied by the caller).

* ``cpu``: fp32 and affine-quantized experts run mlx-lm's op graph exactly
  (``mx.gather_mm`` / ``mx.gather_qmm``, with the same token sort at >= 64
  (token, expert) pairs), so those paths are bit-equal to mlx-lm's
  ``SwitchGLU``. bf16/fp16 dense experts cannot use ``gather_mm`` on the CPU
  (MLX 0.32: "[GatherMM::eval] Currently only supports float32.", which is why
  mlx-lm fails there); they run :func:`grouped_switch_glu`: tokens are grouped
  by expert on the host and each used expert does plain matmuls in the
  weights' own precision (bf16 in, bf16 out), touching only the experts the
  router picked.
* ``metal``: MLX's built-in ``gather_mm``/``gather_qmm`` Metal kernels handle
  every dtype there, so the registration is the gather op graph (no custom
  source). Calling it is only possible on a Metal device.
"""

from __future__ import annotations

from functools import partial
from typing import Protocol

import mlx.core as mx
import mlx.nn as nn
import numpy as np

SWITCH_GLU = "gemma4.switch_glu"

# At this many (token, expert) pairs mlx-lm sorts tokens by expert before the
# gathered matmuls; we keep the same threshold so the op graph is the same.
SORT_THRESHOLD = 64


@partial(mx.compile, shapeless=True)
def geglu(gate: mx.array, x: mx.array) -> mx.array:
    """``gelu_tanh(gate) * x``, compiled shapeless exactly like mlx-lm's (same fused rounding)."""
    return nn.gelu_approx(gate) * x


class ExpertProjection(Protocol):
    """One projection of every expert: dense ``weight [E, out, in]`` or affine-quantized."""

    weight: mx.array

    @property
    def is_quantized(self) -> bool: ...

    def gather(self, x: mx.array, indices: mx.array, sorted_indices: bool) -> mx.array: ...

    def expert_matmul(self, x: mx.array, expert: int) -> mx.array: ...


def _sort_by_expert(x: mx.array, indices: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    *_, k = indices.shape
    flat = indices.flatten()
    order = mx.argsort(flat)
    inv_order = mx.argsort(order)
    return x.flatten(0, -3)[order // k], flat[order], inv_order


def gather_switch_glu(
    x: mx.array,
    indices: mx.array,
    gate: ExpertProjection,
    up: ExpertProjection,
    down: ExpertProjection,
) -> mx.array:
    """The gathered-matmul expert GLU: the same op graph as mlx-lm's ``SwitchGLU``."""
    x = mx.expand_dims(x, (-2, -3))
    indices = mx.stop_gradient(indices)
    do_sort = indices.size >= SORT_THRESHOLD
    idx, inv_order = indices, None
    if do_sort:
        x, idx, inv_order = _sort_by_expert(x, indices)
    x_up = up.gather(x, idx, do_sort)
    x_gate = gate.gather(x, idx, do_sort)
    x = down.gather(geglu(x_gate, x_up), idx, do_sort)
    if do_sort:
        x = mx.unflatten(x[inv_order], 0, indices.shape)
    return x.squeeze(-2)


def grouped_switch_glu(
    x: mx.array,
    indices: mx.array,
    gate: ExpertProjection,
    up: ExpertProjection,
    down: ExpertProjection,
) -> mx.array:
    """Expert GLU by grouping tokens per expert: plain matmuls in the weights' precision.

    Reads the router's choice on the host (one sync per MoE layer) so each
    used expert runs one ``[tokens_e, hidden] @ [hidden, inter]`` product;
    unused experts cost nothing.
    """
    *lead, hidden = x.shape
    k = indices.shape[-1]
    tokens = x.reshape(-1, hidden)
    flat = np.asarray(mx.stop_gradient(indices).reshape(-1)).astype(np.int64)
    order = np.argsort(flat, kind="stable")
    counts = np.bincount(flat, minlength=1)
    pieces = []
    start = 0
    for expert in np.flatnonzero(counts):
        stop = start + int(counts[expert])
        rows = mx.array((order[start:stop] // k).astype(np.int32))
        xe = tokens[rows]
        h = geglu(gate.expert_matmul(xe, int(expert)), up.expert_matmul(xe, int(expert)))
        pieces.append(down.expert_matmul(h, int(expert)))
        start = stop
    out = mx.concatenate(pieces, axis=0)[mx.array(np.argsort(order).astype(np.int32))]
    return out.reshape(*lead, k, hidden)


def cpu_switch_glu(
    x: mx.array,
    indices: mx.array,
    gate: ExpertProjection,
    up: ExpertProjection,
    down: ExpertProjection,
) -> mx.array:
    """CPU expert GLU: mlx-lm's op graph where MLX's CPU supports it, else grouped matmuls."""
    dense_low_precision = not gate.is_quantized and gate.weight.dtype != mx.float32
    if dense_low_precision:
        return grouped_switch_glu(x, indices, gate, up, down)
    return gather_switch_glu(x, indices, gate, up, down)


def kernels() -> list:
    """The ``gemma4.switch_glu`` registrations (built lazily by the plugin hook)."""
    from mlx_loom.kernels import Kernel

    return [
        Kernel(
            name=SWITCH_GLU,
            backend="cpu",
            fn=cpu_switch_glu,
            description="MoE expert GLU: gather_mm/gather_qmm for fp32 and quantized experts "
            "(bit-equal to mlx-lm); per-expert grouped matmuls for bf16/fp16 experts",
        ),
        Kernel(
            name=SWITCH_GLU,
            backend="metal",
            fn=gather_switch_glu,
            description="MoE expert GLU through MLX's built-in gather_mm/gather_qmm Metal "
            "kernels (all dtypes)",
        ),
    ]
