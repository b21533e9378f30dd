"""Routed experts: stacked expert projections, the SwitchGLU block, and its kernels.

A mixture-of-experts layer applies, for each token and each of its top-k
experts ``e``, ``down_e(act(gate_e(x)) * up_e(x))``. The projections of all
experts are stacked (``weight [E, out, in]``, mlx-lm's converted layout); the
block returns ``[..., k, dims]`` and the caller weights and sums the k rows.

Which computation runs is a kernel resolved per backend by the core (a family
registers the three :func:`expert_kernels` under its own kernel name):

* ``metal``: :func:`gather_switch_glu`, mlx-lm's op graph (``gather_mm`` /
  ``gather_qmm``, tokens sorted by expert at >= 64 pairs). MLX's Metal gather
  kernels handle every dtype.
* ``cpu`` and ``cuda``: :func:`switch_glu`, plain MLX ops that run on every
  backend. fp32 and quantized experts (any mode: affine, mxfp4, nvfp4,
  mxfp8) take the same gather graph (bit-equal to mlx-lm); bf16/fp16 dense
  experts take :func:`grouped_switch_glu`, because ``mx.gather_mm`` is
  fp32-only on the CPU (MLX 0.32: "[GatherMM::eval] Currently only supports
  float32.", which is why mlx-lm cannot run bf16 MoE models there).

The one bf16-on-CPU strategy, and why (measured with
``benchmarks/moe_bf16_cpu.py``: 64 experts, hidden 1024, expert width 512,
top-8, bf16, 2-core x86 CPU, MLX 0.32.4; best of 3, quiet machine):

================  ==================  ==================  ==============
 tokens            upcast to fp32       grouped on host      result
================  ==================  ==================  ==============
 1 (decode)        50.7 ms, 264 MiB     15.3 ms, 214 MiB     bit-identical
 16                458 ms, 579 MiB      149 ms, 241 MiB      bit-identical
 128 (prefill)     1778 ms, 602 MiB     788 ms, 245 MiB      bit-identical
 8 layers, decode  185 ms/step          138 ms/step          pipelined loop
================  ==================  ==================  ==============

(peak memory includes the 192 MiB of expert weights; rerun on a loaded
machine, load average 10, the ordering held: grouped 1.6-4.8x faster per
call, and 546 vs 608 ms per pipelined decode step). "Upcast" converts the
routed experts' weights (all of them once there are as many pairs as
experts) and the activations to fp32, runs ``gather_mm`` and rounds the
product once to bf16. "Grouped" reads the router's choice on the host, sorts
the tokens by expert and lets each used expert run three plain bf16 matmuls
on its tokens. MLX's CPU bf16 matmul accumulates in fp32 and rounds once, so
both produce the same bits — the rounding a bf16 ``gather_mm`` on a GPU
delivers — and grouped is faster and never materialises fp32 copies of the
experts (at real sizes, 512 experts x 2048 x 512 per projection, an upcast
prefill would allocate 2 GiB per projection and layer). Its cost: one host
sync per MoE layer per forward (it reads the router's indices), so it cannot
run inside ``mx.compile`` and it shortens how far ``mx.async_eval`` can run
ahead; the pipelined decode row above includes that cost, and it did not show.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_loom.backends import Kernel
from mlx_loom.forward_hooks import current_expert_mix

from .activations import Activation, swiglu

__all__ = [
    "SORT_THRESHOLD",
    "ExpertKernel",
    "QuantizedSwitchLinear",
    "SwitchGLU",
    "SwitchLinear",
    "expert_kernels",
    "gather_switch_glu",
    "grouped_switch_glu",
    "mix_experts",
    "switch_glu",
]

#: At this many (token, expert) pairs mlx-lm sorts tokens by expert before the
#: gathered matmuls (contiguous rows per expert); we keep the same threshold so
#: the op graph, and therefore the result, is the same.
SORT_THRESHOLD = 64


class ExpertProjection(Protocol):
    """One projection of every expert (:class:`SwitchLinear` or its quantized form)."""

    is_quantized: bool

    def gather(self, x: mx.array, indices: mx.array, sorted_indices: bool) -> mx.array: ...


#: ``kernel(x, indices, gate, up, down, activation) -> [..., k, dims]``.
ExpertKernel = Callable[
    [mx.array, mx.array, Any, Any, Any, Activation],
    mx.array,
]


def _add_bias(module: nn.Module, x: mx.array, indices: mx.array) -> mx.array:
    """``x`` plus each pair's expert bias, when the projection has one (as mlx-lm adds it:
    after the gathered product, broadcast over the row axis)."""
    if "bias" not in module:
        return x
    return x + mx.expand_dims(module["bias"][indices], -2)


class SwitchLinear(nn.Module):
    """One projection of every expert: ``weight [experts, out, in]``, optional ``bias``.

    ``bias [experts, out]`` is per expert (gpt-oss's experts carry one); it is
    added after the gathered product, the op order mlx-lm's ``SwitchLinear`` uses.
    """

    is_quantized = False

    def __init__(self, in_dims: int, out_dims: int, n_experts: int, *, bias: bool = False) -> None:
        super().__init__()
        self.weight = mx.zeros((n_experts, out_dims, in_dims))
        if bias:
            self.bias = mx.zeros((n_experts, out_dims))

    def gather(self, x: mx.array, indices: mx.array, sorted_indices: bool) -> mx.array:
        """``x @ weight[indices].T (+ bias[indices])`` per (token, expert) pair, as mlx-lm's
        ``SwitchLinear``."""
        x = mx.gather_mm(
            x, self["weight"].swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sorted_indices
        )
        return _add_bias(self, x, indices)

    def expert_matmul(self, x: mx.array, expert: int) -> mx.array:
        """``x @ weight[expert].T (+ bias[expert])``: one expert over the tokens routed to it."""
        y = x @ self["weight"][expert].T
        return y + self["bias"][expert] if "bias" in self else y

    def to_quantized(
        self, group_size: int | None = None, bits: int | None = None, mode: str = "affine"
    ) -> QuantizedSwitchLinear:
        """The packed form of this stack, in any of MLX's modes (``None``: the mode's default)."""
        E, out_dims, in_dims = self.weight.shape
        q = QuantizedSwitchLinear(
            in_dims,
            out_dims,
            E,
            group_size=group_size,
            bits=bits,
            mode=mode,
            bias="bias" in self,
        )
        q.weight, q.scales, *biases = mx.quantize(self.weight, q.group_size, q.bits, mode=mode)
        if biases:
            q.biases = biases[0]
        if "bias" in self:
            q.bias = self.bias
        return q


#: MLX's default ``(group_size, bits)`` per mode (``mx.quantize``'s table).
_MODE_DEFAULTS = {"affine": (64, 4), "mxfp4": (32, 4), "nvfp4": (16, 4), "mxfp8": (32, 8)}


class QuantizedSwitchLinear(nn.Module):
    """Quantized :class:`SwitchLinear`: ``weight`` uint32 and ``scales``, plus ``biases``
    in affine mode (the microscaling modes mxfp4/nvfp4/mxfp8 store uint8 scales alone),
    and the dense per-expert ``bias`` where the stack had one.

    ``mx.gather_qmm`` runs on every backend in every activation dtype and
    every mode, so a quantized expert stack always takes the gather graph.
    """

    is_quantized = True

    def __init__(
        self,
        in_dims: int,
        out_dims: int,
        n_experts: int,
        *,
        group_size: int | None = None,
        bits: int | None = None,
        mode: str = "affine",
        bias: bool = False,
    ) -> None:
        super().__init__()
        default_group, default_bits = _MODE_DEFAULTS[mode]
        self.group_size = group_size or default_group
        self.bits = bits or default_bits
        self.mode = mode
        groups = (n_experts, out_dims, in_dims // self.group_size)
        self.weight = mx.zeros((n_experts, out_dims, in_dims * self.bits // 32), dtype=mx.uint32)
        if mode == "affine":
            self.scales = mx.zeros(groups)
            self.biases = mx.zeros(groups)
        else:
            self.scales = mx.zeros(groups, dtype=mx.uint8)
        if bias:
            self.bias = mx.zeros((n_experts, out_dims))
        self.freeze()

    def gather(self, x: mx.array, indices: mx.array, sorted_indices: bool) -> mx.array:
        x = mx.gather_qmm(
            x,
            self["weight"],
            self["scales"],
            self.get("biases"),
            rhs_indices=indices,
            transpose=True,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
            sorted_indices=sorted_indices,
        )
        return _add_bias(self, x, indices)


def _sort_by_expert(x: mx.array, indices: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    k = indices.shape[-1]
    flat = indices.flatten()
    order = mx.argsort(flat)
    return x.flatten(0, -3)[order // k], flat[order], mx.argsort(order)


def gather_switch_glu(
    x: mx.array,
    indices: mx.array,
    gate: ExpertProjection,
    up: ExpertProjection,
    down: ExpertProjection,
    activation: Activation,
) -> mx.array:
    """The gathered-matmul expert GLU: the same op graph as mlx-lm's ``SwitchGLU``."""
    x = mx.expand_dims(x, (-2, -3))
    indices = mx.stop_gradient(indices)
    do_sort = indices.size >= SORT_THRESHOLD
    idx, inverse = indices, None
    if do_sort:
        x, idx, inverse = _sort_by_expert(x, indices)
    x_up = up.gather(x, idx, do_sort)
    x_gate = gate.gather(x, idx, do_sort)
    x = down.gather(activation(x_gate, x_up), idx, do_sort)
    if do_sort:
        x = mx.unflatten(x[inverse], 0, indices.shape)
    return x.squeeze(-2)


