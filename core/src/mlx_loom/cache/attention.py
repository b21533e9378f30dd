"""Affine-quantized attention: the arithmetic of :class:`~mlx_loom.cache.AffineView`.

Keys/values from an affine-quantized cache are ``(packed, scales, biases)``
triples; attending over them uses ``mx.quantized_matmul`` for both products,
with the same op graph as mlx-lm's ``quantized_scaled_dot_product_attention``
so outputs are bit-equal to it (parity-tested).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlx_loom.cache.protocol import Mask
from mlx_loom.errors import CacheError

__all__ = ["quantized_scaled_dot_product_attention"]

QuantizedTensor = tuple[mx.array, mx.array, mx.array]


def _check_triple(x: Any, name: str) -> QuantizedTensor:
    if not (isinstance(x, tuple) and len(x) == 3 and all(isinstance(a, mx.array) for a in x)):
        raise CacheError(
            f"quantized attention: {name} must be a (packed, scales, biases) triple from a "
            f"quantized cache; found {type(x).__name__}",
            fix="pass the keys/values the quantized cache's update_and_fetch returned",
        )
    return x


def quantized_scaled_dot_product_attention(
    queries: mx.array,
    q_keys: QuantizedTensor,
    q_values: QuantizedTensor,
    *,
    scale: float,
    mask: Mask,
    group_size: int = 64,
    bits: int = 8,
    sinks: mx.array | None = None,
) -> mx.array:
    """Softmax attention of ``queries`` ``[B, Hq, L, D]`` over affine-quantized keys/values.

    Grouped-query heads are handled by viewing queries as
    ``[B, Hkv, Hq/Hkv, L, D]`` and broadcasting the keys over the group axis,
    rather than repeating the quantized keys.

    ``sinks`` (``[Hq]``, gpt-oss) are learned logits, one per query head, that
    join every row's softmax as an extra key with no value: they take a share
    of the attention and are then dropped, as in
    ``mx.fast.scaled_dot_product_attention(..., sinks=)``. (mlx-lm refuses
    sinks with a quantized cache; this is the same arithmetic as the plain
    kernel up to the keys' quantization, tested against it.)
    """
    q_keys = _check_triple(q_keys, "keys")
    q_values = _check_triple(q_values, "values")
    B, n_q_heads, L, D = queries.shape
    n_kv_heads = q_keys[0].shape[-3]
    n_repeats = n_q_heads // n_kv_heads

    # Scale the queries before the product (not the scores), as mlx-lm does:
    # the rounding differs otherwise and parity is bit-exact.
    queries = queries * scale
    if n_repeats > 1:
        queries = mx.reshape(queries, (B, n_kv_heads, n_repeats, L, D))
        q_keys = _expand_heads(q_keys)
        q_values = _expand_heads(q_values)

    scores = mx.quantized_matmul(queries, *q_keys, transpose=True, group_size=group_size, bits=bits)
    if mask is not None:
        if isinstance(mask, str):
            if mask != "causal":
                raise CacheError(
                    f"quantized attention: mask string {mask!r} is not 'causal'",
                    fix="pass None, 'causal' or a boolean/additive mask array",
                )
            qL, kL = scores.shape[-2:]
            mask = mx.arange(kL - qL, kL)[:, None] >= mx.arange(kL)[None]
        if n_repeats > 1 and mask.ndim > 3:
            mask = mx.expand_dims(mask, -3)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    if sinks is not None:
        heads = (n_kv_heads, n_repeats) if n_repeats > 1 else (n_q_heads,)
        sink = mx.reshape(sinks.astype(scores.dtype), (*heads, 1, 1))
        sink = mx.broadcast_to(sink, (*scores.shape[:-1], 1))
        scores = mx.concatenate([sink, scores], axis=-1)
    scores = mx.softmax(scores, axis=-1, precise=True)
    if sinks is not None:
        scores = scores[..., 1:]
    out = mx.quantized_matmul(scores, *q_values, transpose=False, group_size=group_size, bits=bits)
    if n_repeats > 1:
        out = mx.reshape(out, (B, n_q_heads, L, -1))
    return out


def _expand_heads(x: tuple[mx.array, mx.array, mx.array]) -> tuple[mx.array, mx.array, mx.array]:
    """A ``(packed, scales, biases)`` triple with a query-group axis before the sequence."""
    a, b, c = (mx.expand_dims(t, axis=-3) for t in x)
    return a, b, c
