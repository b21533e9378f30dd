"""RMS normalisation as a function, for graphs that call it rather than hold an
``nn.RMSNorm`` module (a norm without a gain, a gain computed in the graph).

The native CPU kernel sets swap ``nn.RMSNorm`` modules for a native node;
``mx.fast.rms_norm`` called directly stays on MLX's CPU fallback, a chain of
element-wise and reduction nodes. :func:`rms_norm` is ``mx.fast.rms_norm``
everywhere but in a forward built on a native set (:mod:`mlx_loom.forward_hooks`),
where it is the swapped modules' node, with their bound (docs/cpu.md).
"""

from __future__ import annotations

import mlx.core as mx

from ..forward_hooks import current_rms_norm

__all__ = ["rms_norm"]


def rms_norm(x: mx.array, weight: mx.array | None, eps: float) -> mx.array:
    """``mx.fast.rms_norm(x, weight, eps)``, natively in a native forward."""
    native = current_rms_norm()
    if native is not None:
        out: mx.array = native(x, weight, eps)
        return out
    return mx.fast.rms_norm(x, weight, eps)