def grouped_switch_glu(
    x: mx.array,
    indices: mx.array,
    gate: SwitchLinear,
    up: SwitchLinear,
    down: SwitchLinear,
    activation: Activation,
) -> mx.array:
    """The expert GLU by grouping tokens per expert: plain matmuls in the weights' dtype.

    Reads the router's choice on the host (one sync), sorts the (token,
    expert) pairs by expert, and runs each used expert once over its tokens;
    unused experts cost nothing. Dense experts only.
    """
    *lead, dims = x.shape
    k = indices.shape[-1]
    tokens = x.reshape(-1, dims)
    flat = np.asarray(mx.stop_gradient(indices).reshape(-1)).astype(np.int64)
    order = np.argsort(flat, kind="stable")
    counts = np.bincount(flat)
    pieces, start = [], 0
    for expert in np.flatnonzero(counts):
        stop = start + int(counts[expert])
        xe = tokens[mx.array((order[start:stop] // k).astype(np.int32))]
        e = int(expert)
        h = activation(gate.expert_matmul(xe, e), up.expert_matmul(xe, e))
        pieces.append(down.expert_matmul(h, e))
        start = stop
    out = mx.concatenate(pieces, axis=0)[mx.array(np.argsort(order).astype(np.int32))]
    return out.reshape(*lead, k, dims)


def switch_glu(
    x: mx.array,
    indices: mx.array,
    gate: ExpertProjection,
    up: ExpertProjection,
    down: ExpertProjection,
    activation: Activation,
) -> mx.array:
    """The expert GLU in MLX ops that run on every backend (the cpu and cuda kernel).

    fp32 and quantized experts: :func:`gather_switch_glu` (bit-equal to
    mlx-lm). bf16/fp16 dense experts: :func:`grouped_switch_glu` (see the
    module docstring for why this, and not an fp32 upcast).
    """
    if not gate.is_quantized and gate.weight.dtype != mx.float32:  # type: ignore[attr-defined]
        return grouped_switch_glu(x, indices, gate, up, down, activation)  # type: ignore[arg-type]
    return gather_switch_glu(x, indices, gate, up, down, activation)


class SwitchGLU(nn.Module):
    """Every expert's GLU, computed by the per-backend ``kernel`` the core resolved.

    Parameter names follow mlx-lm's converted layout (``gate_proj``,
    ``up_proj``, ``down_proj``, each ``[experts, out, in]``, with ``bias
    [experts, out]`` when ``bias``).
    """

    def __init__(
        self,
        dims: int,
        hidden: int,
        n_experts: int,
        *,
        kernel: ExpertKernel,
        activation: Activation = swiglu,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.gate_proj = SwitchLinear(dims, hidden, n_experts, bias=bias)
        self.up_proj = SwitchLinear(dims, hidden, n_experts, bias=bias)
        self.down_proj = SwitchLinear(hidden, dims, n_experts, bias=bias)
        self._kernel = kernel
        self._activation = activation

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        return self._kernel(
            x, indices, self.gate_proj, self.up_proj, self.down_proj, self._activation
        )


def mix_experts(
    y: mx.array,
    weights: mx.array,
    shared: mx.array | None = None,
    shared_weight: mx.array | None = None,
) -> mx.array:
    """The router-weighted sum of the k experts' outputs: ``(y * weights[..., None]).sum(-2)``,
    plus ``shared_weight * shared`` when a shared expert is given.

    ``y [..., k, dims]`` (a :class:`SwitchGLU`'s output), ``weights [..., k]``;
    ``shared [..., dims]`` a shared expert's output and ``shared_weight
    [..., 1]`` its gate (Qwen3-Next: the sigmoid of its gate projection).
    Outside a native forward it is exactly that expression (mlx-lm's, bit
    for bit, whatever the dtypes). In a forward built on a native CPU kernel
    set, float32 operands are one node (``LoomExpertMix``) with the same
    arithmetic — each product rounded, summed from the first expert up, the
    shared term added last — instead of five (expand, broadcast, multiply,
    sum, squeeze) per MoE layer. The shared term inside that node matters in
    the compiled step: there MLX would fuse the gate's sigmoid into the
    broadcast product and evaluate it once per output element.
    """
    if (shared is None) != (shared_weight is None):
        raise ValueError("mix_experts takes a shared expert's output and its weight together.")
    native = current_expert_mix()
    if (
        native is not None
        and y.dtype == weights.dtype == mx.float32
        and y.ndim >= 2
        and tuple(weights.shape) == tuple(y.shape[:-1])
    ):
        if (
            shared is not None
            and shared_weight is not None
            and shared.dtype == shared_weight.dtype == mx.float32
            and tuple(shared.shape) == tuple(y.shape[:-2]) + (y.shape[-1],)
            and tuple(shared_weight.shape) == tuple(y.shape[:-2]) + (1,)
        ):
            return native(y, weights, shared, shared_weight)
        mixed = native(y, weights)
    else:
        mixed = (y * weights[..., None]).sum(axis=-2)
    if shared is None or shared_weight is None:
        return mixed
    return mixed + shared_weight * shared


def expert_kernels(name: str) -> list[Kernel]:
    """The registrations of one expert-GLU kernel called ``name``, for every backend.

    ``cpu`` and ``cuda`` get :func:`switch_glu` (MLX ops, valid on every
    backend), ``metal`` gets :func:`gather_switch_glu` (MLX's native Metal
    gather kernels). A family returns these from its ``loom_kernels`` hook.
    """
    ops = (
        "routed-expert GLU in MLX ops (runs on every backend; registered for cpu and cuda): "
        "gather_mm/gather_qmm for fp32 and quantized experts, bit-equal to mlx-lm; bf16/fp16 "
        "experts grouped per expert on the host (gather_mm is fp32-only on the CPU)"
    )
    metal = "routed-expert GLU through MLX's native gather_mm/gather_qmm Metal kernels"
    return [
        Kernel(name=name, backend="cpu", fn=switch_glu, description=ops),
        Kernel(name=name, backend="cuda", fn=switch_glu, description=ops),
        Kernel(name=name, backend="metal", fn=gather_switch_glu, description=metal),
    ]
