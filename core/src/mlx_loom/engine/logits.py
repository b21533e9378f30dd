"""Logits processors: the request's edits to the raw logits before sampling.

Each processor is ``processor(tokens, logits) -> logits`` where ``tokens`` is
the 1-D array of every token so far (prompt and generated) and ``logits`` is
``[B, V]``; the same history applies to every row, as in mlx-lm's
``generate_step``. Processors return a new array and never modify ``logits``
in place (mlx-lm's repetition and presence penalties assign into the array
they are given; we produce the same values through ``put_along_axis``).

The arithmetic matches mlx-lm's ``make_logits_processors`` op for op so the
processed logits are bit-equal:

* repetition: for each distinct token in the window, a negative logit is
  multiplied by the penalty and a non-negative one divided by it (CTRL,
  arXiv:1909.05858). Dividing, not multiplying by the reciprocal, is what
  mlx-lm does; the two round differently.
* presence: the penalty is subtracted once per distinct token in the window
  (a gather, subtract and scatter: repeats in the window write the same value).
* frequency: the penalty is subtracted once per occurrence (a scatter-add, so
  ``k`` occurrences subtract ``penalty`` ``k`` times in sequence, not ``k *
  penalty`` once: those round differently too).
* logit bias: added once per listed token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx

from mlx_loom.engine.params import SamplingParams

#: ``processor(tokens_so_far [T], logits [B, V]) -> logits [B, V]``
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


@dataclass(frozen=True)
class LogitBias:
    """Add a fixed bias to chosen token ids (OpenAI's ``logit_bias``)."""

    bias: dict[int, float]
    _ids: mx.array = field(init=False, repr=False, compare=False)
    _values: mx.array = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Built once per request, not per token. The values array is float32
        # (Python floats) and the scatter-add casts it to the logits' dtype,
        # exactly as mlx-lm's processor does.
        object.__setattr__(self, "_ids", mx.array(list(self.bias.keys())))
        object.__setattr__(self, "_values", mx.array(list(self.bias.values())))

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        return logits.at[:, self._ids].add(self._values)


@dataclass(frozen=True)
class RepetitionPenalty:
    """Shrink the logits of recently seen tokens toward "less likely"."""

    penalty: float
    context_size: int

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if tokens.size == 0:
            return logits
        window = tokens[-self.context_size :]
        seen = logits[:, window]
        penalized = mx.where(seen < 0, seen * self.penalty, seen / self.penalty)
        return mx.put_along_axis(logits, window[None], penalized, axis=-1)


@dataclass(frozen=True)
class PresencePenalty:
    """Subtract ``penalty`` once from every token seen in the window."""

    penalty: float
    context_size: int

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if tokens.size == 0:
            return logits
        window = tokens[-self.context_size :]
        return mx.put_along_axis(logits, window[None], logits[:, window] - self.penalty, axis=-1)


@dataclass(frozen=True)
class FrequencyPenalty:
    """Subtract ``penalty`` from a token once per time it occurs in the window."""

    penalty: float
    context_size: int

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if tokens.size == 0:
            return logits
        window = tokens[-self.context_size :]
        return logits.at[:, window].subtract(self.penalty)


def make_logits_processors(params: SamplingParams) -> list[LogitsProcessor]:
    """The processors ``params`` asks for, in the order they must run.

    Order is mlx-lm's: logit bias, repetition, presence, frequency. A
    processor that would leave every logit unchanged is left out (no bias,
    repetition penalty 1.0, additive penalty 0): skipping it is bit-identical
    and saves a gather/scatter per token. All three penalties share one
    window, ``params.penalty_context_size``.
    """
    processors: list[LogitsProcessor] = []
    if params.logit_bias:
        processors.append(LogitBias(dict(params.logit_bias)))
    size = params.penalty_context_size
    if params.repetition_penalty is not None and params.repetition_penalty != 1.0:
        processors.append(RepetitionPenalty(params.repetition_penalty, size))
    if params.presence_penalty:
        processors.append(PresencePenalty(params.presence_penalty, size))
    if params.frequency_penalty:
        processors.append(FrequencyPenalty(params.frequency_penalty, size))
    return processors


def apply_logits_processors(
    processors: list[LogitsProcessor], tokens: mx.array, logits: mx.array
) -> mx.array:
    """Run ``processors`` in order; the loop's one call per step."""
    for processor in processors:
        logits = processor(tokens, logits)
    return logits
