"""Choosing the next token from log-probabilities.

The contract is mlx-lm's ``make_sampler``: for the same parameters and the
same PRNG key, :class:`Sampler` picks the identical token. The filters run in
mlx-lm's order on the log-probabilities — top-p, then min-p, then XTC, then top-k — and
the survivors are sampled with ``categorical(logprobs * (1 / temperature))``.
Multiplying by the reciprocal (not dividing by ``temperature``) is mlx-lm's
arithmetic; the two round differently, so we keep it.

Seeding. mlx-lm samples from MLX's global generator: ``mx.random.seed(s)``
sets the global key to ``mx.random.key(s)``, and each draw splits it into
``(k0, k1)``, keeps ``k0`` as the new global key and draws with ``k1``
(``KeySequence::next`` in MLX). A :class:`Sampler` owns its key instead and
advances it the same way, so ``Sampler(SamplingParams(seed=s, ...))`` gives,
draw for draw, the tokens mlx-lm gives after ``mx.random.seed(s)`` — without
touching global state, so concurrent requests do not perturb each other.
(The parity tests check exactly this equivalence.) Greedy decoding draws no
randomness and does not advance the key, as in mlx-lm.

Cost. The sampler runs once per generated token. Greedy is one ``argmax``.
The stochastic path — split the key, filter, scale, draw — is one
``mx.compile``d graph, shared by every request with the same chain shape
(which filters, ``top_k``, ``min_tokens_to_keep``), where mlx-lm compiles each
filter separately and bakes every float setting into its kernels. The float
settings enter our graph as arrays instead, so a request with a new
temperature or top-p builds no new kernel (see the note above the filters).
One graph stays bit-equal to mlx-lm's separate ones: the only ops fused
across its boundaries are comparisons, selects and one multiply, which round
identically fused or not (the tests check tokens and the sampled-from logits
over many draws, in float32 and bfloat16).
"""

from __future__ import annotations

import functools
import math
import secrets
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from mlx_loom.engine.logits import (
    LogitsProcessor,
    apply_logits_processors,
    make_logits_processors,
)
from mlx_loom.engine.params import SamplingParams
from mlx_loom.errors import RequestError
from mlx_loom.forward_hooks import current_log_softmax

__all__ = [
    "LogitsProcessor",
    "Sampler",
    "apply_logits_processors",
    "logprobs_from_logits",
    "logprobs_top_k",
    "make_logits_processors",
    "make_sampler",
]

_NEG_INF = -float("inf")


# --- filters: [B, V] log-probabilities in, same shape out, removed tokens at -inf
#
# The real-valued settings (top_p, log(min_p), 1/temperature) enter the graph
# as 0-d float32 *arrays*, not Python floats. mlx-lm passes Python floats to
# its compiled filters, which bakes each value into the fused kernel as a
# literal: on the CPU backend every new temperature (or top_p, or min_p) then
# costs a fresh C++ kernel build, ~1 s on a 2-core machine, on the first
# token of the request. As arrays, one kernel serves every value. The values
# are still rounded as mlx-lm rounds them: a Python float meeting an array
# becomes a float32 and is then cast to the array's dtype, which is what the
# ``.astype(logprobs.dtype)`` below does (the parity tests check fp32 and bf16).


def _top_p(logprobs: mx.array, top_p: mx.array) -> mx.array:
    """Keep the smallest set of most likely tokens whose mass reaches ``top_p``.

    Works on the ascending sort: for each position, the probability mass of
    the tokens strictly more likely than it. Positions whose "mass above"
    already reaches ``top_p`` of the total are dropped; the first position
    kept sets the log-probability threshold. The probabilities are summed in
    float32 whatever the input dtype; the threshold is compared in the input
    dtype. Ties with the threshold are all kept.
    """
    ascending = mx.sort(logprobs, axis=-1)
    probs = mx.exp(ascending.astype(mx.float32))
    mass_above = mx.cumsum(probs, axis=-1, reverse=True, inclusive=False)
    total = mass_above[..., :1] + probs[..., :1]
    dropped = (mass_above >= top_p * total).sum(axis=-1, keepdims=True)
    threshold = mx.take_along_axis(ascending, dropped, axis=-1)
    return mx.where(logprobs < threshold, _NEG_INF, logprobs)


