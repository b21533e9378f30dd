"""The gated activations of GLU feed-forwards, compiled the way mlx-lm compiles them.

Why compiled: ``mx.compile(shapeless=True)`` fuses the activation and the
product into one elementwise kernel. Fused and unfused graphs round bf16
intermediates at different places, so only the same compiled function gives
bf16 MLP outputs bit-equal to mlx-lm's (the parity tests compare them bit for
bit). Both take ``(gate, up)``: the gate goes through the nonlinearity.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import mlx.core as mx
import mlx.nn as nn

__all__ = ["Activation", "geglu", "swiglu"]

#: ``(gate, up) -> act(gate) * up``.
Activation = Callable[[mx.array, mx.array], mx.array]


@partial(mx.compile, shapeless=True)
def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """SwiGLU (Llama, Qwen): ``silu(gate) * up``."""
    return nn.silu(gate) * up


@partial(mx.compile, shapeless=True)
def geglu(gate: mx.array, up: mx.array) -> mx.array:
    """GeGLU with the tanh approximation (Gemma): ``gelu_tanh(gate) * up``."""
    return nn.gelu_approx(gate) * up
