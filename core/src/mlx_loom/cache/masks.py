"""Attention masks: the causal/window/padding mask every attention graph uses.

The semantics follow mlx-lm's ``create_causal_mask`` / ``create_attention_mask``
exactly (same boolean arrays, same ``"causal"`` / ``None`` shortcuts), because
parity tests compare our graphs' outputs against mlx-lm's bit for bit and a
different mask shape or shortcut changes which attention kernel path runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from mlx_loom.cache.protocol import Mask

__all__ = ["create_attention_mask", "create_causal_mask", "mask_for_offset"]


def _as_array(x: Sequence[int] | mx.array | None) -> mx.array | None:
    if x is None or isinstance(x, mx.array):
        return x
    return mx.array(list(x))


def create_causal_mask(
    N: int,
    offset: int = 0,
    window_size: int | None = None,
    left_padding: Sequence[int] | mx.array | None = None,
    right_padding: Sequence[int] | mx.array | None = None,
) -> mx.array:
    """Boolean mask ``[N, offset + N]`` (or ``[B, 1, N, offset + N]`` with padding).

    Query ``i`` sits at absolute position ``offset + i`` and may see key ``j``
    when ``j <= offset + i``, and, with a window, ``offset + i - j < window``.
    Per-row ``left_padding`` hides the first pads of each row, per-row
    ``right_padding`` the last ones; both add the batch and head axes.
    """
    keys_pos = mx.arange(offset + N)
    query_pos = mx.arange(offset, offset + N) if offset else keys_pos
    query_pos = query_pos[:, None]
    keys_pos = keys_pos[None]
    mask = query_pos >= keys_pos
    if window_size is not None:
        mask = mask & (query_pos < keys_pos + window_size)
    right = _as_array(right_padding)
    if right is not None:
        mask = mask & (keys_pos < mx.expand_dims((offset + N) - right, (1, 2, 3)))
    left = _as_array(left_padding)
    if left is not None:
        mask = mask & (mx.expand_dims(left, (1, 2, 3)) <= keys_pos)
    return mask


def mask_for_offset(
    N: int, offset: int, *, window_size: int | None = None, return_array: bool = False
) -> Mask:
    """The mask a single-row full cache at ``offset`` needs for ``N`` new queries.

    ``None`` for one query without a window (it sees every key), ``"causal"``
    when the fused kernel can build the mask itself, else a boolean array.
    """
    if window_size is not None:
        return create_causal_mask(N, offset, window_size=window_size)
    if N == 1:
        return None
    if return_array:
        return create_causal_mask(N, offset)
    return "causal"


def create_attention_mask(
    h: mx.array,
    cache: Any = None,
    window_size: int | None = None,
    return_array: bool = False,
) -> Mask:
    """The mask for hidden states ``h`` (``[B, L, D]``) attending through ``cache``.

    A cache knows its own offset, window and padding, so it builds the mask;
    without one, the prompt is the whole sequence.
    """
    N = h.shape[1]
    if cache is not None and hasattr(cache, "make_mask"):
        return cache.make_mask(N, return_array=return_array, window_size=window_size)
    if N == 1:
        return None
    if return_array or (window_size and N > window_size):
        return create_causal_mask(N, window_size=window_size)
    return "causal"
