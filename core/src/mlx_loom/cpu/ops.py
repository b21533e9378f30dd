"""The ``cpu-native`` set's per-token operations: RMS norm, RoPE and attention, one node each.

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
  duration of the call (:mod:`mlx_loom.cpu.forward`).

What stays on MLX's operations, by design: attention with sinks, quantized
KV views (their own products), families' direct ``mx.fast.rms_norm`` calls
and modules of their own classes, and graphs called around the model
(``model.module(...)`` directly).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..nn.rope import FreqsRoPE
from . import native

#: Widest norm rows / RoPE heads the kernels take (their row buffers are fixed).
MAX_NORM_WIDTH = 16384
MAX_ROPE_WIDTH = 4096


def _offsets(offset: int | mx.array) -> mx.array:
    if isinstance(offset, int):
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
        return native.module().rope(
            x, self.dims, self.traditional, self._inv_freq, float(self.scale), _offsets(offset)
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
            x, self.dims, self.traditional, self._inv_freq, 1.0, _offsets(offset)
        )


def fits(module: nn.Module) -> bool:
    """Whether a norm or RoPE module is within the native kernels' limits."""
    if isinstance(module, nn.RMSNorm):
        return module["weight"].ndim == 1 and module["weight"].shape[0] <= MAX_NORM_WIDTH
    dims = getattr(module, "dims", 0)
    return isinstance(dims, int) and 0 < dims <= MAX_ROPE_WIDTH and dims % 2 == 0


def attention(
    queries: mx.array, keys: mx.array, values: mx.array, *, scale: float, mask: Any
) -> mx.array:
    """``mx.fast.scaled_dot_product_attention(q, k, v, scale=, mask=)`` as one native node.

    ``mask``: ``None``, ``"causal"``, or an array broadcastable to
    ``[B, Hq, L, S]`` — boolean (``True`` attends) or additive.
    """
    if keys.dtype != queries.dtype:
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
    return native.module().attention(queries, keys, values, float(scale), causal, additive)
