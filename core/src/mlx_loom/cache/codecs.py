"""KV codecs: how a request names the storage its caches switch to.

The core's codecs, ``"affine"`` and ``"turboquant"``, are storage codecs
(:mod:`mlx_loom.cache.storage`) that every core layout takes: converting a
plain cache asks the cache for its form in the codec (``cache.to_codec``), so
full, window, batch and stacked forms all exist without a class each.

A plugin's codec is not a separate registry either. It is a set of
registered cache kinds that declare the same ``codec`` name and can be made
from a plain cache::

    class MyKVCache(KVCache):            # or any cache kind
        kind = "MyKVCache"
        codec = "my-codec"               # what kv_codec= names
        codec_bits = (4, 8)              # the kv_bits it accepts
        codec_default_bits = 8           # used when kv_codec is given without kv_bits

        @classmethod
        def from_plain(cls, cache, *, bits, group_size):
            ...  # this codec's form of ``cache``, or None if it is not this kind's plain kind

        def convert_like(self, plain): ...  # plain converted with this cache's settings

        def append(self, keys, values):     # its own view: its own arithmetic
            ...

A plugin adds a codec by registering its kinds (``loom_cache_kinds`` or
``Family(cache_kinds=...)``), and every family's graph then uses it — graphs
only ever call the view that ``append`` returns. Registering the kinds also
makes prompt-cache files of that codec loadable.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlx_loom.cache.storage import CODECS
from mlx_loom.errors import CapabilityRefused, RequestError

__all__ = ["KV_DTYPES", "KVCodec", "codec_table", "resolve_kv_codec", "resolve_kv_dtype"]

#: The codec ``kv_bits`` alone selects (mlx-lm's meaning of ``kv_bits``).
DEFAULT_CODEC = "affine"


@dataclass(frozen=True)
class KVCodec:
    """One codec: its name, and the storage codec class or the cache kinds that store in it."""

    name: str
    #: A plugin's cache kinds (classes declaring ``codec`` and ``from_plain``).
    kinds: tuple[Any, ...] = ()
    #: A storage codec class (``widths``, ``default_bits``, ``for_request``) every layout takes.
    storage: Any = None

    @property
    def bits(self) -> tuple[int, ...]:
        """The widths every kind of the codec accepts."""
        if self.storage is not None:
            return tuple(self.storage.widths)
        common: set[int] | None = None
        for cls in self.kinds:
            allowed = set(getattr(cls, "codec_bits", ()) or ())
            common = allowed if common is None else common & allowed
        return tuple(sorted(common or ()))

    @property
    def default_bits(self) -> int | None:
        if self.storage is not None:
            default: int = self.storage.default_bits
            return default
        for cls in self.kinds:
            bits = getattr(cls, "codec_default_bits", None)
            if isinstance(bits, int) and not isinstance(bits, bool):
                return bits
        return None

    def convert(self, cache: Any, *, bits: int, group_size: int) -> Any | None:
        """``cache`` in this codec, or ``None`` when no kind of the codec takes its kind.

        A plain cache that can take a storage codec (``to_codec``) is asked
        for its form in it; a batch cache refuses
        (:class:`~mlx_loom.errors.CapabilityRefused`).
        """
        to_codec = getattr(cache, "to_codec", None)
        if self.storage is not None and callable(to_codec) and getattr(cache, "codec", 0) is None:
            return to_codec(self.storage.for_request(bits=bits, group_size=group_size))
        for cls in self.kinds:
            converted = cls.from_plain(cache, bits=bits, group_size=group_size)
            if converted is not None:
                return converted
        return None

    def check_storable(self, caches: Any) -> None:
        """Refuse (:class:`~mlx_loom.errors.CapabilityRefused`) unless every KV cache converts.

        ``caches`` are a model's fresh caches; state with nothing to compress
        (recurrent caches, which have no ``to_quantized``) is left alone.
        """
        for cache in caches:
            if getattr(cache, "to_quantized", None) is None:
                continue
            bits = self.default_bits if self.default_bits is not None else 0
            if self.convert(cache, bits=bits, group_size=64) is None and self.name != "affine":
                kinds = ", ".join(k.__name__ for k in self.kinds) or "the core layouts"
                raise CapabilityRefused(
                    f"the {self.name!r} KV codec has no cache kind for a "
                    f"{type(cache).__name__} (its kinds: {kinds})",
                    fix="use a codec that stores every cache kind of this model (affine, "
                    f"turboquant), or drop kv_codec={self.name!r}",
                )


def codec_table(kinds: Mapping[str, type] | None = None) -> dict[str, KVCodec]:
    """The core's storage codecs, and every codec the cache-kind table ``kinds`` adds.

    ``kinds`` defaults to the core's kinds (which add none).
    """
    if kinds is None:
        from mlx_loom.cache import CACHE_KINDS  # the package imports this module

        kinds = CACHE_KINDS
    found: dict[str, list[type]] = {}
    for cls in kinds.values():
        name = getattr(cls, "codec", None)
        if isinstance(name, str) and name and callable(getattr(cls, "from_plain", None)):
            found.setdefault(name, []).append(cls)
    table = {name: KVCodec(name, storage=storage) for name, storage in CODECS.items()}
    for name, classes in found.items():
        core = table.get(name)
        table[name] = KVCodec(name, tuple(classes), storage=core.storage if core else None)
    return dict(sorted(table.items()))


def resolve_kv_codec(
    kv_codec: Any, kv_bits: Any, *, kinds: Mapping[str, type] | None = None
) -> tuple[KVCodec | None, int | None]:
    """The codec and width a request's ``kv_codec`` / ``kv_bits`` ask for.

    ``kv_bits`` alone means affine (as in mlx-lm); ``kv_codec`` alone uses the
    codec's default width; neither means no KV quantization. A codec name
    nobody registered, or a width the codec does not offer, is a
    :class:`~mlx_loom.errors.RequestError`.
    """
    if kv_codec is None:
        if kv_bits is None:
            return None, None
        kv_codec = DEFAULT_CODEC
    table = codec_table(kinds)
    if not isinstance(kv_codec, str) or kv_codec not in table:
        raise RequestError(
            f"kv_codec={kv_codec!r} is not a KV cache codec this installation provides",
            fix=f"use one of {sorted(table)} (or install the plugin that provides it)",
        )
    codec = table[kv_codec]
    bits = kv_bits if kv_bits is not None else codec.default_bits
    if isinstance(bits, bool) or bits not in codec.bits:
        raise RequestError(
            f"kv_bits={kv_bits!r} is not a width the {kv_codec!r} KV codec supports",
            fix=f"use kv_bits in {list(codec.bits)} with kv_codec={kv_codec!r}",
        )
    return codec, bits


#: The dtypes a KV cache may be stored in instead of the one it is computed in
#: (``kv_dtype=`` / ``--kv-dtype``): half the bytes of the CPU's float32 default.
KV_DTYPES: dict[str, Any] = {"float16": mx.float16, "bfloat16": mx.bfloat16}


def resolve_kv_dtype(kv_dtype: Any) -> Any | None:
    """The MLX dtype ``kv_dtype`` names (``None``: keys/values stay in the compute dtype).

    Raises :class:`~mlx_loom.errors.RequestError` for anything else.
    """
    if kv_dtype is None:
        return None
    if not isinstance(kv_dtype, str) or kv_dtype not in KV_DTYPES:
        raise RequestError(
            f"kv_dtype={kv_dtype!r} is not a KV storage dtype "
            f"(choose from {', '.join(KV_DTYPES)})",
            fix=f"pass kv_dtype in {list(KV_DTYPES)}, or omit it to store keys and values "
            "in the compute dtype",
            param="kv_dtype",
        )
    return KV_DTYPES[kv_dtype]


def kv_dtype_name(dtype: Any) -> str:
    """``"float16"`` for ``mx.float16``: the name ``kv_dtype=`` takes."""
    return next(name for name, d in KV_DTYPES.items() if d == dtype)
