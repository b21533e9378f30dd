"""TurboQuant KV storage: int8 keys, rotated Lloyd–Max values, deferred-V attention.

Keys are stored as int8 with one float32 scale per token and head
(``max|k| / 127``): attention scores are sensitive to key error in every
direction, and 8 bits keep the score error far below the softmax's own
resolution. Values take the heavy compression:

1. each value vector is rotated by a normalised Walsh–Hadamard transform
   after a fixed random sign flip (``R v = H (s ⊙ v) / sqrt(D)``), which
   spreads its energy evenly over the coordinates, so each coordinate of a
   rotated vector is close to a Gaussian with variance ``|v|^2 / D``;
2. the rotated vector is divided by its RMS (stored, float32) and every
   coordinate is replaced by the index of the nearest level of the
   Lloyd–Max quantizer of the standard normal (8 levels at 3 bits, 16 at 4),
   the minimum-mean-square-error scalar quantizer for that distribution;
3. indices are stored as ``bits`` bit planes of ``ceil(D / 32)`` words each,
   so a value costs exactly ``bits`` bits (plus the RMS per vector).

Attention never un-rotates the stored values. The output is a weighted sum
of value vectors, and the rotation is linear, so
``sum_j p_j v_j = R^T sum_j p_j (R v_j)``: the view attends over the rotated
values and applies one inverse transform to the ``[B, H, L, D]`` output —
``L`` vectors per step instead of every cached token (deferred-V).

The rotation signs come from a fixed integer sequence (not a random-number
generator), so a saved cache decodes identically in any later process.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import mlx.core as mx

from mlx_loom.cache import _buffers as buf
from mlx_loom.cache.views import single_mask
from mlx_loom.errors import CacheError, CapabilityRefused

if TYPE_CHECKING:
    from mlx_loom.cache._buffers import Stored

__all__ = [
    "LLOYD_MAX_LEVELS",
    "TURBOQUANT_BITS",
    "TurboQuantCodec",
    "TurboQuantView",
    "lloyd_max_gaussian",
]

#: Value widths TurboQuant supports (bits per value coordinate).
TURBOQUANT_BITS = (3, 4)

#: Head sizes ``mx.hadamard_transform`` handles: ``m * 2**k`` for these ``m``.
_HADAMARD_FACTORS = (1, 12, 20, 28)
#: The ``m`` whose transform matrix is symmetric, hence its own inverse once
#: normalised (Sylvester's for 1, MLX's 12 as well); MLX's 20 and 28 are
#: orthogonal but not symmetric (checked on MLX 0.32.4 against the matrix the
#: transform applies to the identity), so their inverse is the transpose.
_SYMMETRIC_FACTORS = (1, 12)


def _phi(x: float) -> float:
    return math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _cdf(x: float) -> float:
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


def lloyd_max_gaussian(levels: int, iterations: int = 2000) -> tuple[float, ...]:
    """The Lloyd–Max reconstruction levels of N(0, 1) for ``levels`` levels, ascending.

    Lloyd's iteration: boundaries are midpoints of neighbouring levels, each
    level is the conditional mean of its cell
    (``(phi(a) - phi(b)) / (Phi(b) - Phi(a))``). The iteration converges
    slowly (linearly); 2000 steps settle the 8- and 16-level tables to
    ~1e-6, within 1e-4 of Max's published tables (1960; 4 bits ±0.1284 …
    ±2.7326), which the tests check. The codec uses :data:`LLOYD_MAX_LEVELS`,
    its output written out.
    """
    # Start from the cell midpoints of equal-probability cells.
    c = [_inv_cdf((i + 0.5) / levels) for i in range(levels)]
    for _ in range(iterations):
        b = [-math.inf, *((c[i] + c[i + 1]) / 2 for i in range(levels - 1)), math.inf]
        c = [
            (_phi(b[i]) - _phi(b[i + 1])) / max(_cdf(b[i + 1]) - _cdf(b[i]), 1e-300)
            for i in range(levels)
        ]
    return tuple(c)


def _inv_cdf(p: float) -> float:
    lo, hi = -10.0, 10.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if _cdf(mid) < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _symmetric(positive: tuple[float, ...]) -> tuple[float, ...]:
    return (*(-x for x in reversed(positive)), *positive)


#: The Lloyd–Max levels of N(0, 1), as :func:`lloyd_max_gaussian` computes them
#: (to 6 decimals; a test recomputes them). Written out so importing costs nothing.
LLOYD_MAX_LEVELS: dict[int, tuple[float, ...]] = {
    3: _symmetric((0.245094, 0.756005, 1.343909, 2.151946)),
    4: _symmetric((0.128395, 0.388048, 0.656759, 0.94234, 1.256231, 1.618046, 2.069017, 2.73259)),
}


def _signs(D: int) -> mx.array:
    """A fixed ±1 sequence of length ``D`` (bit 16 of a 31-bit LCG seeded with ``D``)."""
    x, out = D, []
    for _ in range(D):
        x = (1103515245 * x + 12345) % 2**31
        out.append(1.0 if (x >> 16) & 1 else -1.0)
    return mx.array(out, dtype=mx.float32)


def check_bits(bits: Any, *, owner: str) -> int:
    if isinstance(bits, bool) or bits not in TURBOQUANT_BITS:
        raise CacheError(
            f"{owner}: bits={bits!r} is not a TurboQuant value width",
            fix=f"use one of {list(TURBOQUANT_BITS)} (4 keeps more precision, 3 saves memory)",
        )
    return int(bits)


def hadamard_factor(D: int) -> int | None:
    """The ``m`` with ``D = m * 2**k`` that ``mx.hadamard_transform`` needs, or ``None``.

    Each candidate ``m`` is tried whole: dividing out every factor 2 first
    would take 24 = 12 * 2 down to 3 and refuse it.
    """
    for m in _HADAMARD_FACTORS:
        rest, remainder = divmod(D, m)
        if D >= 2 and remainder == 0 and rest & (rest - 1) == 0:
            return m
    return None


def check_head_dim(D: int, *, owner: str) -> None:
    if hadamard_factor(D) is None:
        raise CapabilityRefused(
            f"{owner}: head dimension {D} has no fast Walsh–Hadamard transform "
            "(TurboQuant needs m * 2^k with m in 1, 12, 20, 28)",
            fix="use affine KV quantization (kv_codec='affine') for this model",
        )


class TurboQuantCodec:
    """Encodes keys (int8 + scale) and values (rotated, Lloyd–Max ``bits`` wide)."""

    codec: ClassVar[str | None] = "turboquant"
    leaves: ClassVar[int] = 2
    group_size: ClassVar[None] = None
    #: The widths a request may ask for, and the one ``kv_codec="turboquant"`` alone gets.
    widths: ClassVar[tuple[int, ...]] = TURBOQUANT_BITS
    default_bits: ClassVar[int] = 4

    def __init__(self, bits: int, *, owner: str = "TurboQuant KV codec") -> None:
        self.bits = check_bits(bits, owner=owner)
        self.owner = owner
        # Arrays are made on first use, on the thread that encodes (a request
        # checked on a caller's thread builds caches but never encodes).
        self._tables: tuple[mx.array, mx.array] | None = None
        self._sign_cache: dict[int, mx.array] = {}
        self._inverse_cache: dict[int, mx.array] = {}

    @classmethod
    def for_request(cls, *, bits: int, group_size: int) -> TurboQuantCodec:
        return cls(bits)

    def meta(self) -> tuple[str, ...]:
        """``(bits,)`` as a decimal string."""
        return (str(self.bits),)

    @classmethod
    def from_meta(cls, meta: Sequence[str], *, owner: str) -> TurboQuantCodec:
        (bits,) = state_bits(meta, ("bits",), owner=owner)
        return cls(bits, owner=owner)

    @property
    def key(self) -> Hashable:
        """Equal for two codecs whose stored slots may share one buffer (rows of a batch)."""
        return (type(self), self.meta())

    def describe(self) -> str:
        return f"turboquant {self.bits}"

    @property
    def _levels(self) -> mx.array:
        return self._level_tables()[0]

    @property
    def _bounds(self) -> mx.array:
        return self._level_tables()[1]

    def _level_tables(self) -> tuple[mx.array, mx.array]:
        """The Lloyd–Max levels and the decision boundaries between them (midpoints)."""
        if self._tables is None:
            levels = LLOYD_MAX_LEVELS[self.bits]
            bounds = [(levels[i] + levels[i + 1]) / 2 for i in range(len(levels) - 1)]
            self._tables = (mx.array(levels, mx.float32), mx.array(bounds, mx.float32))
        return self._tables

    # --- the rotation -----------------------------------------------------------

    def _sign(self, D: int) -> mx.array:
        if D not in self._sign_cache:
            check_head_dim(D, owner=self.owner)
            self._sign_cache[D] = _signs(D)
        return self._sign_cache[D]

    def rotate(self, x: mx.array) -> mx.array:
        """``R x = H (s ⊙ x) / sqrt(D)`` over the last axis, in float32."""
        D = x.shape[-1]
        return mx.hadamard_transform(x.astype(mx.float32) * self._sign(D), scale=D**-0.5)

    def unrotate(self, y: mx.array) -> mx.array:
        """``R^T y = s ⊙ (H^T y / sqrt(D))``.

        Where H is symmetric (``D = 2^k`` or ``12 * 2^k``) the transform is its
        own inverse; otherwise ``H^T`` is applied as a ``D x D`` product, on
        the ``L`` output vectors of a step only (deferred-V).
        """
        D = y.shape[-1]
        sign = self._sign(D)
        if hadamard_factor(D) in _SYMMETRIC_FACTORS:
            return mx.hadamard_transform(y.astype(mx.float32), scale=D**-0.5) * sign
        if D not in self._inverse_cache:
            # Row i of ``forward`` is the transform of e_i, so T(x) = x @ forward
            # and its inverse is ``@ forward.T / D``.
            forward = mx.hadamard_transform(mx.eye(D, dtype=mx.float32), scale=1.0)
            self._inverse_cache[D] = forward.T * D**-0.5
        return (y.astype(mx.float32) @ self._inverse_cache[D]) * sign

    # --- keys -----------------------------------------------------------------------

    def encode_keys(self, x: mx.array) -> Stored:
        self._sign(x.shape[-1])  # refuse an unsupported head size on first use
        x = x.astype(mx.float32)
        scale = mx.max(mx.abs(x), axis=-1, keepdims=True) / 127.0
        scale = mx.where(scale > 0, scale, 1.0)
        q = mx.clip(mx.round(x / scale), -127, 127).astype(mx.int8)
        return (q, scale)

    def decode_keys(self, stored: Stored) -> mx.array:
        q, scale = stored
        return q.astype(mx.float32) * scale

    def zeros_keys(self, like: mx.array, n: int) -> Stored:
        B, H, _, D = like.shape
        return (mx.zeros((B, H, n, D), mx.int8), mx.zeros((B, H, n, 1), mx.float32))

    # --- values ---------------------------------------------------------------------

    def _words(self, D: int) -> int:
        return -(-D // 32)

    def encode_values(self, x: mx.array) -> Stored:
        D = x.shape[-1]
        y = self.rotate(x)
        rms = mx.sqrt(mx.mean(y * y, axis=-1, keepdims=True))
        z = y / mx.where(rms > 0, rms, 1.0)
        idx = mx.sum(z[..., None] > self._bounds, axis=-1).astype(mx.uint32)
        W = self._words(D)
        if W * 32 != D:
            idx = mx.pad(idx, [(0, 0)] * (idx.ndim - 1) + [(0, W * 32 - D)])
        idx = idx.reshape(*idx.shape[:-1], W, 32)
        weights = mx.left_shift(mx.array(1, mx.uint32), mx.arange(32, dtype=mx.uint32))
        planes = [
            mx.sum(mx.bitwise_and(mx.right_shift(idx, p), 1) * weights, axis=-1)
            for p in range(self.bits)
        ]
        return (mx.concatenate(planes, axis=-1).astype(mx.uint32), rms)

    def decode_values_rotated(self, stored: Stored, D: int) -> mx.array:
        """The rotated values ``R v`` (float32), as attention uses them."""
        packed, rms = stored
        W = self._words(D)
        words = packed.reshape(*packed.shape[:-1], self.bits, W, 1)
        bits = mx.bitwise_and(mx.right_shift(words, mx.arange(32, dtype=mx.uint32)), 1)
        shifts = mx.arange(self.bits, dtype=mx.uint32).reshape(self.bits, 1, 1)
        idx = mx.sum(mx.left_shift(bits, shifts), axis=-3).reshape(*packed.shape[:-1], W * 32)
        if W * 32 != D:
            idx = idx[..., :D]
        return mx.take(self._levels, idx) * rms

    def zeros_values(self, like: mx.array, n: int) -> Stored:
        B, H, _, D = like.shape
        W = self._words(D)
        return (mx.zeros((B, H, n, self.bits * W), mx.uint32), mx.zeros((B, H, n, 1), mx.float32))

    # --- both ----------------------------------------------------------------------

    def quantize_stored_keys(self, x: Stored) -> Stored:
        return self.encode_keys(_plain(x, self.owner))

    def quantize_stored_values(self, x: Stored) -> Stored:
        return self.encode_values(_plain(x, self.owner))

    def view(self, keys: Any, values: Any, *, head_dim: int | None = None) -> TurboQuantView:
        D = keys[0].shape[-1] if head_dim is None else head_dim
        return TurboQuantView(keys, values, self, D)


def _plain(x: Stored, owner: str) -> mx.array:
    if isinstance(x, tuple):
        raise CacheError(f"{owner}: the keys/values are already quantized")
    return x


@dataclass(frozen=True)
class TurboQuantView:
    """Attention over int8 keys and rotated Lloyd–Max values (deferred-V).

    Keys and rotated values are decoded to the queries' dtype for the fused
    kernel (masks, sinks and grouped heads work as for plain keys), and the
    output is un-rotated once.
    """

    keys: tuple[mx.array, mx.array]
    values: tuple[mx.array, mx.array]
    codec: TurboQuantCodec
    head_dim: int

    def attend(
        self, queries: mx.array, *, scale: float, mask: Any, sinks: mx.array | None = None
    ) -> mx.array:
        dtype = queries.dtype
        k = self.codec.decode_keys(self.keys).astype(dtype)
        v = self.codec.decode_values_rotated(self.values, self.head_dim).astype(dtype)
        out = mx.fast.scaled_dot_product_attention(
            queries, k, v, scale=scale, mask=single_mask(mask), sinks=sinks
        )
        return self.codec.unrotate(out).astype(dtype)


def state_bits(meta_state: Sequence[str], names: Sequence[str], *, owner: str) -> list[int]:
    values = buf.parse_meta(meta_state, names, owner=owner)
    check_bits(values[-1], owner=owner)
    return values
