"""The gated activations of GLU feed-forwards, compiled the way mlx-lm compiles them.

Why compiled: ``mx.compile(shapeless=True)`` fuses the activation and the
product into one elementwise kernel. Fused and unfused graphs round bf16
intermediates at different places, so only the same compiled function gives
bf16 MLP outputs bit-equal to mlx-lm's (the parity tests compare them bit for
bit). Both take ``(gate, up)``: the gate goes through the nonlinearity.
On the native CPU kernel sets SwiGLU in float32 is one native node with the
same arithmetic (see :func:`swiglu`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import mlx.core as mx
import mlx.nn as nn

from ..forward_hooks import current_silu_mul

__all__ = ["Activation", "geglu", "swiglu"]

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
def geglu(gate: mx.array, up: mx.array) -> mx.array:
    """GeGLU with the tanh approximation (Gemma): ``gelu_tanh(gate) * up``."""
    return nn.gelu_approx(gate) * up
