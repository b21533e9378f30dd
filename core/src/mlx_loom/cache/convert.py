"""Switching a model's caches to a KV codec once a prompt is long enough.

Semantics follow mlx-lm's ``maybe_quantize_kv_cache`` for full caches: nothing
happens without ``kv_bits`` (or ``kv_codec``); otherwise each cache that can
be quantized is replaced, in place in the list, once its ``offset`` reaches
``quantized_kv_start``. The codec is affine (mlx-lm's) unless ``kv_codec``
names another (:mod:`mlx_loom.cache.codecs`). Beyond mlx-lm, sliding-window
caches are converted too (mlx-lm raises "NYI"), and batch caches are refused
instead of being skipped silently. Caches with no keys/values to quantize
(recurrent state) and caches that are already in a codec are left as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mlx_loom.cache._buffers import KV_BITS, KV_GROUP_SIZES
from mlx_loom.cache.codecs import resolve_kv_codec
from mlx_loom.errors import CapabilityRefused, RequestError

__all__ = ["convertible", "maybe_quantize_kv_cache", "validate_kv_quantization"]


def convertible(cache: Any) -> bool:
    """Whether a codec may still take ``cache``: KV storage, still plain.

    Recurrent state has nothing to compress (no ``to_quantized``); a cache
    already in a codec names it (``codec``, a string).
    """
    return hasattr(cache, "to_quantized") and not isinstance(getattr(cache, "codec", None), str)


def validate_kv_quantization(
    *,
    kv_bits: int | None,
    kv_group_size: int,
    quantized_kv_start: int,
    kv_codec: str | None = None,
    kinds: Mapping[str, type] | None = None,
) -> None:
    """Refuse KV quantization parameters that no cache could honour."""
    if kv_codec is not None:
        resolve_kv_codec(kv_codec, kv_bits, kinds=kinds)
    elif kv_bits is not None and (isinstance(kv_bits, bool) or kv_bits not in KV_BITS):
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
    caches: list[Any],
    *,
    kv_bits: int | None,
    kv_group_size: int,
    quantized_kv_start: int,
    kv_codec: str | None = None,
    kinds: Mapping[str, type] | None = None,
) -> None:
    """Replace each quantizable cache in ``caches`` by its codec's form once due.

    ``kinds`` is the cache-kind table the codecs come from (a model's
    registry table, which holds the kinds plugins registered; default: the
    core's). Batch caches (per-row ``offset`` arrays) raise
    :class:`~mlx_loom.errors.CapabilityRefused`.
    """
    validate_kv_quantization(
        kv_bits=kv_bits,
        kv_group_size=kv_group_size,
        quantized_kv_start=quantized_kv_start,
        kv_codec=kv_codec,
        kinds=kinds,
    )
    codec, bits = resolve_kv_codec(kv_codec, kv_bits, kinds=kinds)
    if codec is None or bits is None:
        return
    for i, cache in enumerate(caches):
        if not convertible(cache):
            continue  # nothing to compress (recurrent state), or already in a codec
        to_quantized = cache.to_quantized
        offset = cache.offset
        # A batch cache's offset is an array: it is refused at once, whatever
        # the offsets, so the request fails before any work is done.
        if isinstance(offset, int) and offset < quantized_kv_start:
            continue
        converted = codec.convert(cache, bits=bits, group_size=kv_group_size)
        if converted is None:
            if codec.name == "affine":
                converted = to_quantized(group_size=kv_group_size, bits=bits)  # refuses batches
            else:
                kinds_of = ", ".join(k.__name__ for k in codec.kinds) or "the core layouts"
                raise CapabilityRefused(
                    f"the {codec.name!r} KV codec has no cache kind for a "
                    f"{type(cache).__name__} (its kinds: {kinds_of})",
                    fix="use a codec that stores every cache kind of this model (affine, "
                    f"turboquant), or drop kv_codec={codec.name!r}",
                )
        caches[i] = converted
