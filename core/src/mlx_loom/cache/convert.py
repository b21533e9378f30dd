"""Switching a model's caches to affine-quantized KV once a prompt is long enough.

Semantics follow mlx-lm's ``maybe_quantize_kv_cache`` for full caches: nothing
happens without ``kv_bits``; otherwise each cache that can be quantized is
replaced, in place in the list, once its ``offset`` reaches
``quantized_kv_start``. Beyond mlx-lm, sliding-window caches become
:class:`~mlx_loom.cache.quantized.QuantizedRotatingKVCache` (mlx-lm raises
"NYI"), and batch caches are refused instead of being skipped silently.
Caches with no keys/values to quantize (recurrent state) and caches that are
already quantized are left as they are.
"""

from __future__ import annotations

from typing import Any

from mlx_loom.cache._buffers import KV_BITS, KV_GROUP_SIZES
from mlx_loom.errors import RequestError

__all__ = ["maybe_quantize_kv_cache", "validate_kv_quantization"]


def validate_kv_quantization(
    *, kv_bits: int | None, kv_group_size: int, quantized_kv_start: int
) -> None:
    """Refuse KV quantization parameters that no cache could honour."""
    if kv_bits is not None and (isinstance(kv_bits, bool) or kv_bits not in KV_BITS):
        raise RequestError(
            f"kv_bits={kv_bits!r} is not a supported KV cache quantization width",
            fix=f"use one of {list(KV_BITS)} (4 or 8 are the usual choices), or None",
        )
    if isinstance(kv_group_size, bool) or kv_group_size not in KV_GROUP_SIZES:
        raise RequestError(
            f"kv_group_size={kv_group_size!r} is not a supported KV quantization group size",
            fix=f"use one of {list(KV_GROUP_SIZES)}",
        )
    if (
        isinstance(quantized_kv_start, bool)
        or not isinstance(quantized_kv_start, int)
        or quantized_kv_start < 0
    ):
        raise RequestError(
            f"quantized_kv_start={quantized_kv_start!r} must be a non-negative int",
            fix="pass the prompt length (in tokens) after which the KV cache is quantized",
        )


def maybe_quantize_kv_cache(
    caches: list[Any], *, kv_bits: int | None, kv_group_size: int, quantized_kv_start: int
) -> None:
    """Replace each quantizable cache in ``caches`` by its quantized form once due.

    Batch caches (per-row ``offset`` arrays) raise
    :class:`~mlx_loom.errors.CapabilityRefused` when ``kv_bits`` is set.
    """
    validate_kv_quantization(
        kv_bits=kv_bits, kv_group_size=kv_group_size, quantized_kv_start=quantized_kv_start
    )
    if kv_bits is None:
        return
    for i, cache in enumerate(caches):
        to_quantized = getattr(cache, "to_quantized", None)
        if to_quantized is None:
            continue
        offset = cache.offset
        # A batch cache's offset is an array: its to_quantized refuses at once,
        # whatever the offsets, so the request fails before any work is done.
        if not isinstance(offset, int) or offset >= quantized_kv_start:
            caches[i] = to_quantized(group_size=kv_group_size, bits=kv_bits)