def _min_p(logprobs: mx.array, log_min_p: mx.array, min_tokens_to_keep: int) -> mx.array:
    """Drop tokens less likely than ``min_p`` times the most likely one.

    In log space the cut is ``max + log(min_p)``, with ``log(min_p)`` taken in
    double precision on the host, as mlx-lm takes it. The
    ``min_tokens_to_keep`` most likely tokens always survive (chosen by
    ``argpartition``, so ties at the edge resolve as mlx-lm's do).
    """
    cut = mx.max(logprobs, axis=-1, keepdims=True) + log_min_p.astype(logprobs.dtype)
    remove = logprobs < cut
    if min_tokens_to_keep > 1:
        keep = mx.argpartition(logprobs, kth=-min_tokens_to_keep, axis=-1)
        keep = keep[..., -min_tokens_to_keep:]
        remove = mx.put_along_axis(remove, keep, mx.array(False), axis=-1)
    return mx.where(remove, _NEG_INF, logprobs)


def _xtc(
    logprobs: mx.array,
    probability: mx.array,
    threshold: mx.array,
    draw: mx.array,
    special: tuple[int, ...],
) -> mx.array:
    """XTC, "exclude top choices": when ``draw`` falls at or under ``probability``,
    remove every token at least ``threshold`` likely except the least likely of them.

    mlx-lm's rule: a token is cut when its probability is above the smallest
    probability that is above the threshold; the ``special`` tokens (EOS,
    newline) are never cut. ``draw`` is one uniform in [0, 1) per call (per
    step, for the whole batch, as mlx-lm draws it).
    """
    probs = mx.softmax(logprobs, axis=-1)
    cut = threshold.astype(probs.dtype)
    smallest_above = mx.where(probs > cut, probs, mx.inf).min(axis=-1, keepdims=True)
    mask = probs > smallest_above
    if special:
        mask[..., list(special)] = False
    return mx.where(draw > probability, logprobs, mx.where(mask, _NEG_INF, logprobs))


def _top_k(logprobs: mx.array, top_k: int) -> mx.array:
    """Keep the ``top_k`` most likely tokens (``argpartition`` decides ties)."""
    beyond = mx.argpartition(-logprobs, kth=top_k - 1, axis=-1)[..., top_k:]
    return mx.put_along_axis(logprobs, beyond, mx.array(_NEG_INF, logprobs.dtype), axis=-1)


