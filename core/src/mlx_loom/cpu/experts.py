"""The routed-expert layer on the native kernels: expert products as one node per layer.

A mixture-of-experts block (:class:`mlx_loom.nn.SwitchGLU`) multiplies each
token with the k experts its router chose. With MLX's operations that is
``gather_qmm`` / ``gather_mm``: on the CPU a reference loop (on a 436M
Qwen3-Next-shaped model, 32 experts top-4, 4-bit, 53-56 % of decode CPU
time), and ``gather_mm`` does not run in bf16/fp16 there at all. On the
native kernel sets the core swaps, in place, after the family builds its
graph (no family code changes):

* ``SwitchLinear`` / ``QuantizedSwitchLinear`` (affine) for the subclasses
  here, whose ``gather`` and ``expert_matmul`` run the native kernels on
  the weights as stored (bf16 experts are not converted to the compute
  dtype, and need no fp32 copy);
* ``SwitchGLU`` for :class:`NativeSwitchGLU`: with SwiGLU on float32
  activations the gate and up products, the gate and the down product of
  every (token, expert) pair are **one node** (``gather_*_matmul(gated=True,
  down=...)``); so are they with GeGLU (Gemma) on float32 activations, the
  gate then the native GeGLU gate (``gelu=True``: within a stated bound of
  MLX's, whose ``tanh`` is the C library's one element at a time; see
  :func:`mlx_loom.cpu.ops.gelu_mul`); with another activation or
  half-precision activations, gate and up are one node, the activation MLX's
  own, the down product one more node.

Inside the node the pairs are grouped by expert and each expert's rows run
the native linears' kernels: every output equals ``dense_matmul`` /
``affine_matmul`` (or the gated product) of that expert's rows bit for bit,
so against MLX's ``gather_mm`` / ``gather_qmm`` it holds the native
products' stated fp32 bound (docs/cpu.md), not bit-equality — the same
relation the native linears have with ``quantized_matmul``. A decode batch
(at most 32 tokens, so at most 32 rows per expert) reproduces each row
alone bit for bit. On ``cpu-native-int8-act`` 4-bit experts take int8
activations under the linears' rule (every row count: decode and prefill).

What stays on MLX: non-affine modes (mxfp4, mxfp8, nvfp4) — those modules
are not swapped; projections an adapter wraps (their own ``gather``, which
calls the native base); expert stacks with a bias; the router and the
weighted sum of the k outputs (the family's few element-wise operations).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..nn.activations import geglu, swiglu
from ..nn.experts import QuantizedSwitchLinear, SwitchGLU, SwitchLinear
from . import native


def _flat_rows(x: mx.array, indices: mx.array) -> mx.array | None:
    """``x`` as the node's rows: one per token or per pair of ``indices``.

    ``gather`` receives x as mlx-lm's graph shapes it, ``[..., 1, K]``
    broadcast against ``indices [...]``: leading dims equal to the indices'
    (a row per pair, e.g. the down projection's input or sorted pairs), or to
    the indices' with the last one 1 (a row per token). Anything else is not
    a shape the node takes.
    """
    if x.ndim < 2 or x.shape[-2] != 1:
        return None
    lead = tuple(x.shape[:-2])
    shape = tuple(indices.shape)
    if lead == shape or (shape and lead == shape[:-1] + (1,)):
        return x.reshape(-1, x.shape[-1])
    return None


def _indices(indices: mx.array) -> mx.array:
    return indices if indices.dtype in (mx.uint32, mx.int32) else indices.astype(mx.uint32)


class NativeSwitchLinear(SwitchLinear):
    """:class:`~mlx_loom.nn.SwitchLinear` on the native dense kernel; weight read as stored."""

    def gather(self, x: mx.array, indices: mx.array, sorted_indices: bool) -> mx.array:
        rows = _flat_rows(x, indices)
        if rows is None:
            # A shape the node does not take: MLX's gather in x's dtype.
            w = self["weight"].astype(x.dtype)
            return mx.gather_mm(
                x, w.swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sorted_indices
            )
        y = native.module().gather_dense_matmul(rows, _indices(indices), [self["weight"]])[0]
        return mx.expand_dims(y, -2)

    def expert_matmul(self, x: mx.array, expert: int) -> mx.array:
        return native.module().dense_matmul(x, self["weight"][expert])


class NativeQuantizedSwitchLinear(QuantizedSwitchLinear):
    """:class:`~mlx_loom.nn.QuantizedSwitchLinear` (affine) on the native kernel;
    scales read as stored. ``int8_activations``: 4-bit only (the int8 set)."""

    int8_activations: bool = False

    def gather(self, x: mx.array, indices: mx.array, sorted_indices: bool) -> mx.array:
        rows = _flat_rows(x, indices)
        if rows is None:
            return super().gather(x, indices, sorted_indices)
        y = native.module().gather_affine_matmul(
            rows,
            _indices(indices),
            [self["weight"]],
            [self["scales"]],
            [self["biases"]],
            self.bits,
            self.group_size,
            self.int8_activations,
        )[0]
        return mx.expand_dims(y, -2)


def _read_alike(a: nn.Module, b: nn.Module) -> bool:
    """Whether two native expert projections can share one node (and x's preparation)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, NativeQuantizedSwitchLinear) and isinstance(b, NativeQuantizedSwitchLinear):
        return (a.bits, a.group_size, a.int8_activations, a["scales"].dtype) == (
            b.bits,
            b.group_size,
            b.int8_activations,
            b["scales"].dtype,
        )
    return a["weight"].dtype == b["weight"].dtype


class NativeSwitchGLU(SwitchGLU):
    """:class:`~mlx_loom.nn.SwitchGLU` whose expert products are native nodes.

    Applies when the three projections are native expert projections (no
    adapter around them) and gate and up are read alike; anything
    else runs the family's resolved kernel, whose ``gather`` calls still
    reach the native projections.
    """

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        y = self._native(x, indices)
        return y if y is not None else super().__call__(x, indices)

    def _native(self, x: mx.array, indices: mx.array) -> mx.array | None:
        gate, up, down = self.gate_proj, self.up_proj, self.down_proj
        kinds = (NativeSwitchLinear, NativeQuantizedSwitchLinear)
        if type(gate) not in kinds or type(down) not in kinds or not _read_alike(gate, up):
            return None
        if gate["weight"].shape != up["weight"].shape:
            return None
        if not mx.issubdtype(x.dtype, mx.floating):
            return None
        idx = _indices(indices)
        if x.shape[:-1] != indices.shape[:-1]:
            return None
        # SwiGLU in float32: MLX's gate arithmetic is the native gate's (bit-
        # equal), so gate, up, gate and down are one node; GeGLU too, its
        # gate the native one (within its bound of MLX's).
        gelu = self._activation is geglu
        fused = (gelu or self._activation is swiglu) and x.dtype == mx.float32
        with_down = fused and _read_alike(gate, down)
        nat = native.module()
        dense = type(gate) is NativeSwitchLinear
        if dense:
            outs = nat.gather_dense_matmul(
                x,
                idx,
                [gate["weight"], up["weight"]],
                gated=fused,
                gelu=gelu and fused,
                down=down["weight"] if with_down else None,
            )
        else:
            assert isinstance(gate, NativeQuantizedSwitchLinear)
            outs = nat.gather_affine_matmul(
                x,
                idx,
                [gate["weight"], up["weight"]],
                [gate["scales"], up["scales"]],
                [gate["biases"], up["biases"]],
                gate.bits,
                gate.group_size,
                gate.int8_activations,
                gated=fused,
                gelu=gelu and fused,
                down=down["weight"] if with_down else None,
                down_scales=down["scales"] if with_down else None,
                down_biases=down["biases"] if with_down else None,
            )
        if with_down:
            return outs[0]
        hidden = outs[0] if fused else self._activation(outs[0], outs[1])
        return self._down(hidden, idx)

    def _down(self, hidden: mx.array, indices: mx.array) -> mx.array:
        """``down`` over the pairs' hidden rows (one row per pair): one node."""
        down = self.down_proj
        nat = native.module()
        if isinstance(down, NativeQuantizedSwitchLinear):
            return nat.gather_affine_matmul(
                hidden,
                indices,
                [down["weight"]],
                [down["scales"]],
                [down["biases"]],
                down.bits,
                down.group_size,
                down.int8_activations,
            )[0]
        return nat.gather_dense_matmul(hidden, indices, [down["weight"]])[0]


#: What each swapped expert class becomes.
SWAPS: dict[type[nn.Module], type[nn.Module]] = {
    SwitchLinear: NativeSwitchLinear,
    QuantizedSwitchLinear: NativeQuantizedSwitchLinear,
}

#: The parameters the native expert products read as stored.
KEPT_AS_STORED: dict[type[nn.Module], frozenset[str]] = {
    NativeSwitchLinear: frozenset({"weight"}),
    NativeQuantizedSwitchLinear: frozenset({"weight", "scales", "biases"}),
}
