"""The gated activations of GLU feed-forwards, compiled the way mlx-lm compiles them.

Why compiled: ``mx.compile(shapeless=True)`` fuses the activation and the
product into one elementwise kernel. Fused and unfused graphs round bf16
intermediates at different places, so only the same compiled function gives
bf16 MLP outputs bit-equal to mlx-lm's (the parity tests compare them bit for
bit). Both take ``(gate, up)``: the gate goes through the nonlinearity.
On the native CPU kernel sets SwiGLU in float32 is one native node with the
same arithmetic (see :func:`swiglu`), and GeGLU in float32 one native node
within a stated bound of MLX's (see :func:`geglu`). The logit soft cap
(:func:`softcap`) lives here too: the same tanh, the same native rule.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import mlx.core as mx
import mlx.nn as nn

from ..forward_hooks import current_gelu_mul, current_silu_mul, current_softcap

__all__ = ["Activation", "gelu_approx_mul", "geglu", "native_geglu", "softcap", "swiglu"]

#: ``(gate, up) -> act(gate) * up``.
Activation = Callable[[mx.array, mx.array], mx.array]


@partial(mx.compile, shapeless=True)
def _swiglu_ops(gate: mx.array, up: mx.array) -> mx.array:
    return nn.silu(gate) * up


def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """SwiGLU (Llama, Qwen): ``silu(gate) * up``.

    In a forward built on a native CPU kernel set (:mod:`mlx_loom.forward_hooks`)
    float32 operands of one shape go to the native gate, which computes the
    compiled function's exact arithmetic eight lanes at a time (bit-equal,
    tested); everything else runs the compiled MLX function.
    """
    native = current_silu_mul()
    if native is not None and gate.dtype == up.dtype == mx.float32 and gate.shape == up.shape:
        return native(gate, up)
    return _swiglu_ops(gate, up)


@partial(mx.compile, shapeless=True)
def _geglu_ops(gate: mx.array, up: mx.array) -> mx.array:
    return nn.gelu_approx(gate) * up


def _native_gelu_mul(gate: mx.array, up: mx.array) -> Activation | None:
    native = current_gelu_mul()
    if native is not None and gate.dtype == up.dtype == mx.float32 and gate.shape == up.shape:
        return native
    return None


def native_geglu() -> bool:
    """Whether the forward being built provides the native GeGLU gate.

    Read from the hook :func:`geglu` reads, for a caller that fuses the gate
    into a node of its own (the native gated MLP), so that it and
    :func:`geglu` never disagree about which gate a forward uses.
    """
    return current_gelu_mul() is not None


def geglu(gate: mx.array, up: mx.array) -> mx.array:
    """GeGLU with the tanh approximation (Gemma): ``gelu_tanh(gate) * up``.

    In a forward built on a native CPU kernel set, float32 operands of one
    shape go to the native gate: MLX's CPU backend calls the C library's
    ``tanhf`` (and ``powf`` for the cube) one element at a time, ~5-7 % of a
    Gemma-4-shaped decode step; the native gate computes the tanh from one
    vectorised exp, within ``2**-21 * |gate * up|`` of MLX's result (tested;
    docs/cpu.md). Everything else runs the compiled MLX function, as mlx-lm.
    """
    native = _native_gelu_mul(gate, up)
    return native(gate, up) if native is not None else _geglu_ops(gate, up)


def gelu_approx_mul(gate: mx.array, up: mx.array) -> mx.array:
    """``gelu_approx(gate) * up`` as two MLX operations (mlx-lm's order where it
    does not fuse them, e.g. Gemma's per-layer input gate: in bfloat16 the
    unfused pair rounds the activation before the product), or the native
    GeGLU gate in a native float32 forward, as :func:`geglu`."""
    native = _native_gelu_mul(gate, up)
    return native(gate, up) if native is not None else mx.multiply(nn.gelu_approx(gate), up)


@partial(mx.compile, shapeless=True)
def _softcap_ops(cap: float, x: mx.array) -> mx.array:
    return mx.tanh(x / cap) * cap


def softcap(x: mx.array, cap: float) -> mx.array:
    """The logit soft cap (Gemma): ``tanh(x / cap) * cap``.

    Outside a native forward it is mlx-lm's compiled function, bit for bit.
    In a forward built on a native CPU kernel set float32 x goes to the
    native node: MLX's CPU backend calls the C library's ``tanhf`` one
    element at a time, ~0.5 ms a token over a 32,000-entry vocabulary (~5 %
    of a Gemma-4-shaped decode step, on the thread every other operation
    waits for); the native node computes :func:`geglu`'s tanh eight lanes
    at a time, within ``2**-21 * cap`` of MLX's result (tested; docs/cpu.md).
    """
    native = current_softcap()
    if native is not None and x.dtype == mx.float32 and 0.0 < cap <= 3.0e38:
        return native(x, cap)
    return _softcap_ops(cap, x)
