"""The gated delta recurrence of linear-attention layers (Qwen3-Next, Qwen3.5), where
the forward being built has a native one.

Families run their own per-backend kernels for the recurrence (the ops
path is mlx-lm's ``mx.fast.gated_delta_update``). In a forward built on a
native CPU kernel set (:mod:`mlx_loom.forward_hooks`) the unmasked float32
update is one native node instead (:func:`mlx_loom.cpu.ops.gated_delta`: each
state row read and written once per token, within a stated bound of MLX's
sums); a graph asks :func:`native_gated_delta` first and runs its own kernel
when it answers None.
"""

from __future__ import annotations

import mlx.core as mx

from ..forward_hooks import current_gated_delta

__all__ = ["native_gated_delta"]


def native_gated_delta(
    q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array
) -> tuple[mx.array, mx.array] | None:
    """``(y, state)`` of the unmasked update from the native kernel set of this forward,
    or None (not a native forward, or operands the native node does not take)."""
    kernel = current_gated_delta()
    if kernel is None:
        return None
    out: tuple[mx.array, mx.array] | None = kernel(q, k, v, g, beta, state)
    return out
