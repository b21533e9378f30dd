"""Rotary position embeddings: every kind the families here read from a config.

``rope_scaling`` (Llama, Qwen) or ``rope_parameters`` (Gemma, Qwen3.5) picks
a kind; :func:`parse_rope_scaling` validates it into one of the schemas below
(for a family's config validator), and :func:`make_rope` builds the module.

* default / ``mrope`` (text-only input: the three position streams are equal,
  which makes multimodal RoPE the plain one) — ``nn.RoPE``;
* ``linear`` — positions divided by ``factor`` (``nn.RoPE`` with ``scale``);
* ``dynamic`` — NTK: the base grows once the sequence passes
  ``max_position_embeddings``;
* ``llama3`` — Llama 3.1's frequency bands; ``yarn``; ``longrope`` (Phi-3);
* ``proportional`` — Gemma's: a leading part of the head rotates with
  frequencies whose exponent divides by the *whole* head width; the rest pass
  unrotated (infinite wavelength).

Partial rotary (Qwen's ``partial_rotary_factor``) is ``dims`` smaller than
the head: ``mx.fast.rope`` rotates the first ``dims`` and leaves the rest.

The frequency computations use mlx-lm's float32 op order (``rope_utils``):
a different order rounds differently, and the parity tests compare rotated
logits bit for bit.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import mlx.core as mx
import mlx.nn as nn
from pydantic import BaseModel, ConfigDict

from mlx_loom.artifacts.fields import FiniteFloat, PositiveFloat, Size, UnitFloat
from mlx_loom.errors import CapabilityRefused

__all__ = [
    "ROPE_KINDS",
    "DynamicNTKRoPE",
    "DynamicScaling",
    "FreqsRoPE",
    "LinearScaling",
    "Llama3Scaling",
    "LongRopeScaling",
    "ProportionalScaling",
    "RopeScaling",
    "YarnScaling",
    "make_rope",
    "parse_rope_scaling",
]


class _Scaling(BaseModel):
    # Checkpoints carry both "type" and "rope_type" plus fields other runtimes
    # read (attention_factor, mrope_section ...); what we do not use is ignored.
    model_config = ConfigDict(extra="ignore", frozen=True)


class LinearScaling(_Scaling):
    """Positions divided by ``factor`` (position interpolation)."""

    kind: Literal["linear"] = "linear"
    factor: PositiveFloat


class DynamicScaling(_Scaling):
    """Dynamic NTK: the base grows once the sequence passes ``max_position_embeddings``."""

    kind: Literal["dynamic"] = "dynamic"
    factor: PositiveFloat


class Llama3Scaling(_Scaling):
    """Llama 3.1's frequency-band scaling."""

    kind: Literal["llama3"] = "llama3"
    factor: PositiveFloat
    low_freq_factor: PositiveFloat = 1.0
    high_freq_factor: PositiveFloat = 4.0
    original_max_position_embeddings: Size = 8192


class YarnScaling(_Scaling):
    """YaRN: ramped interpolation between extrapolated and interpolated frequencies."""

    kind: Literal["yarn"] = "yarn"
    factor: PositiveFloat
    original_max_position_embeddings: Size = 4096
    beta_fast: PositiveFloat = 32.0
    beta_slow: PositiveFloat = 1.0
    mscale: FiniteFloat = 1.0
    mscale_all_dim: FiniteFloat = 0.0


class LongRopeScaling(_Scaling):
    """LongRoPE (Phi-3 style): per-frequency long factors and an input scale."""

    kind: Literal["longrope"] = "longrope"
    original_max_position_embeddings: Size
    short_factor: list[PositiveFloat] | PositiveFloat = 1.0
    long_factor: list[PositiveFloat] | PositiveFloat = 1.0


class ProportionalScaling(_Scaling):
    """Gemma's proportional RoPE: ``partial_rotary_factor`` of the head rotates."""

    kind: Literal["proportional"] = "proportional"
    partial_rotary_factor: UnitFloat = 1.0
    factor: PositiveFloat = 1.0


RopeScaling = (
    LinearScaling
    | DynamicScaling
    | Llama3Scaling
    | YarnScaling
    | LongRopeScaling
    | ProportionalScaling
)
_SCHEMAS: dict[str, type[_Scaling]] = {
    "linear": LinearScaling,
    "dynamic": DynamicScaling,
    "llama3": Llama3Scaling,
    "yarn": YarnScaling,
    "longrope": LongRopeScaling,
    "proportional": ProportionalScaling,
}
#: Every kind :func:`parse_rope_scaling` knows; ``default`` and ``mrope`` mean plain RoPE.
ROPE_KINDS: tuple[str, ...] = ("default", "mrope", *_SCHEMAS)


