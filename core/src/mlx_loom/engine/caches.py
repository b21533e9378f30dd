"""The caches a request runs on: made fresh, bounded by ``max_kv_size``, grouped, copied.

The engine reaches caches only through the cache protocols
(:mod:`mlx_loom.cache.protocol`): ``make_cache()`` for fresh ones,
``stack`` / ``filter`` / ``extend`` / ``extract`` for batches, ``trim`` for
prefix reuse, ``state`` / ``from_state`` for copies.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any

from mlx_loom.cache.convert import convertible
from mlx_loom.errors import CapabilityRefused

if TYPE_CHECKING:
    from mlx_loom.model import Model


def fresh_caches(model: Model, max_kv_size: int | None) -> list[Any]:
    """The model's own caches, each attention layer bounded to ``max_kv_size`` if given.

    Each cache is asked for its bounded form (``cache.bounded(max_kv_size)``):
    a full cache becomes a sliding window of that many tokens in the same
    codec (``keep=0``: no leading "sink" tokens are pinned, so rows stay
    batchable), a wider window narrows, and recurrent state, which does not
    grow, is left as it is. A cache kind that cannot be bounded is refused — never
    left unbounded while the caller believes otherwise (mlx-lm ignores
    ``max_kv_size`` for every model that makes its own caches).
    """
    caches = model.make_cache()
    if max_kv_size is None:
        return caches
    return [_bounded(c, max_kv_size) for c in caches]


def _bounded(cache: Any, n: int) -> Any:
    """The cache's own bounded form (:class:`~mlx_loom.cache.protocol.Boundable`)."""
    bounded = getattr(cache, "bounded", None)
    if not callable(bounded):
        raise CapabilityRefused(
            f"max_kv_size={n} cannot bound a {type(cache).__name__} cache (this model makes one "
            "per layer of that kind, and the kind has no bounded form).",
            fix="Drop max_kv_size for this model.",
        )
    return bounded(n)


def layout(caches: Sequence[Any]) -> tuple[Hashable, ...]:
    """What must match for two rows' caches to be stacked into one batch.

    Key/value caches (kinds with ``append``) need only the same attention
    geometry — full, or a window of the same size — since rows of different
    codecs share a batch through :class:`~mlx_loom.cache.mixed.MixedRowsCache`;
    other state (recurrent caches) must be of the same kind.
    """
    return tuple(_layer_layout(c) for c in caches)


def _layer_layout(c: Any) -> Hashable:
    if callable(getattr(c, "append", None)):
        return ("kv", getattr(c, "max_size", None), getattr(c, "keep", None))
    return (
        type(c).__name__,
        getattr(c, "max_size", None),
        getattr(c, "bits", None),
        getattr(c, "group_size", None),
    )


def stackable(caches: Sequence[Any]) -> bool:
    """Whether every cache kind here can become the row of a batch (``stack``)."""
    return all(callable(getattr(type(c), "stack", None)) for c in caches)


def quantization_pending(caches: Sequence[Any], bits: int | None) -> bool:
    """True while a request asked for KV quantization that has not happened yet.

    Such a row decodes alone: it switches its caches to quantized storage at
    its own point (``quantized_kv_start``), which a shared batch cache could
    not do for one row.
    """
    return bits is not None and any(convertible(c) for c in caches)


def snapshot(caches: Sequence[Any]) -> list[Any]:
    """Independent copies of single-row caches (new objects over the same values).

    MLX arrays are values, but slice assignment rebinds the array *object*
    it is applied to; two caches must therefore never share an array object.
    The copies share memory with the originals until either is written.
    """
    out = []
    for c in caches:
        state = [a[...] for a in c.state]
        out.append(type(c).from_state(state, c.meta_state))
    return out
