"""The gated delta recurrence of linear-attention layers (Qwen3-Next, Qwen3.5), where
the forward being built has a native one.

Families run their own per-backend kernels for the recurrence (the ops
path is mlx-lm's ``mx.fast.gated_delta_update``). In a forward built on a
native CPU kernel set (:mod:`mlx_loom.forward_hooks`) the float32 update,
masked or not, is one native node instead (:func:`mlx_loom.cpu.ops.gated_delta`: each
state row read and written once per token, within a stated bound of MLX's
sums); a graph asks :func:`native_gated_delta` first and runs its own kernel
when it answers None. A speculative round's rollback replays the kept tokens
with the arithmetic the forward used: :func:`native_gated_delta_replay` gives
the replay to record beside a native forward (the hook is gone by the time
the round commits, so it keeps the kernel).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import mlx.core as mx

from ..forward_hooks import current_gated_delta

__all__ = ["native_gated_delta", "native_gated_delta_replay"]

#: ``replay(q, k, v, g, beta, state, mask=None, lengths=None) -> state`` (the
#: recurrent cache's state-only replay kernel).
Replay = Callable[..., Any]


def native_gated_delta(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
    mask: mx.array | None = None,
) -> tuple[mx.array, mx.array] | None:
    """``(y, state)`` of the update (``mask``: bool ``[B, T]``, padding steps keep the
    state) from the native kernel set of this forward, or None (not a native forward,
    or operands the native node does not take)."""
    kernel = current_gated_delta()
    if kernel is None:
        return None
    out: tuple[mx.array, mx.array] | None = kernel(q, k, v, g, beta, state, mask)
    return out


def native_gated_delta_replay(fallback: Replay) -> Replay | None:
    """The state-only replay matching this forward's native recurrence, or None (no
    native kernel in this forward).

    The kept prefix through the native node (with the round's padding mask),
    each row alone over its own kept length when they differ (rows are
    independent in the node, and a chunk equals its tokens one at a time, so
    this is the forward's state at that token bit for bit). Operands the node
    does not take go to ``fallback`` (the family's replay), as their forward did.
    """
    kernel = current_gated_delta()
    if kernel is None:
        return None

    def replay(
        q: mx.array,
        k: mx.array,
        v: mx.array,
        g: mx.array,
        beta: mx.array,
        state: mx.array,
        mask: mx.array | None = None,
        lengths: mx.array | None = None,
    ) -> mx.array:
        if lengths is None:
            out = kernel(q, k, v, g, beta, state, mask)
            if out is None:
                return cast(mx.array, fallback(q, k, v, g, beta, state, mask, lengths))
            return cast(mx.array, out[1])
        rows = []
        for b, n in enumerate(cast(list[int], lengths.tolist())):
            row = slice(b, b + 1)
            if n == 0:
                rows.append(state[row])
                continue
            kept = [a[row, :n] for a in (q, k, v, g, beta)]
            out = kernel(*kept, state[row], None if mask is None else mask[row, :n])
            if out is None:
                return cast(mx.array, fallback(q, k, v, g, beta, state, mask, lengths))
            rows.append(out[1])
        return mx.concatenate(rows, axis=0)

    return replay
