"""The ``cpu-native`` set's per-token operations: RMS norm, RoPE, attention and the
SwiGLU gate, one node each.

On MLX's CPU backend ``mx.fast.rms_norm``, ``mx.fast.rope`` and
``mx.fast.scaled_dot_product_attention`` are not kernels: each builds a
fallback graph of ten to thirty element-wise operations (attention's
products then go to the reference BLAS). A 24-layer decode step of a 350M
Llama is ~3000 graph nodes, ~2400 of them from these three, and once the
products are fast their per-node cost dominates the step. The native
extension computes each in one node (fp32 arithmetic, outputs rounded once).

They reach the model the way the matrix kernels do, without family code:

* ``nn.RMSNorm``, ``nn.RoPE`` and the core's :class:`~mlx_loom.nn.rope.FreqsRoPE`
  modules are swapped, in place, for the subclasses here
  (:data:`mlx_loom.cpu.layers.SWAPS`);
* attention over plain (unquantized) keys and values — the core's
  :class:`~mlx_loom.cache.views.PlainView` — runs on the native kernel for
  every forward built through :meth:`mlx_loom.Model.__call__` of a model
  whose kernel set is ``cpu-native``: the model sets the kernel for the
  duration of the call (:mod:`mlx_loom.forward_hooks`);
* the core's :func:`~mlx_loom.nn.swiglu` on float32 operands, in the same
  forwards, runs :func:`silu_mul` — MLX's own element-wise arithmetic (its
  exp polynomial, the same fused multiply-adds) eight lanes at a time, so it
  is bit-equal to the compiled MLX function it replaces. MLX's CPU backend
  evaluates that function one element at a time: ~1.7 ms of a 350M Llama's
  decode step (24 gates of 2816), ~0.25 ms here;
* the engine's log-probabilities (``logits - logsumexp(logits)``, float32)
  run :func:`log_softmax`, MLX's arithmetic again (the exps eight lanes at
  a time, their sum in MLX's order): ~0.9 ms a token over a 32000-word
  vocabulary with MLX's element-at-a-time evaluation, ~0.1 ms here.

Two more hold a stated bound rather than bit-equality (docs/cpu.md): the
core's :func:`~mlx_loom.nn.geglu` on float32 operands runs :func:`gelu_mul`
(MLX's ``tanh`` is the C library's ``tanhf``, one element at a time, which
eight lanes cannot repeat; a GeGLU :class:`NativeGatedMLP` is one node).
Families' own recurrences take native nodes through their own hook
(``use_native_cpu_kernels``: Qwen3-Next's gated delta and causal conv).

What stays on MLX's operations, by design: attention with sinks, quantized
KV views (their own products), families' direct ``mx.fast.rms_norm`` calls
and modules of their own classes, SwiGLU and GeGLU in bfloat16/float16 (MLX
rounds their intermediates in that dtype), and graphs called around the
model (``model.module(...)`` directly).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..forward_hooks import NativeForward, using
from ..nn import activations
from ..nn.activations import geglu, swiglu
from ..nn.experts import SwitchGLU
from ..nn.mlp import GatedMLP
from ..nn.rope import FreqsRoPE
from . import native
from .layers import NativeLinear, NativeQuantizedLinear
from .native import NATIVE_KERNEL_SETS

#: Widest norm rows / RoPE heads the kernels take (their row buffers are fixed).
MAX_NORM_WIDTH = 16384
MAX_ROPE_WIDTH = 4096


_INT32_MAX = 2**31 - 1


def _offsets(offset: int | mx.array, length: int) -> mx.array:
    """RoPE offsets as the kernel takes them (int32 ``[1]`` or ``[B]``).

    A Python offset is checked here: positions ``offset .. offset + length - 1``
    must lie in ``0..2**31 - 1`` (MLX cannot even hold a larger one in int32).
    The kernel binding checks array offsets that hold data the same way.
    """
    if isinstance(offset, int):
        if offset < 0 or offset + max(length, 1) - 1 > _INT32_MAX:
            raise ValueError(
                f"[loom native kernels] rope's offset {offset} with {length} positions is "
                f"out of range: positions must lie in 0..{_INT32_MAX}."
            )
        return mx.array([offset], dtype=mx.int32)
    return offset.astype(mx.int32).reshape(-1)


class NativeRMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` as one native node."""

    def __call__(self, x: mx.array) -> mx.array:
        return native.module().rms_norm(x, self["weight"], self.eps)


