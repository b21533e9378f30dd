"""Speculative decoding, written once against the cache protocol.

A small draft model proposes ``num_draft`` tokens; the main model verifies
them in one forward and keeps the longest agreeing prefix plus its own next
token. Rolling the caches back to the kept prefix is the part that must be
exact, and it is the caches' job:

* a cache that can begin a speculative round (``SpeculativeRounds``: the
  recurrent state) is snapshotted before the window and ``commit(keep)``
  replays only the kept tokens;
* any other cache is trimmed — and a cache that cannot trim exactly (a
  sliding window that has wrapped) raises ``CacheNotTrimmable`` rather than
  keeping tokens that were rejected. mlx-lm silently skips that trim, which is
  why its speculative decoding goes wrong on sliding-window models.

With greedy sampling the output equals plain greedy decoding token for token.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import mlx.core as mx

from ..cache.protocol import SpeculativeRounds
from ..errors import RequestError
from ..host import SPECULATIVE
from ..model import Model
from .sampling import logprobs_from_logits

Sampler = Callable[[mx.array], mx.array]


def _greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


def _begin(cache: list[Any]) -> None:
    for c in cache:
        if isinstance(c, SpeculativeRounds):
            c.begin_round()


def _rewind(cache: list[Any], fed: int, keep: int) -> None:
    """Keep the first ``keep`` of the ``fed`` tokens this round put in ``cache``."""
    for c in cache:
        if isinstance(c, SpeculativeRounds):
            c.commit(keep)
        elif fed > keep:
            c.trim(fed - keep)


def _prefill(model: Model, tokens: Sequence[int], cache: list[Any], step: int) -> None:
    for start in range(0, len(tokens), step):
        model(mx.array(tokens[start : start + step])[None], cache)
        mx.eval([c.state for c in cache])


def speculative_generate_tokens(
    model: Model,
    draft: Model,
    prompt: Sequence[int],
    *,
    num_draft: int = 3,
    max_tokens: int = 256,
    sampler: Sampler = _greedy,
    prefill_step_size: int = 2048,
) -> Iterator[tuple[int, mx.array, bool]]:
    """Yield ``(token, logprobs, from_draft)`` for up to ``max_tokens`` tokens."""
    model.require(SPECULATIVE, asked="speculative decoding")
    draft.require(SPECULATIVE, asked="speculative decoding (draft model)")
    if model.vocab_size != draft.vocab_size:
        raise RequestError(
            f"The draft model's vocabulary ({draft.vocab_size}) differs from the model's "
            f"({model.vocab_size}).",
            fix="Use a draft model that shares the main model's tokenizer.",
        )
    if isinstance(num_draft, bool) or not isinstance(num_draft, int) or num_draft < 1:
        raise RequestError(
            f"num_draft={num_draft!r} is invalid; it must be an int >= 1.",
            fix="Pass num_draft between 1 and 8 (3 is a good start).",
        )
    if not prompt:
        raise RequestError("The prompt is empty.", fix="Pass a non-empty prompt.")
    main_cache, draft_cache = model.make_cache(), draft.make_cache()
    _prefill(model, prompt[:-1], main_cache, prefill_step_size)
    _prefill(draft, prompt[:-1], draft_cache, prefill_step_size)
    y = prompt[-1]
    draft_pending: list[int] = []  # accepted tokens the draft has not seen yet
    produced = 0
    while produced < max_tokens:
        k = min(num_draft, max_tokens - produced - 1)
        proposals: list[int] = []
        if k > 0:
            _begin(draft_cache)
            feed = draft_pending + [y]
            for _ in range(k):
                logits = draft(mx.array(feed)[None], draft_cache)[:, -1, :]
                token = sampler(logprobs_from_logits(logits)).item()
                proposals.append(token)
                feed = [token]
        window = [y, *proposals]
        _begin(main_cache)
        logits = model(mx.array(window)[None], main_cache)[0]
        logprobs = logprobs_from_logits(logits)
        chosen = sampler(logprobs).tolist()
        accepted = 0
        while accepted < len(proposals) and proposals[accepted] == chosen[accepted]:
            accepted += 1
        _rewind(main_cache, len(window), accepted + 1)
        if k > 0:
            # The draft saw pending + y + proposals[:k-1]; keep pending + y + accepted ones.
            seen = len(draft_pending) + k
            keep = len(draft_pending) + 1 + min(accepted, k - 1)
            _rewind(draft_cache, seen, keep)
            draft_pending = proposals[k - 1 : accepted] if accepted == k else []
        else:
            draft_pending = draft_pending + [y]
        for i in range(accepted + 1):
            yield chosen[i], logprobs[i], i < accepted
            produced += 1
            if produced >= max_tokens:
                return
        y = chosen[accepted]