def parse_rope_scaling(
    value: Any,
    *,
    dims: int | None,
    max_position_embeddings: int | None,
    kinds: tuple[str, ...] = ROPE_KINDS,
) -> RopeScaling | None:
    """Validate a config's ``rope_scaling`` / ``rope_parameters`` object; ``None`` is plain RoPE.

    Meant for a family schema's ``mode="before"`` field validator: every
    problem is a ``ValueError`` (reported against that field). ``dims`` is
    the rotated width (LongRoPE's factor lists must cover ``dims / 2``);
    ``kinds`` narrows what the family implements. mlx-lm's lookup order
    picks the kind: ``type`` first, then ``rope_type``.
    """
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("must be an object with a 'rope_type' (or 'type') key")
    kind = value.get("type") or value.get("rope_type") or "default"
    if kind not in kinds:
        raise ValueError(f"rope type {kind!r} is not supported (supported: {', '.join(kinds)})")
    if kind in ("default", "mrope"):
        return None
    if kind in ("dynamic", "longrope") and max_position_embeddings is None:
        raise ValueError(f"rope type {kind!r} needs max_position_embeddings, which is absent")
    fields = {k: v for k, v in value.items() if k not in ("type", "rope_type", "kind")}
    scaling = _SCHEMAS[kind].model_validate(fields)
    if isinstance(scaling, Llama3Scaling) and scaling.low_freq_factor == scaling.high_freq_factor:
        raise ValueError("llama3 low_freq_factor must differ from high_freq_factor")
    if isinstance(scaling, LongRopeScaling) and dims is not None:
        for name in ("short_factor", "long_factor"):
            factors = getattr(scaling, name)
            if isinstance(factors, list) and len(factors) != dims // 2:
                raise ValueError(
                    f"{name} has {len(factors)} entries; the rotated dims / 2 = {dims // 2}"
                )
    return scaling  # type: ignore[return-value]


# --- modules --------------------------------------------------------------------


class DynamicNTKRoPE(nn.Module):
    """Dynamic NTK: past ``max_positions`` the base grows with the sequence length.

    The base depends on the total length, which differs per row in a batch;
    ``mx.fast.rope`` takes one base, so batched (array) offsets are refused.
    """

    def __init__(
        self, dims: int, *, base: float, traditional: bool, factor: float, max_positions: int
    ) -> None:
        super().__init__()
        self.dims, self.base, self.traditional = dims, base, traditional
        self.factor, self.max_positions = factor, max_positions

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        if not isinstance(offset, int):
            raise CapabilityRefused(
                "rope_scaling type 'dynamic' cannot rotate a batch whose rows sit at different "
                "positions (one RoPE base per forward)",
                fix="generate one sequence at a time with this checkpoint",
            )
        seq_len = max(x.shape[-2] + offset, self.max_positions)
        growth = (self.factor * seq_len / self.max_positions) - (self.factor - 1)
        base = self.base * growth ** (self.dims / (self.dims - 2))
        return mx.fast.rope(
            x, self.dims, traditional=self.traditional, base=base, scale=1.0, offset=offset
        )


class FreqsRoPE(nn.Module):
    """RoPE with precomputed per-pair frequencies and an optional scale on the rotated part.

    ``freqs`` are what ``mx.fast.rope`` divides positions by (periods, not
    inverse frequencies). The input scale (YaRN's mscale, LongRoPE's) applies
    to the first ``dims`` features only, as mlx-lm applies it.
    """

    def __init__(
        self, dims: int, freqs: mx.array, *, traditional: bool, input_scale: float = 1.0
    ) -> None:
        super().__init__()
        self.dims, self.traditional, self.input_scale = dims, traditional, input_scale
        self._freqs = freqs  # underscore: a buffer, not a parameter to load

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        if self.input_scale != 1.0:
            x = x.at[..., : self.dims].multiply(self.input_scale)
        return mx.fast.rope(
            x,
            self.dims,
            traditional=self.traditional,
            base=None,
            scale=1.0,
            offset=offset,
            freqs=self._freqs,
        )


# --- frequencies (mlx-lm's float32 op order) --------------------------------------


