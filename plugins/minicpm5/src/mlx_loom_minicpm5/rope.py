"""Rotary position embeddings: plain, and each scaled variant Llama configs use.

Scaled variants differ only in the per-pair frequencies (and, for YaRN and
LongRoPE, a scale on the input), so they share :class:`FreqsRoPE` and differ
in how the frequencies are computed once, at build time. Those computations
use the same float32 op order as mlx-lm's ``rope_utils``: a different order
rounds differently, and the parity tests compare rotated logits bit for bit.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from mlx_loom.errors import CapabilityRefused

from .config import (
    DynamicScaling,
    LinearScaling,
    Llama3Scaling,
    LongRopeScaling,
    MiniCPM5Config,
    YarnScaling,
)


class RoPE(nn.Module):
    """Plain RoPE; ``scale`` < 1 is linear scaling (position interpolation)."""

    def __init__(self, dims: int, base: float, traditional: bool, scale: float = 1.0) -> None:
        super().__init__()
        self.dims, self.base, self.traditional, self.scale = dims, base, traditional, scale

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        return mx.fast.rope(
            x,
            self.dims,
            traditional=self.traditional,
            base=self.base,
            scale=self.scale,
            offset=offset,
        )


class DynamicNTKRoPE(RoPE):
    """Dynamic NTK: past ``max_positions`` the base grows with the sequence length.

    The base depends on the total length, which differs per row in a batch;
    ``mx.fast.rope`` takes one base, so batched (array) offsets are refused.
    """

    def __init__(
        self, dims: int, base: float, traditional: bool, factor: float, max_positions: int
    ):
        super().__init__(dims, base, traditional)
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
    """RoPE with precomputed per-pair frequencies and a scale applied to the input."""

    def __init__(
        self, dims: int, freqs: mx.array, traditional: bool, input_scale: float = 1.0
    ) -> None:
        super().__init__()
        self.dims, self.traditional, self.input_scale = dims, traditional, input_scale
        self._freqs = freqs  # underscore: a buffer, not a parameter to load

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        if self.input_scale != 1.0:
            x = x * self.input_scale
        return mx.fast.rope(
            x,
            self.dims,
            traditional=self.traditional,
            base=None,
            scale=1.0,
            offset=offset,
            freqs=self._freqs,
        )


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

    low = max(math.floor(correction_dim(s.beta_fast)), 0)
    high = min(math.ceil(correction_dim(s.beta_slow)), dims - 1)
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


def make_rope(cfg: MiniCPM5Config) -> nn.Module:
    """The RoPE module ``cfg.rope_scaling`` asks for (validated in :mod:`.config`)."""
    dims, base, trad, s = cfg.head_dim, cfg.rope_theta, cfg.rope_traditional, cfg.rope_scaling
    if s is None:
        return RoPE(dims, base, trad)
    if isinstance(s, LinearScaling):
        return RoPE(dims, base, trad, scale=1 / s.factor)
    if isinstance(s, DynamicScaling):
        return DynamicNTKRoPE(dims, base, trad, s.factor, cfg.max_position_embeddings)
    if isinstance(s, Llama3Scaling):
        return FreqsRoPE(dims, _llama3(dims, base, s), trad)
    if isinstance(s, YarnScaling):
        freqs, mscale = _yarn(dims, base, s)
        return FreqsRoPE(dims, freqs, trad, input_scale=mscale)
    if isinstance(s, LongRopeScaling):
        freqs, scale = _longrope(dims, base, s, cfg.max_position_embeddings)
        return FreqsRoPE(dims, freqs, traditional=False, input_scale=scale)
    raise AssertionError(f"unhandled rope scaling {s!r}")  # config validation prevents this
