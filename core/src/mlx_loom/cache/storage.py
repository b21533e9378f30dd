"""The storage codecs a cache layout takes, and how a layout names its codec in its state.

A KV cache is a *layout* — full (:class:`~mlx_loom.cache.KVCache`), sliding
window (:class:`~mlx_loom.cache.RotatingKVCache`), and their batch and
stacked forms — over a storage *codec*: plain, affine
(:class:`~mlx_loom.cache._buffers.AffineCodec`, ``bits`` per ``group_size``),
TurboQuant (:class:`~mlx_loom.cache.turboquant.TurboQuantCodec`), or a
plugin's. The layout moves whole token slots; the codec says what a slot
holds and how attention reads it, so every combination works without a
class of its own.

A layout's ``meta_state`` is its own fields followed, for a named codec, by
the codec's name and :meth:`meta` (``("affine", "64", "4")``); a plain
cache's state is exactly what it was before codecs existed. :data:`CODECS`
maps the names the core can recreate from a file.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, ClassVar

from mlx_loom.cache._buffers import AffineCodec, PlainCodec, Stored
from mlx_loom.cache.turboquant import TurboQuantCodec
from mlx_loom.errors import CacheError

__all__ = ["CODECS", "CodecLayout", "common_codec", "split_meta"]

#: Codec name -> the codec class that recreates it from its ``meta`` strings.
CODECS: Mapping[str, Any] = MappingProxyType(
    {"affine": AffineCodec, "turboquant": TurboQuantCodec}
)

#: What every layout stores in when no codec is given.
PLAIN = PlainCodec()


def split_meta(meta_state: Any, fields: int, *, owner: str) -> tuple[tuple[str, ...], Any]:
    """``meta_state`` as ``(the layout's own fields, the codec or None for plain)``."""
    if not isinstance(meta_state, (list, tuple)) or len(meta_state) < fields:
        raise CacheError(
            f"{owner}.from_state: meta_state must hold at least {fields} strings; "
            f"found {meta_state!r}",
            fix="recreate the cache state with this version of mlx-loom",
        )
    own, rest = tuple(meta_state[:fields]), tuple(meta_state[fields:])
    if not rest:
        return own, None
    name = rest[0]
    cls = CODECS.get(name) if isinstance(name, str) else None
    if cls is None:
        shown = name if not isinstance(name, str) or len(name) <= 40 else name[:37] + "..."
        raise CacheError(
            f"{owner}.from_state: meta_state names KV codec {shown!r}, which this "
            f"installation cannot recreate ({', '.join(CODECS)})",
            fix="recreate the cache state with this version of mlx-loom",
        )
    return own, cls.from_meta(rest[1:], owner=owner)


class CodecLayout:
    """What every KV layout shares about its codec: its name, widths and joining equals."""

    kind: ClassVar[str]
    #: The storage codec (class default: plain; a layout instance may take another).
    _codec: Any = PLAIN
    keys: Stored | None
    values: Stored | None

    def _stored(self) -> tuple[Stored, Stored]:
        """The stored keys and values (refused while the cache holds none)."""
        keys, values = self.keys, self.values
        if keys is None or values is None:
            raise CacheError(f"{self.kind}: no keys/values yet", fix="call update_and_fetch first")
        return keys, values

    def _take_codec(self, codec: Any) -> None:
        if codec is not None:
            self._codec = codec

    @property
    def codec(self) -> str | None:
        """The codec's name (``kv_codec=``), or ``None`` for plain storage."""
        name: str | None = self._codec.codec
        return name

    @property
    def plain(self) -> bool:
        """True when keys and values are stored as computed (no codec, not a plugin's)."""
        return type(self._codec) is PlainCodec

    @property
    def storage(self) -> Any:
        """The storage codec object (what ``codec=`` took)."""
        return self._codec

    @property
    def bits(self) -> int | None:
        bits: int | None = self._codec.bits
        return bits

    @property
    def group_size(self) -> int | None:
        group_size: int | None = self._codec.group_size
        return group_size

    @property
    def codec_key(self) -> Hashable:
        """Equal for two caches whose slots may be rows of one buffer."""
        key: Hashable = self._codec.key
        return key

    def _codec_meta(self) -> tuple[str, ...]:
        """The codec's part of ``meta_state`` (empty for the layout's own codec, if unnamed)."""
        name = self._codec.codec
        if name is None:
            if type(self._codec) is not type(type(self)._codec):
                raise CacheError(
                    f"{self.kind}: its storage codec {type(self._codec).__name__} has no name, "
                    "so its state cannot be saved or copied",
                    fix="give the codec a 'codec' name the core recreates, or register a cache "
                    "kind for it (loom_cache_kinds)",
                )
            return ()
        return (name, *self._codec.meta())

    def convert_like(self, plain: Any) -> Any:
        """``plain`` stored in this cache's codec (``None``: this cache is plain, or it is not).

        The prompt-cache geometry check converts a model's plain probes with it.
        """
        to_codec = getattr(plain, "to_codec", None)
        if self.codec is None or getattr(plain, "codec", 0) is not None or not callable(to_codec):
            return None
        return to_codec(self._codec)

    def _check_codec(self, other: Any, what: str) -> None:
        if getattr(other, "codec_key", None) != self.codec_key:
            theirs = getattr(getattr(other, "storage", None), "describe", lambda: "?")()
            raise CacheError(
                f"{self.kind}.{what}: rows stored {theirs} cannot join rows stored "
                f"{self._codec.describe()}",
                fix="batch only rows stored in the same codec (same bits and group size)",
            )


def common_codec(caches: Sequence[Any], *, owner: str) -> Any:
    """The one codec every cache of ``caches`` stores in (refused when they differ)."""
    keys = {c.codec_key for c in caches}
    if len(keys) > 1:
        kinds = sorted({c.storage.describe() for c in caches})
        raise CacheError(
            f"{owner}: the caches are quantized differently ({', '.join(kinds)}): their "
            "widths or codecs differ",
            fix="stack only caches stored in the same codec with the same bits and group size",
        )
    return caches[0].storage