def _periods(dims: int, base: float) -> mx.array:
    """``base ** (2i / dims)``: what ``mx.fast.rope`` calls ``freqs`` (it divides by them)."""
    return base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)


def _llama3(dims: int, base: float, s: Llama3Scaling) -> mx.array:
    freqs = _periods(dims, base)
    wavelens = 2 * mx.pi * freqs
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    # Long wavelengths are interpolated by `factor`, short ones kept, the band
    # between them blended smoothly.
    freqs = mx.where(wavelens > low_wavelen, freqs * s.factor, freqs)
    medium = (wavelens > high_wavelen) & (wavelens < low_wavelen)
    smooth = (s.original_max_position_embeddings / wavelens - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    return mx.where(medium, freqs / ((1 - smooth) / s.factor + smooth), freqs)


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(dims: int, base: float, s: YarnScaling) -> tuple[mx.array, float]:
    def correction_dim(rotations: float) -> float:
        return (dims * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low: float = max(math.floor(correction_dim(s.beta_fast)), 0)
    high: float = min(math.ceil(correction_dim(s.beta_slow)), dims - 1)
    if low == high:
        high += 0.001  # the ramp below would divide by zero
    ramp = mx.clip((mx.arange(dims // 2, dtype=mx.float32) - low) / (high - low), 0, 1)
    extrapolate = 1.0 - ramp
    freq_extra = _periods(dims, base)
    freq_inter = s.factor * freq_extra
    freqs = (freq_inter * freq_extra) / (freq_inter * extrapolate + freq_extra * (1 - extrapolate))
    mscale = _yarn_mscale(s.factor, s.mscale) / _yarn_mscale(s.factor, s.mscale_all_dim)
    return freqs, mscale


def _longrope(
    dims: int, base: float, s: LongRopeScaling, max_positions: int
) -> tuple[mx.array, float]:
    # As mlx-lm: only the long factors are used (at every length), and the
    # input scale follows from the context extension ratio.
    freqs = mx.array(s.long_factor, dtype=mx.float32) * _periods(dims, base)
    ratio = max_positions / s.original_max_position_embeddings
    scale = (
        1.0
        if ratio <= 1.0
        else math.sqrt(1 + math.log(ratio) / math.log(s.original_max_position_embeddings))
    )
    return freqs, scale


def _proportional(dims: int, base: float, s: ProportionalScaling) -> mx.array:
    rotated = int(dims * s.partial_rotary_factor)
    exponents = mx.arange(0, rotated, 2, dtype=mx.float32) / dims
    return mx.concatenate([s.factor * (base**exponents), mx.full(((dims - rotated) // 2,), mx.inf)])


def make_rope(
    dims: int,
    *,
    base: float,
    traditional: bool = False,
    scaling: RopeScaling | None = None,
    max_position_embeddings: int | None = None,
) -> nn.Module:
    """The RoPE module for ``dims`` rotated features (validated ``scaling``, or plain).

    Called as ``rope(x, offset=offset)`` with ``x [B, heads, L, head_dim]``;
    ``offset`` is an int or, for batch caches, one position per row.
    """
    s = scaling
    if s is None:
        return nn.RoPE(dims, traditional=traditional, base=base, scale=1.0)
    if isinstance(s, LinearScaling):
        return nn.RoPE(dims, traditional=traditional, base=base, scale=1 / s.factor)
    if isinstance(s, DynamicScaling):
        assert max_position_embeddings is not None  # parse_rope_scaling requires it
        return DynamicNTKRoPE(
            dims,
            base=base,
            traditional=traditional,
            factor=s.factor,
            max_positions=max_position_embeddings,
        )
    if isinstance(s, Llama3Scaling):
        return FreqsRoPE(dims, _llama3(dims, base, s), traditional=traditional)
    if isinstance(s, YarnScaling):
        freqs, mscale = _yarn(dims, base, s)
        return FreqsRoPE(dims, freqs, traditional=traditional, input_scale=mscale)
    if isinstance(s, LongRopeScaling):
        assert max_position_embeddings is not None  # parse_rope_scaling requires it
        freqs, scale = _longrope(dims, base, s, max_position_embeddings)
        return FreqsRoPE(dims, freqs, traditional=False, input_scale=scale)
    if isinstance(s, ProportionalScaling):
        return FreqsRoPE(dims, _proportional(dims, base, s), traditional=traditional)
    raise TypeError(f"unknown rope scaling {s!r}")
