"""One request inside the engine: its own sampler, penalties, text and counters.

A row carries everything that makes its tokens its own, so a row's output
does not depend on its neighbours in a batch: its token picker
(:class:`~mlx_loom.engine.next_token.TokenPicker`: its logits processors
over its own token history, and its sampler, which owns its PRNG key), its
detokenizer and stop-string matcher, its budget. The caches it is fed through belong to the decode group it is in.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from mlx_loom.engine.constraints import RowConstraint
from mlx_loom.engine.events import TokenEvent
from mlx_loom.engine.next_token import TokenPicker
from mlx_loom.engine.request import Request
from mlx_loom.engine.splits import chunk_end
from mlx_loom.text import StopStrings

if TYPE_CHECKING:
    from mlx_loom.model import Model


class Row:
    """The per-request state of one generation (engine thread only)."""

    def __init__(self, uid: int, request: Request, *, to_feed: list[int], cached: int) -> None:
        self.uid = uid
        self.request = request
        #: Prompt tokens still to feed (after any reuse); the last one is the
        #: first decode input, so it is never fed by prefill.
        self.to_feed = to_feed
        self.cursor = 0
        #: Prompt tokens found already in the caches (prefix reuse).
        self.cached = cached
        #: Every token fed into this row's caches by this request, in order.
        self.fed: list[int] = []
        self.caches: list[Any] | None = None
        #: End-of-turn ids whose positions end prefill chunks, with chunks on
        #: the prompt's own grid (:mod:`mlx_loom.engine.splits`); ``None``:
        #: chunks simply follow on from where the caches left off.
        self.aligned: frozenset[int] | None = None
        #: Whether the caches hold what a prefill from nothing would (a fresh
        #: start, or a restored checkpoint), so checkpoints taken now are exact.
        self.exact = True
        #: Checkpoints taken while prefilling (:class:`~mlx_loom.engine.prefix.TakenCheckpoint`),
        #: in position order.
        self.checkpoints: list[Any] = []
        #: A speculative row's drafter and token sequence (set when it starts decoding).
        self.speculation: Any = None
        #: The MTP head's drafter of a row drafting with it, fed while prefilling
        #: (:mod:`mlx_loom.engine.mtp`).
        self.mtp: Any = None
        self.produced = 0
        self.finished = False
        #: Bytes this row reserves against the KV budget while it runs
        #: (:mod:`mlx_loom.engine.kv_budget`).
        self.kv_bytes = 0
        #: How this row's logits become its tokens, whichever way it decodes.
        self.picker = TokenPicker(request)
        tok = request.tokenizer
        #: The row's parser state over its structured-output constraint.
        self.constraint: RowConstraint | None = None
        if request.constraint is not None and tok is not None:
            self.constraint = RowConstraint(request.constraint, tok, request.eos)
        self.detok = tok.detokenizer() if tok is not None else None
        self.stops = StopStrings(request.stop)
        self.admitted = time.perf_counter()
        self.first_at = 0.0
        self.prompt_tps = 0.0

    # --- prefill ------------------------------------------------------------

    @property
    def prefill_left(self) -> int:
        """Prompt tokens prefill still has to feed (all but the last)."""
        return max(0, len(self.to_feed) - 1 - self.cursor)

    def chunk_len(self, step: int) -> int:
        """How many tokens the next prefill chunk feeds."""
        if self.aligned is None:
            return min(step, self.prefill_left)
        start = self.prompt_position
        prompt = self.request.prompt
        return chunk_end(prompt, start, step, len(prompt) - 1, self.aligned) - start

    @property
    def prompt_position(self) -> int:
        """Where in the request's prompt prefill has reached."""
        origin = 0 if self.request.cache is not None else self.cached
        return origin + self.cursor

    @property
    def position(self) -> int:
        """Tokens the caches hold (what they held before, plus the prompt fed so far)."""
        return self.cached + self.cursor

    def next_chunk(self, step: int) -> list[int]:
        n = self.chunk_len(step)
        chunk = self.to_feed[self.cursor : self.cursor + n]
        self.cursor += n
        self.fed.extend(chunk)
        return chunk

    @property
    def last_prompt_token(self) -> int:
        return self.to_feed[-1]

    # --- decode ---------------------------------------------------------------

    @property
    def at_last_token(self) -> bool:
        """True when the token about to be emitted is this row's last (by count)."""
        return self.produced + 1 >= self.request.limit

    def note_fed(self, token: int) -> None:
        self.fed.append(token)

    def accept(
        self,
        token: int,
        logprob: float,
        top: list[tuple[int, float]],
        vector: mx.array | None,
        *,
        from_draft: bool = False,
    ) -> TokenEvent:
        """Turn one sampled token into this row's event (text, stop, finish)."""
        self.produced += 1
        now = time.perf_counter()
        if self.produced == 1:
            self.first_at = now
            self.prompt_tps = len(self.to_feed) / max(now - self.admitted, 1e-9)
        finish: str | None = None
        detok = self.detok
        if token in self.request.eos:
            finish = "stop"
            if detok is not None:
                detok.finalize()
        else:
            if detok is not None:
                detok.add_token(token)
            if self.produced >= self.request.limit:
                finish = "length"
                if detok is not None:
                    detok.finalize()
        text, hit = "", None
        if detok is not None:
            check = self.stops.feed(detok.last_segment)
            text, hit = check.emit, check.stop
            if hit is not None:
                finish = "stop"
            elif finish is not None:
                text += self.stops.flush()
        self.finished = finish is not None
        elapsed = max(now - self.first_at, 1e-9)
        return TokenEvent(
            uid=self.uid,
            token=token,
            text=text,
            logprob=logprob,
            top_logprobs=top,
            prompt_tokens=len(self.request.history) + len(self.request.prompt),
            cached_tokens=self.cached,
            generation_tokens=self.produced,
            prompt_tps=self.prompt_tps,
            generation_tps=self.produced / elapsed,
            peak_memory=mx.get_peak_memory() / 1e9,
            finish_reason=finish,
            stop=hit,
            from_draft=from_draft,
            logprobs=vector,
        )


def row_adapters(rows: Sequence[Row]) -> list[str | None] | None:
    """Each row's adapter for one forward over ``rows`` (``None``: no row runs one).

    The model's adapted layers apply each row's own adapter to that row only
    (:mod:`mlx_loom.adapters.multi`), so rows with different adapters, and
    rows without, share a forward and each gets the values of its solo run.
    """
    names = [row.request.adapter for row in rows]
    return names if any(name is not None for name in names) else None


def adapter_batch_key(model: Model, row: Row) -> Hashable:
    """Which rows ``row`` may share a forward with, as far as adapters go.

    Every adapter mixes with every other (and with none) — except one that
    adapts a family's own routed-expert layer, whose rows batch only with
    each other (:meth:`mlx_loom.adapters.AdapterSet.batch_key`).
    """
    adapters = model.adapter_set
    if adapters is None or row.request.adapter is None:
        return None
    return adapters.batch_key(row.request.adapter)
