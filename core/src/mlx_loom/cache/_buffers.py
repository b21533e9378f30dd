"""Sequence buffers shared by the full, rotating and quantized KV caches.

A stored key (or value) tensor is either one array ``[B, H, S, D]`` or, when
affine-quantized, the triple ``(packed, scales, biases)`` whose members all
share the sequence axis 2. Every cache algorithm here only moves whole token
slots along axis 2 (slice, concatenate, roll, assign), so writing it once over
"an array or a tuple of arrays" lets the quantized kinds reuse the exact slot
bookkeeping of the plain kinds. Moving data never changes a value, which is why
a quantized cache's output equals the plain cache's output quantized.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable, Sequence
from typing import Any, ClassVar, NoReturn, cast

import mlx.core as mx

from mlx_loom.cache.views import AffineView, PlainView
from mlx_loom.errors import CacheError, CapabilityRefused

Stored = mx.array | tuple[mx.array, ...]

#: Affine quantization widths ``mx.quantize`` supports that we allow for KV.
#: (1 bit is supported by MLX but useless for keys/values; 7 is not supported.)
KV_BITS = (2, 3, 4, 5, 6, 8)
KV_GROUP_SIZES = (32, 64, 128)


def leaves(x: Stored | None) -> list[mx.array]:
    if x is None:
        return []
    return list(x) if isinstance(x, tuple) else [x]


def seq_len(x: Stored) -> int:
    return leaves(x)[0].shape[2]


def apply(fn: Callable[[mx.array], mx.array], x: Stored) -> Stored:
    if isinstance(x, tuple):
        return tuple(fn(a) for a in x)
    return fn(x)


def rebuild(like: Stored, parts: Sequence[mx.array]) -> Stored:
    """``parts`` in the structure of ``like``: one array, or a tuple of them."""
    return tuple(parts) if isinstance(like, tuple) else parts[0]


def take(x: Stored, start: int | None, stop: int | None) -> Stored:
    """Slots ``start:stop`` of the sequence axis."""
    return apply(lambda a: a[..., start:stop, :], x)


def cat(parts: Sequence[Stored]) -> Stored:
    """Concatenate along the sequence axis."""
    if isinstance(parts[0], tuple):
        return tuple(mx.concatenate(list(group), axis=2) for group in zip(*parts, strict=True))
    return mx.concatenate(list(cast(Sequence[mx.array], parts)), axis=2)


def write(buf: Stored, start: int, new: Stored) -> None:
    """Assign ``new`` into slots ``start:start+len`` of ``buf`` in place."""
    stop = start + seq_len(new)
    for b, n in zip(leaves(buf), leaves(new), strict=True):
        b[..., start:stop, :] = n


def nbytes(*xs: Stored | None) -> int:
    return sum(a.nbytes for x in xs for a in leaves(x))


class PlainCodec:
    """Stores keys/values as they come.

    The storage codecs (this one, :class:`AffineCodec`,
    :class:`~mlx_loom.cache.turboquant.TurboQuantCodec`, or a plugin's) are
    what a cache layout takes as ``codec=``: the layout moves whole token
    slots, the codec says what a slot holds and how attention reads it.
    Every codec offers the methods below; ``codec`` names it (``None``:
    plain, or a plugin codec known only to its own cache kind), ``leaves``
    counts the arrays one stored tensor is made of, and :meth:`meta` is the
    strings that recreate it (see :mod:`mlx_loom.cache.storage`).
    """

    codec: ClassVar[str | None] = None
    leaves: ClassVar[int] = 1
    bits: int | None = None
    group_size: int | None = None

    def meta(self) -> tuple[str, ...]:
        """The strings that, with :attr:`codec`, recreate this codec."""
        return ()

    @property
    def key(self) -> Hashable:
        """Equal for two codecs whose stored slots may share one buffer (rows of a batch)."""
        return (type(self), self.meta())

    def describe(self) -> str:
        return "plain" if self.codec is None else " ".join((self.codec, *self.meta()))

    def encode(self, x: mx.array) -> Stored:
        return x

    def zeros(self, like: mx.array, n: int) -> Stored:
        B, H, _, D = like.shape
        return mx.zeros((B, H, n, D), like.dtype)

    # Keys and values are stored alike (TurboQuant's codec stores them differently).
    def encode_keys(self, x: mx.array) -> Stored:
        return self.encode(x)

    def encode_values(self, x: mx.array) -> Stored:
        return self.encode(x)

    def zeros_keys(self, like: mx.array, n: int) -> Stored:
        return self.zeros(like, n)

    def zeros_values(self, like: mx.array, n: int) -> Stored:
        return self.zeros(like, n)

    def quantize_stored_keys(self, x: Stored) -> Stored:
        """Plain stored keys (any number of slots) in this codec's storage."""
        return self.encode_keys(plain_array(x, self.describe()))

    def quantize_stored_values(self, x: Stored) -> Stored:
        return self.encode_values(plain_array(x, self.describe()))

    def view(self, keys: Any, values: Any) -> Any:
        return PlainView(keys, values)


def plain_array(x: Stored, owner: str) -> mx.array:
    """``x`` if it is one plain array; stored keys of a codec cannot be converted again."""
    if isinstance(x, tuple):
        raise CacheError(f"{owner}: the keys/values are already quantized")
    return x


class AffineCodec(PlainCodec):
    """Stores keys/values affine-quantized per ``group_size`` along head_dim.

    Scales and biases keep the activation dtype, exactly as ``mx.quantize``
    returns them (and as mlx-lm's quantized cache stores them).
    """

    codec: ClassVar[str | None] = "affine"
    leaves: ClassVar[int] = 3
    bits: int
    group_size: int
    #: The widths a request may ask for, and the one ``kv_codec="affine"`` alone gets.
    widths: ClassVar[tuple[int, ...]] = KV_BITS
    default_bits: ClassVar[int] = 8

    def __init__(self, group_size: int, bits: int, *, owner: str = "affine KV codec") -> None:
        check_quantization(group_size, bits, owner=owner)
        self.group_size = group_size
        self.bits = bits
        self.owner = owner

    @classmethod
    def for_request(cls, *, bits: int, group_size: int) -> AffineCodec:
        return cls(group_size, bits)

    def meta(self) -> tuple[str, ...]:
        """``(group_size, bits)`` as decimal strings."""
        return (str(self.group_size), str(self.bits))

    @classmethod
    def from_meta(cls, meta: Sequence[str], *, owner: str) -> AffineCodec:
        group_size, bits = parse_meta(meta, ("group_size", "bits"), owner=owner)
        return cls(group_size, bits, owner=owner)

    def _check_dim(self, D: int) -> None:
        if D % self.group_size:
            raise CacheError(
                f"{self.owner}: head_dim {D} is not a multiple of group_size {self.group_size}",
                fix="choose a KV group size (32, 64 or 128) that divides the head dimension",
            )

    def encode(self, x: mx.array) -> Stored:
        self._check_dim(x.shape[-1])
        return tuple(mx.quantize(x, group_size=self.group_size, bits=self.bits))

    def zeros(self, like: mx.array, n: int) -> Stored:
        B, H, _, D = like.shape
        self._check_dim(D)
        return (
            mx.zeros((B, H, n, D * self.bits // 32), mx.uint32),
            mx.zeros((B, H, n, D // self.group_size), like.dtype),
            mx.zeros((B, H, n, D // self.group_size), like.dtype),
        )

    def view(self, keys: Any, values: Any) -> Any:
        return AffineView(keys, values, self.group_size, self.bits)


def check_quantization(group_size: Any, bits: Any, *, owner: str) -> None:
    """Refuse widths and group sizes the affine KV path does not support."""
    if isinstance(bits, bool) or bits not in KV_BITS:
        raise CacheError(
            f"{owner}: bits={bits!r} is not a supported KV quantization width",
            fix=f"use one of {list(KV_BITS)} (4 or 8 are the usual choices)",
        )
    if isinstance(group_size, bool) or group_size not in KV_GROUP_SIZES:
        raise CacheError(
            f"{owner}: group_size={group_size!r} is not a supported KV quantization group size",
            fix=f"use one of {list(KV_GROUP_SIZES)}",
        )


def trim_count(n: Any, *, owner: str) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise CacheError(
            f"{owner}.trim: n={n!r} is not a non-negative int",
            fix="pass the number of trailing tokens to drop",
        )
    return n


def refuse_padded_batch(kind: str, *, codec: str, option: str) -> NoReturn:
    """Refuse ``merge``/``empty_batch`` for a codec's cache: its rows batch by stacking.

    Quantized storage cannot be left-padded row by row; the engine batches
    such caches with ``stack()`` over rows prefilled alone instead.
    """
    raise CapabilityRefused(
        f"{kind}: padded batches (merge/empty_batch) are not supported for {codec} KV caches; "
        "batching them works by stacking rows that were prefilled alone",
        fix=f"use stack() (the engine does), or batch without {option}",
    )


def parse_meta(meta_state: Any, names: Sequence[str], *, owner: str) -> list[int]:
    """Parse a ``meta_state`` of decimal strings into ints, naming what is wrong."""
    if not isinstance(meta_state, (list, tuple)) or len(meta_state) != len(names):
        raise CacheError(
            f"{owner}.from_state: meta_state must hold {len(names)} strings "
            f"({', '.join(names)}); found {meta_state!r}",
            fix="recreate the cache state with this version of mlx-loom",
        )
    return [
        parse_count(raw, name=name, owner=owner)
        for name, raw in zip(names, meta_state, strict=True)
    ]


def parse_count(raw: Any, *, name: str, owner: str) -> int:
    """A ``meta_state`` count: 1-18 ASCII digits (so it fits int64; no sign, no spaces)."""
    if not isinstance(raw, str) or not re.fullmatch(r"[0-9]{1,18}", raw):
        shown = raw if not isinstance(raw, str) or len(raw) <= 40 else raw[:37] + "..."
        raise CacheError(
            f"{owner}.from_state: meta_state field {name!r} is {shown!r}, not a "
            "non-negative integer",
            fix="recreate the cache state with this version of mlx-loom",
        )
    return int(raw)


def check_state_len(state: Any, allowed: Sequence[int], *, owner: str) -> tuple[mx.array, ...]:
    if not isinstance(state, (list, tuple)) or len(state) not in allowed:
        n = len(state) if isinstance(state, (list, tuple)) else type(state).__name__
        raise CacheError(
            f"{owner}.from_state: state must hold {' or '.join(map(str, allowed))} arrays; "
            f"found {n}",
            fix="recreate the cache state with this version of mlx-loom",
        )
    for i, a in enumerate(state):
        if not isinstance(a, mx.array):
            raise CacheError(
                f"{owner}.from_state: state[{i}] is a {type(a).__name__}, not an mx.array",
                fix="recreate the cache state with this version of mlx-loom",
            )
    return tuple(state)