@dataclass(frozen=True)
class _Chain:
    """The shape of a filter chain: which filters run, and the integer settings.

    Integers stay Python constants because they set shapes (``top_k`` slices,
    ``min_tokens_to_keep`` partitions); they do not enter fused kernels, so a
    new value only retraces the graph (milliseconds), it builds no kernel.
    """

    top_p: bool
    min_p: bool
    min_tokens_to_keep: int
    top_k: int
    #: XTC runs (``xtc_probability > 0``), sparing these token ids.
    xtc: bool = False
    xtc_special: tuple[int, ...] = ()

    @classmethod
    def of(cls, params: SamplingParams) -> _Chain:
        return cls(
            top_p=0.0 < params.top_p < 1.0,  # mlx-lm's condition; 1.0 keeps everything
            min_p=params.min_p != 0.0,
            min_tokens_to_keep=params.min_tokens_to_keep,
            top_k=params.top_k,
            xtc=params.xtc_probability > 0.0,
            xtc_special=params.xtc_special_tokens or (),
        )

    def prepare(
        self,
        logprobs: mx.array,
        scale: mx.array,
        top_p: mx.array,
        log_min_p: mx.array,
        xtc_probability: mx.array,
        xtc_threshold: mx.array,
        xtc_draw: mx.array,
    ) -> mx.array:
        """``logprobs [B, V] -> logits`` the draw samples from: filtered, then scaled."""
        vocab = logprobs.shape[-1]
        if self.top_p:
            logprobs = _top_p(logprobs, top_p)
        # min_tokens_to_keep >= vocab keeps everything: the filter is the
        # identity, and argpartition could not be asked for it.
        if self.min_p and self.min_tokens_to_keep < vocab:
            logprobs = _min_p(logprobs, log_min_p, self.min_tokens_to_keep)
        if self.xtc:
            logprobs = _xtc(logprobs, xtc_probability, xtc_threshold, xtc_draw, self.xtc_special)
        # top_k >= vocab keeps every token, so the filter is the identity
        # (mlx-lm raises instead; the distribution is the same either way).
        if 0 < self.top_k < vocab:
            logprobs = _top_k(logprobs, self.top_k)
        return logprobs * scale.astype(logprobs.dtype)

    def draw(
        self,
        logprobs: mx.array,
        key: mx.array,
        scale: mx.array,
        top_p: mx.array,
        log_min_p: mx.array,
        xtc_probability: mx.array,
        xtc_threshold: mx.array,
    ) -> tuple[mx.array, mx.array]:
        """One token per row, and the key the next draw will split.

        With XTC, its uniform is drawn first, from its own split of the key:
        mlx-lm's XTC draws from the global generator before the categorical
        draw does, so the same seed gives the same two draws in order.
        """
        xtc_draw = _NO_XTC_DRAW
        if self.xtc:
            key, xtc_key = mx.random.split(key)
            xtc_draw = mx.random.uniform(key=xtc_key)
        next_key, draw_key = mx.random.split(key)
        logits = self.prepare(
            logprobs, scale, top_p, log_min_p, xtc_probability, xtc_threshold, xtc_draw
        )
        return mx.random.categorical(logits, key=draw_key), next_key


#: The XTC uniform where none is drawn: above every probability, so XTC never cuts.
_NO_XTC_DRAW = mx.array(2.0, mx.float32)


@functools.lru_cache(maxsize=64)
def _compiled(
    chain: _Chain,
) -> tuple[Callable[..., tuple[mx.array, mx.array]], Callable[..., mx.array]]:
    """Compiled ``(draw, prepare)`` for one chain shape, shared by all requests.

    Memoised so that every request with the same chain shape reuses one
    compiled graph (MLX retraces only for a new input shape or dtype); the
    cache holds pure functions, no request state.
    """
    return mx.compile(chain.draw), mx.compile(chain.prepare)


def _greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