class NativeRoPE(nn.RoPE):
    """``nn.RoPE`` (base and position scale) as one native node.

    ``_inv_freq`` (``base ** (-2i / dims)``, float32) is set when the module
    is swapped in, before the model's constants are evaluated.
    """

    _inv_freq: mx.array

    def prepare(self) -> None:
        exponents = mx.arange(0, self.dims, 2, dtype=mx.float32) / self.dims
        self._inv_freq = 1.0 / (mx.array(self.base, mx.float32) ** exponents)

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        offsets = _offsets(offset, x.shape[-2])
        return native.module().rope(
            x, self.dims, self.traditional, self._inv_freq, float(self.scale), offsets
        )


class NativeFreqsRoPE(FreqsRoPE):
    """:class:`~mlx_loom.nn.rope.FreqsRoPE` (llama3, YaRN, LongRoPE, proportional) natively."""

    _inv_freq: mx.array

    def prepare(self) -> None:
        self._inv_freq = (1.0 / self._freqs).astype(mx.float32)

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        if self.input_scale != 1.0:
            x = x.at[..., : self.dims].multiply(self.input_scale)
        return native.module().rope(
            x, self.dims, self.traditional, self._inv_freq, 1.0, _offsets(offset, x.shape[-2])
        )


class NativeGatedMLP(GatedMLP):
    """:class:`~mlx_loom.nn.GatedMLP` whose gate and up projections run as one node.

    Taken when both projections are native linears read the same way (one
    class, shape, dtype, width and group size; no biases), x is float32 and
    the activation is SwiGLU or GeGLU (Gemma): one product node computes both
    rows of each chunk and the gate between them (``gated_*_matmul``, with
    ``gelu=True`` for GeGLU), bit-equal to the three nodes it replaces
    (tested: the two products and :func:`silu_mul` / :func:`gelu_mul`), with
    x prepared once; ``down_proj`` is the next node. A 350M Llama's decode
    step loses 48 of its ~700 nodes. Anything else — other activations,
    adapters wrapped around a projection, other dtypes — runs GatedMLP's own
    forward, on the same kernels.
    """

    def __call__(self, x: mx.array) -> mx.array:
        gated = self._gated(x)
        if gated is None:
            return super().__call__(x)
        return self.down_proj(gated)

    def _gated(self, x: mx.array) -> mx.array | None:
        gate, up = self.gate_proj, self.up_proj
        gelu = self._activation is geglu
        if not (self._activation is swiglu or (gelu and activations.native_geglu())):
            return None
        if x.dtype != mx.float32 or type(gate) is not type(up):
            return None
        if "bias" in gate or "bias" in up:
            return None
        if type(gate) is NativeLinear:
            gw, uw = gate["weight"], up["weight"]
            if gw.shape != uw.shape or gw.dtype != uw.dtype:
                return None
            return native.module().gated_dense_matmul(x, gw, uw, gelu=gelu)
        if type(gate) is NativeQuantizedLinear:
            assert isinstance(up, NativeQuantizedLinear)
            same_kind = (gate.bits, gate.group_size, gate.int8_activations) == (
                up.bits,
                up.group_size,
                up.int8_activations,
            )
            gs, us = gate["scales"], up["scales"]
            if not same_kind or gs.shape != us.shape or gs.dtype != us.dtype:
                return None
            if gate["weight"].shape != up["weight"].shape:
                return None
            return native.module().gated_affine_matmul(
                x,
                gate["weight"],
                gs,
                gate["biases"],
                up["weight"],
                us,
                up["biases"],
                gate.bits,
                gate.group_size,
                gate.int8_activations,
                gelu=gelu,
            )
        return None


def fits(module: nn.Module) -> bool:
    """Whether a norm, RoPE or gated MLP module is within the native kernels' limits."""
    if type(module) is GatedMLP or type(module) is SwitchGLU:
        return True
    if isinstance(module, nn.RMSNorm):
        return module["weight"].ndim == 1 and module["weight"].shape[0] <= MAX_NORM_WIDTH
    dims = getattr(module, "dims", 0)
    return isinstance(dims, int) and 0 < dims <= MAX_ROPE_WIDTH and dims % 2 == 0


def attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    *,
    scale: float,
    mask: Any,
    lengths: mx.array | None = None,
) -> mx.array:
    """``mx.fast.scaled_dot_product_attention(q, k, v, scale=, mask=)`` as one native node.

    ``mask``: ``None``, ``"causal"``, or an array broadcastable to
    ``[B, Hq, L, S]`` — boolean (``True`` attends) or additive. ``lengths``
    (int32 ``[1]`` or ``[B]``): batch row ``b`` attends over its first
    ``lengths[b]`` keys only — what a compiled step that passes its whole
    key buffer needs, without reading (or masking) the slots past the end.

    Keys and values stored in half precision (``kv_dtype``) are read as they
    are by float32 queries: the kernel widens each element exactly, which is
    what ``astype(float32)`` would give, without a float32 copy of the cache
    per forward. Half-precision queries keep their dtype's keys, as before.

    Prefill (more than one query) is tiled: a block of queries walks the keys
    block by block, each row's arithmetic exactly decode's, so no score
    matrix (nor a broadcast mask) is ever materialised; see ``docs/cpu.md``.
    """
    if values.dtype != keys.dtype or (
        keys.dtype != queries.dtype and queries.dtype != mx.float32
    ):
        keys, values = keys.astype(queries.dtype), values.astype(queries.dtype)
    causal = isinstance(mask, str) and mask == "causal"
    additive = None
    if isinstance(mask, mx.array):
        if mask.dtype == mx.bool_:
            additive = mx.where(mask, mx.array(0.0, mx.float32), mx.array(-mx.inf, mx.float32))
        else:
            additive = mask.astype(mx.float32)
    elif mask is not None and not causal:
        raise ValueError(f"attention mask {mask!r} is not None, 'causal' or an array")
    return native.module().attention(queries, keys, values, float(scale), causal, additive, lengths)


def silu_mul(gate: mx.array, up: mx.array) -> mx.array:
    """``silu(gate) * up`` for float32 operands of one shape, as one native node."""
    return native.module().silu_mul(gate, up)


def gelu_mul(gate: mx.array, up: mx.array) -> mx.array:
    """``gelu_approx(gate) * up`` for float32 operands of one shape, as one native node
    (within ``2**-21 * |gate * up|`` of MLX's evaluation; docs/cpu.md)."""
    return native.module().gelu_mul(gate, up)


def expert_mix(
    y: mx.array,
    weights: mx.array,
    shared: mx.array | None = None,
    shared_weight: mx.array | None = None,
) -> mx.array:
    """``(y * weights[..., None]).sum(axis=-2)`` for float32 operands, as one native node
    (bit-equal to MLX's evaluation); with a shared expert's output and its gate
    weight ``[..., 1]``, plus ``shared_weight * shared``, bit-equal too."""
    return native.module().expert_mix(y, weights, shared, shared_weight)


def softcap(x: mx.array, cap: float) -> mx.array:
    """``tanh(x / cap) * cap`` for float32 x, as one native node (within ``2**-21 * cap``
    of MLX's evaluation; docs/cpu.md)."""
    return native.module().softcap(x, cap)


def rms_norm(x: mx.array, weight: mx.array | None, eps: float) -> mx.array:
    """``mx.fast.rms_norm(x, weight, eps)`` as one native node where the kernel takes it
    (a last axis of at most MAX_NORM_WIDTH, a 1-D gain of that width or none), else MLX's."""
    width = x.shape[-1] if x.ndim else 0
    fits = 0 < width <= MAX_NORM_WIDTH and (
        weight is None or (weight.ndim == 1 and weight.shape[0] == width)
    )
    if not fits or not mx.issubdtype(x.dtype, mx.floating):
        return mx.fast.rms_norm(x, weight, eps)
    return native.module().rms_norm(x, weight, eps)


def log_softmax(x: mx.array) -> mx.array:
    """``x - logsumexp(x, axis=-1, keepdims=True)`` for float32 x, as one native node."""
    return native.module().log_softmax(x)


def forward_kernels(kernel_set: str | None) -> AbstractContextManager[None]:
    """Build the enclosed forward with the native kernels if ``kernel_set`` runs natively
    (the hook of :mod:`mlx_loom.forward_hooks`, set for the duration)."""
    if kernel_set not in NATIVE_KERNEL_SETS:
        return using(None)
    return using(
        NativeForward(
            attention=attention,
            silu_mul=silu_mul,
            log_softmax=log_softmax,
            gelu_mul=gelu_mul,
            rms_norm=rms_norm,
            softcap=softcap,
            expert_mix=expert_mix,
        )
    )
