"""Attention's head layout: ``[B, L, H * D]`` projections to ``[B, H, L, D]`` heads and back.

Every family writes the same two steps around its attention, as mlx-lm does:
``x.reshape(B, L, H, D).transpose(0, 2, 1, 3)`` before it and
``out.transpose(0, 2, 1, 3).reshape(B, L, H * D)`` after. Each is a graph
node, and a node costs time whether it moves bytes or not (a compiled
function of 600 reshape and transpose views took ~0.73 ms longer to
evaluate than one without them on the CPU: ~1.2 us a node, on the thread
that every other node waits for). With one new token (``L == 1``, every
decode step) the transpose only moves an axis of size one: ``[B, 1, H, D]`` and
``[B, H, 1, D]`` are the same bytes in the same order. So for one token these
helpers reshape once and skip the transpose — four nodes a layer fewer in a
Llama's decode step (a quarter of its view nodes), the same values and the
same bits downstream. For several tokens they do exactly what the families
did before.

``norm`` applies a per-head norm (Qwen3's and Gemma's ``q_norm``/``k_norm``)
on the ``[B, L, H, D]`` layout the families apply it to, before the
transpose; for one token both layouts are the same rows in the same order.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx


def split_heads(
    x: mx.array, n_heads: int, norm: Callable[[mx.array], mx.array] | None = None
) -> mx.array:
    """``[B, L, n_heads * D]`` → ``[B, n_heads, L, D]``, ``norm`` applied per head first."""
    B, L, _ = x.shape
    if L == 1:
        heads = x.reshape(B, n_heads, 1, -1)
        return heads if norm is None else norm(heads)
    heads = x.reshape(B, L, n_heads, -1)
    if norm is not None:
        heads = norm(heads)
    return heads.transpose(0, 2, 1, 3)


def merge_heads(x: mx.array) -> mx.array:
    """``[B, H, L, D]`` → ``[B, L, H * D]``."""
    B, H, L, D = x.shape
    if L == 1:
        return x.reshape(B, 1, H * D)
    return x.transpose(0, 2, 1, 3).reshape(B, L, H * D)