class Sampler:
    """Picks tokens for one request; owns that request's PRNG key.

    ``sampler(logprobs [B, V]) -> tokens [B]`` (uint32, like mlx-lm). Each
    stochastic call advances :attr:`key`; see the module docstring for how
    that matches ``mx.random.seed``. Without ``params.seed`` a fresh seed is
    drawn from the OS and kept in :attr:`seed`, so any run can be replayed.
    """

    def __init__(self, params: SamplingParams, *, key: mx.array | None = None) -> None:
        self.params = params
        self.seed: int | None = None
        if key is None:
            self.seed = params.seed if params.seed is not None else secrets.randbits(64)
            key = mx.random.key(self.seed)
        self._key = key
        self._draw = self._prepare = None
        if not params.greedy:
            self._draw, self._prepare = _compiled(_Chain.of(params))
            # Python floats -> float32, exactly as mlx-lm's weak scalars are
            # converted before meeting the logprobs (see the filters' note).
            log_min_p = math.log(params.min_p) if params.min_p > 0.0 else 0.0
            self._knobs = (
                mx.array(1.0 / params.temperature, mx.float32),
                mx.array(params.top_p, mx.float32),
                mx.array(log_min_p, mx.float32),
                mx.array(params.xtc_probability, mx.float32),
                mx.array(params.xtc_threshold, mx.float32),
            )

    @property
    def key(self) -> mx.array:
        """The key the next stochastic draw will split."""
        return self._key

    def __call__(self, logprobs: mx.array) -> mx.array:
        if self._draw is None:
            return _greedy(logprobs)
        tokens, self._key = self._draw(logprobs, self._key, *self._knobs)
        return tokens

    def split_key(self) -> mx.array:
        """A key for one draw outside :meth:`__call__` (advances :attr:`key` as a draw does).

        Speculative decoding's accept/reject rule draws its uniforms and its
        residual samples with these, so a seeded request stays reproducible.
        """
        self._key, draw = mx.random.split(self._key)
        return draw

    def sampling_logits(self, logprobs: mx.array) -> mx.array:
        """The unnormalised logits the next draw samples from, for inspection.

        Filtered tokens are ``-inf``; the rest are scaled by ``1 / temperature``.
        For greedy decoding, ``logprobs`` itself (the argmax is taken of it).
        Does not advance the key, so XTC's random cut is left out (it needs a
        draw; speculative decoding, the caller that needs these logits, is
        refused with XTC).
        """
        if self._prepare is None:
            return logprobs
        return self._prepare(logprobs, *self._knobs, _NO_XTC_DRAW)

    def __repr__(self) -> str:
        return f"Sampler(seed={self.seed}, params={self.params!r})"


def make_sampler(params: SamplingParams, *, key: mx.array | None = None) -> Sampler:
    """The sampler for ``params``: a callable ``logprobs [B, V] -> tokens [B]``.

    ``key`` overrides the key derived from ``params.seed`` (to continue a
    stream, or to share one key schedule across rows on purpose).
    """
    return Sampler(params, key=key)


def logprobs_from_logits(logits: mx.array) -> mx.array:
    """Normalise ``[B, V]`` logits to log-probabilities, row by row.

    This is what the loop feeds the sampler (after the logits processors):
    ``logits - logsumexp(logits)`` over the vocabulary axis, as mlx-lm's
    batched generator computes it. Built inside a model's native kernels
    (:meth:`mlx_loom.Model.native_kernels`), float32 logits take one native
    node with MLX's exact arithmetic (bit-equal).
    """
    native = current_log_softmax()
    if native is not None and logits.dtype == mx.float32:
        return native(logits)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


@functools.lru_cache(maxsize=32)
def _compiled_top_k(k: int) -> Callable[[mx.array], tuple[mx.array, mx.array]]:
    def top(logprobs: mx.array) -> tuple[mx.array, mx.array]:
        ids = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[..., :k]
        values = mx.take_along_axis(logprobs, ids, axis=-1)
        order = mx.argsort(-values, axis=-1)
        return mx.take_along_axis(ids, order, axis=-1), mx.take_along_axis(values, order, axis=-1)

    return mx.compile(top)


def logprobs_top_k(logprobs: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """The ``k`` most likely tokens per row, most likely first.

    Returns ``(token_ids [B, k] uint32, values [B, k])`` in the dtype of
    ``logprobs``. Used to report ``logprobs`` alternatives; ``k`` larger than
    the vocabulary returns the whole vocabulary, ``k == 0`` empty arrays.
    Partitioning first keeps this ``O(V)`` plus a sort of ``k`` values rather
    than a sort of the vocabulary.
    """
    if k < 0:
        raise RequestError(
            f"logprobs_top_k was asked for k={k} alternatives; k must be >= 0.",
            fix="pass k=0 to report no alternatives, or a positive count",
        )
    batch, vocab = logprobs.shape
    k = min(k, vocab)
    if k == 0:
        return mx.zeros((batch, 0), mx.uint32), mx.zeros((batch, 0), logprobs.dtype)
    return _compiled_top_k(k)(logprobs)
