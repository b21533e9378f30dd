"""How a row turns logits into its next token: one implementation for every decode step.

Per row, in mlx-lm's ``generate_step`` order:

1. the row's logits processors — the penalties and logit bias its
   :class:`~mlx_loom.engine.params.SamplingParams` ask for, then the caller's
   ``logits_processors``, then any a front end adds for this row alone —
   each called as ``processor(history [T], logits [1, V]) -> logits [1, V]``
   over the row's own token history (prompt and generated tokens);
2. the log-softmax (:func:`log_probs`: the model's native node when it has one);
3. the greedy argmax, or the row's sampler (which owns the row's PRNG key).

A plain decode step (:mod:`mlx_loom.engine.group`) runs this for one
position per row, rows batched (:func:`process_batch`, :func:`sample_batch`).
A speculative step (:mod:`mlx_loom.engine.speculative`) runs step 1 for each
position ``j`` of a row's verify window, whose history is the row's history
plus the window's first ``j`` drafts (:meth:`TokenPicker.process`), step 2
for the window, and lets its accept rule choose with the same sampler. So a
processor sees the same history and logits whichever way the row decodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import mlx.core as mx

from mlx_loom.engine.logits import make_logits_processors
from mlx_loom.engine.sampling import logprobs_from_logits, make_sampler

if TYPE_CHECKING:
    from mlx_loom.engine.request import ProcessorFn, Request, SamplerFn
    from mlx_loom.model import Model


class TokenPicker:
    """One row's logits processors, token history and sampler (engine thread only).

    ``extra`` processors run after the request's own, for this row alone (a
    per-row constraint such as a grammar mask). The history is kept only
    when some processor reads it.
    """

    def __init__(self, request: Request, *, extra: Sequence[ProcessorFn] = ()) -> None:
        params = request.params
        self.greedy = request.sampler is None and params.greedy
        self.sampler: SamplerFn = (
            request.sampler if request.sampler is not None else make_sampler(params)
        )
        self.processors: list[ProcessorFn] = [
            *make_logits_processors(params),
            *request.logits_processors,
            *extra,
        ]
        #: Every token so far (what the caches held, the prompt, each generated
        #: token), as mlx-lm's ``generate_step`` feeds its processors.
        self.history: mx.array | None = None
        if self.processors:
            self.history = mx.array([*request.history, *request.prompt], mx.uint32)

    def note(self, tokens: mx.array | Sequence[int]) -> None:
        """Append generated ``tokens`` to the history (an array may still be lazy)."""
        if self.history is None:
            return
        if not isinstance(tokens, mx.array):
            tokens = mx.array(list(tokens), mx.uint32)
        self.history = mx.concatenate([self.history, tokens])

    def process(self, logits: mx.array, drafts: Sequence[int] = ()) -> mx.array:
        """``logits [1 + len(drafts), V]`` through the processors, position by position.

        Position ``j`` sees the history followed by ``drafts[:j]``: what the
        history would be had the row decoded those drafts one by one.
        """
        if not self.processors:
            return logits
        assert self.history is not None
        if not drafts:
            return self._apply(self.history, logits)
        parts = []
        for j in range(logits.shape[0]):
            history = self.history
            if j:
                history = mx.concatenate([history, mx.array(list(drafts[:j]), mx.uint32)])
            parts.append(self._apply(history, logits[j : j + 1]))
        return mx.concatenate(parts)

    def _apply(self, history: mx.array, logits: mx.array) -> mx.array:
        for processor in self.processors:
            logits = processor(history, logits)
        return logits

    def sample(self, logprobs: mx.array) -> mx.array:
        """The next token ``[1]`` for ``logprobs [1, V]``: the argmax, or a draw."""
        if self.greedy:
            return mx.argmax(logprobs, axis=-1)
        return self.sampler(logprobs)


def host_ints(values: mx.array) -> list[int]:
    """An integer array read back as Python ints (typed: ``tolist`` is not)."""
    return cast("list[int]", values.tolist())


def host_floats(values: mx.array) -> list[float]:
    """A float array read back as Python floats."""
    return cast("list[float]", values.tolist())


def host_int(value: mx.array) -> int:
    """A one-element integer array read back as a Python int."""
    return int(cast(int, value.item()))


def host_float(value: mx.array) -> float:
    """A one-element float array read back as a Python float."""
    return float(cast(float, value.item()))


def log_probs(model: Model, logits: mx.array) -> mx.array:
    """Log-probabilities of processed ``logits``, through ``model``'s native kernels."""
    with model.native_kernels():
        return logprobs_from_logits(logits)


def process_batch(
    pickers: Sequence[TokenPicker], logits: mx.array, failed: dict[int, BaseException]
) -> mx.array:
    """Each row's logits (``[B, V]``, one position per row) through its own processors.

    A row whose processor raises (a caller's code) fails alone: it is
    recorded in ``failed`` and its logits pass unprocessed.
    """
    if not any(p.processors for p in pickers):
        return logits
    B = len(pickers)
    parts = []
    for j, picker in enumerate(pickers):
        part = logits if B == 1 else logits[j : j + 1]
        if picker.processors:
            try:
                part = picker.process(part)
            except BaseException as err:  # a user's processor: this row fails alone
                failed[j] = err
                part = logits if B == 1 else logits[j : j + 1]
        parts.append(part)
    return parts[0] if B == 1 else mx.concatenate(parts)


def sample_batch(
    pickers: Sequence[TokenPicker], logprobs: mx.array, failed: dict[int, BaseException]
) -> mx.array:
    """One token per row (``[B]``) from ``logprobs [B, V]``; greedy rows share one argmax.

    A row whose sampler raises (a caller's code) fails alone: it is recorded
    in ``failed`` and given the argmax.
    """
    B = len(pickers)
    if all(p.greedy for p in pickers):
        return mx.argmax(logprobs, axis=-1)
    if B == 1:
        return pickers[0].sampler(logprobs)
    greedy = mx.argmax(logprobs, axis=-1) if any(p.greedy for p in pickers) else None
    parts = []
    for j, picker in enumerate(pickers):
        if greedy is not None and picker.greedy:
            parts.append(greedy[j : j + 1])
            continue
        try:
            token = mx.reshape(picker.sampler(logprobs[j : j + 1]), (1,)).astype(mx.uint32)
        except BaseException as err:  # a user's sampler: this row fails alone
            failed[j] = err
            token = mx.argmax(logprobs[j : j + 1], axis=-1)
        parts.append(token)
    return mx.concatenate(parts)
