"""Attention views: what appending keys/values to a cache hands back.

A graph does not ask what kind of cache a layer has. It appends the step's
keys and values (:func:`append_kv`, i.e. ``cache.append(keys, values)``) and
gets a *view* that attends: ``view.attend(queries, scale=, mask=, sinks=)``.
The view belongs to the cache's storage codec, so each codec keeps its own
arithmetic — plain arrays go to the fused kernel, affine triples to
``mx.quantized_matmul``, TurboQuant's int8 keys and rotated codebook values to
its deferred-V attention, and a codec a plugin registers to whatever it
brings — while the graph supplies one query batch.

Two more views compose the others:

* :class:`DonorView` is what a KV-shared layer (Gemma 4) attends through: the
  donor layer's view, captured as it is (no copy), with the donor's per-row
  RoPE offsets kept beside it. The mask — which carries each row's padding
  and window validity — comes from the donor kind's cache, so offsets
  (positions) and validity (which slots a row may see) never mix with
  padding.
* :class:`RowsView` runs rows of different codecs in one query batch: each
  segment of rows attends through its own codec's view, and the outputs are
  put back in batch order. A row's output is exactly what its segment's
  view computes for it, which is what the row computes alone.

The plain and affine views keep mlx-lm's op graphs call for call, so parity
with mlx-lm stays bit-equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import mlx.core as mx

from mlx_loom.cache.attention import quantized_scaled_dot_product_attention
from mlx_loom.errors import CacheError
from mlx_loom.forward_hooks import current_attention, current_kv_dtype

__all__ = [
    "AffineView",
    "DonorView",
    "KVView",
    "PlainView",
    "RowsMask",
    "RowsView",
    "append_kv",
]


@runtime_checkable
class KVView(Protocol):
    """Keys/values a layer attends over, with the arithmetic of their storage."""

    def attend(
        self, queries: mx.array, *, scale: float, mask: Any, sinks: mx.array | None = None
    ) -> mx.array:
        """Softmax attention of ``queries`` ``[B, Hq, L, D]`` over the view: ``[B, Hq, L, Dv]``."""


@dataclass(frozen=True)
class PlainView:
    """Keys/values as arrays ``[B, Hkv, S, D]``: ``mx.fast.scaled_dot_product_attention``,
    or the native CPU attention while a ``cpu-native`` model's forward is built
    (:func:`mlx_loom.cpu.ops.current_attention`)."""

    keys: mx.array
    values: mx.array

    def attend(
        self, queries: mx.array, *, scale: float, mask: Any, sinks: mx.array | None = None
    ) -> mx.array:
        kernel = current_attention()
        if kernel is not None and sinks is None:
            return kernel(queries, self.keys, self.values, scale=scale, mask=single_mask(mask))
        keys, values = self.keys, self.values
        if keys.dtype != queries.dtype:
            # Keys stored in another precision (``kv_dtype``) attend in the
            # queries' dtype on MLX's kernel, as they are read by the native one.
            keys, values = keys.astype(queries.dtype), values.astype(queries.dtype)
        return mx.fast.scaled_dot_product_attention(
            queries, keys, values, scale=scale, mask=single_mask(mask), sinks=sinks
        )


@dataclass(frozen=True)
class AffineView:
    """Affine-quantized ``(packed, scales, biases)`` keys/values: ``mx.quantized_matmul``."""

    keys: tuple[mx.array, mx.array, mx.array]
    values: tuple[mx.array, mx.array, mx.array]
    group_size: int
    bits: int

    def attend(
        self, queries: mx.array, *, scale: float, mask: Any, sinks: mx.array | None = None
    ) -> mx.array:
        return quantized_scaled_dot_product_attention(
            queries,
            self.keys,
            self.values,
            scale=scale,
            mask=single_mask(mask),
            group_size=self.group_size,
            bits=self.bits,
            sinks=sinks,
        )


@dataclass(frozen=True)
class DonorView:
    """A KV-shared layer's view of its donor: the donor's view (not a copy) and its offsets.

    ``offset`` is the RoPE position the donor used — an int, or one per row in
    a batch — so the sharing layer rotates its queries to the same positions.
    """

    view: KVView
    offset: Any

    def attend(
        self, queries: mx.array, *, scale: float, mask: Any, sinks: mx.array | None = None
    ) -> mx.array:
        return self.view.attend(queries, scale=scale, mask=mask, sinks=sinks)


@dataclass(frozen=True)
class RowsMask:
    """One mask per segment of a :class:`RowsView` (segments differ in key length)."""

    masks: tuple[Any, ...]


@dataclass(frozen=True)
class RowsView:
    """Rows of different codecs in one query batch.

    ``segments[s]`` attends for the batch rows ``rows[s]`` (indices into the
    batch); every batch row is in exactly one segment. The mask is a
    :class:`RowsMask` with one mask per segment, or one mask shared by all.
    """

    segments: tuple[KVView, ...]
    rows: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        flat = sorted(r for rows in self.rows for r in rows)
        if len(self.segments) != len(self.rows) or flat != list(range(len(flat))):
            raise CacheError(
                f"RowsView: {len(self.segments)} segments over rows {self.rows} do not cover "
                "each batch row exactly once",
                fix="give one row list per segment, covering rows 0..B-1 once each",
            )

    @property
    def batch_size(self) -> int:
        return sum(len(r) for r in self.rows)

    def attend(
        self, queries: mx.array, *, scale: float, mask: Any, sinks: mx.array | None = None
    ) -> mx.array:
        if queries.shape[0] != self.batch_size:
            raise CacheError(
                f"RowsView: {queries.shape[0]} query rows for a batch of {self.batch_size}",
                fix="pass one query row per batch row",
            )
        masks = mask.masks if isinstance(mask, RowsMask) else (mask,) * len(self.segments)
        if len(masks) != len(self.segments):
            raise CacheError(
                f"RowsView: {len(masks)} masks for {len(self.segments)} segments",
                fix="build the mask with the cache that returned this view",
            )
        outs = []
        for view, rows, m in zip(self.segments, self.rows, masks, strict=True):
            idx = mx.array(rows, dtype=mx.int32)
            q = queries[idx]
            if isinstance(m, mx.array) and m.ndim == 4 and m.shape[0] == queries.shape[0] > 1:
                m = m[idx]
            outs.append(view.attend(q, scale=scale, mask=m, sinks=sinks))
        out = mx.concatenate(outs) if len(outs) > 1 else outs[0]
        order = [r for rows in self.rows for r in rows]
        if order == list(range(len(order))):
            return out
        inverse = [0] * len(order)
        for pos, r in enumerate(order):
            inverse[r] = pos
        return out[mx.array(inverse, dtype=mx.int32)]


def single_mask(mask: Any) -> Any:
    """``mask`` for a single-codec view; a per-segment :class:`RowsMask` here is a bug."""
    if isinstance(mask, RowsMask):
        raise CacheError(
            "a per-segment mask reached a single-codec view",
            fix="build the mask with the cache whose view attends",
        )
    return mask


def append_kv(cache: Any, keys: mx.array, values: mx.array) -> KVView:
    """Append ``keys``/``values`` to ``cache`` and return its view; no cache: the arrays alone.

    The one call graphs make per attention layer: it never tests what kind
    of cache it has. A model loaded with ``kv_dtype=`` stores its keys and
    values in that dtype (:func:`mlx_loom.forward_hooks.current_kv_dtype`):
    they are cast here, before the cache sees them, so the step's own keys
    are attended in the stored precision too (a cache holds nothing else).
    """
    if cache is None:
        return PlainView(keys, values)
    dtype = current_kv_dtype()
    if dtype is not None and keys.dtype != dtype and mx.issubdtype(keys.dtype, mx.floating):
        keys, values = keys.astype(dtype), values.astype(dtype)
    append = getattr(cache, "append", None)
    if not callable(append):
        raise CacheError(
            f"{type(cache).__name__} has no append(keys, values) returning an attention view",
            fix="implement the AttentionCache protocol's append() on the cache kind "
            "(return e.g. mlx_loom.cache.PlainView(keys, values))",
        )
    view = append(keys, values)
    if not callable(getattr(view, "attend", None)):
        raise CacheError(
            f"{type(cache).__name__}.append returned a {type(view).__name__}, which cannot attend",
            fix="return a view with attend(queries, *, scale, mask, sinks=None)",
        )
    return view
