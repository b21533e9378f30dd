"""A decode group: rows that take their decode steps together, in one forward.

A group of one row decodes through that row's own single-row caches — the
same op graph as mlx-lm's ``generate_step``, step for step, which is what
the loop-parity tests hold bit-equal. When rows join, their caches are
stacked (:meth:`~mlx_loom.cache.protocol.Stackable.stack`) into batch caches
whose rows decode bit for bit as each row alone, so a request's tokens and
logits never depend on its neighbours.

One step (:meth:`DecodeGroup.step`), in ``generate_step``'s order:

1. rows whose current token is their last (by count) leave before the
   forward: nothing is fed for them, as ``generate_step`` feeds nothing past
   ``max_tokens``;
2. the forward over every other row's current token, then (for a row alone)
   the KV-quantization check;
3. per row: its logits processors over its own token history, and its
   grammar's mask (a constrained row: :mod:`mlx_loom.engine.constraints`;
   the current tokens are read first, while the forward runs), then the
   log-softmax of the batch, then each row's own sampler (greedy rows share
   one ``argmax``) — :mod:`mlx_loom.engine.next_token`, which speculative
   steps use too;
4. ``mx.async_eval`` of the next tokens — queued *before* the current
   tokens are read back, so host work overlaps the device;
5. the current tokens are read and handed to their rows (text, stops,
   finish); rows that finished by content (EOS, a stop string) leave.

Speculative rows decode in groups of their own kind
(:class:`~mlx_loom.engine.speculative.SpeculativeGroup`, which reuses this
class's joining and leaving), whose step feeds each row a window of draft
tokens and keeps, per row, what was accepted.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, cast

import mlx.core as mx

from mlx_loom.cache.mixed import join_rows, stack_rows
from mlx_loom.cache.protocol import RowPlaces
from mlx_loom.engine.caches import layout, quantization_pending, stackable
from mlx_loom.engine.constraints import constrain_rows
from mlx_loom.engine.events import TokenEvent
from mlx_loom.engine.next_token import (
    host_floats,
    host_ints,
    log_probs,
    process_batch,
    sample_batch,
)
from mlx_loom.engine.row import Row, adapter_batch_key, row_adapters
from mlx_loom.engine.sampling import logprobs_top_k

if TYPE_CHECKING:
    from mlx_loom.model import Model


@dataclass
class Left:
    """A row leaving its group, with the single-row caches it leaves with."""

    row: Row
    caches: list[Any] | None
    error: BaseException | None = None


@dataclass
class _Extras:
    """What a row asked to see about its current token, still lazy."""

    top: tuple[mx.array, mx.array] | None = None
    vector: mx.array | None = None


@dataclass
class StepResult:
    events: list[TokenEvent] = field(default_factory=list)
    left: list[Left] = field(default_factory=list)
    #: Draft tokens proposed and accepted in this step (speculative groups).
    drafted: int = 0
    accepted: int = 0


class DecodeGroup:
    """Rows decoding together through one set of (single-row or batch) caches.

    **Parked rows.** A row that leaves a batch may stay in the batch caches
    until fewer than half the caches' rows are live: taking
    a row out copies every other row's caches into new buffers (MLX gives a
    row range of a buffer no storage of its own), which on a 16-row batch of
    a 350M model stalled every row for ~150 ms per departure. A parked row
    is fed a live row's token and its outputs are dropped; rows are computed
    independently, so no live row's values change. The batch compacts —
    once, for all parked rows — when rows join it (the join copies every
    row anyway), when its live rows fall below half, when one row is left
    (it goes back to its own caches), or when :attr:`park_steps` steps pass
    with rows parked. The parked rows' memory is thus
    at most the live rows' own. A row joining a batch with parked rows takes
    a parked row's place, its caches written into the batch's buffers in
    place, where every layer's cache kind can take it there
    (:class:`~mlx_loom.cache.protocol.RowPlaces`; a row longer than the
    batch's rows cannot); else the batch compacts and the row joins by a
    copy, as before.
    """

    #: Whether leaving rows may park (speculative groups commit per cache row, so never).
    parks: ClassVar[bool] = True
    #: Steps a batch keeps parked rows with no row joining before it compacts:
    #: parked rows cost their share of every step (at 16 rows the products are
    #: bound by arithmetic, and 8 parked rows of 16 took a 350M model's step from
    #: ~25 to ~37 ms), about what compacting costs once after 10-15 steps.
    park_steps: ClassVar[int] = 16

    def __init__(self, model: Model, row: Row, caches: list[Any]) -> None:
        self.model = model
        self.rows = [row]
        #: A lone row decodes through its own cache list (a caller's list is
        #: continued in place); stacked rows through batch caches.
        self.caches = caches
        self.stacked = False
        #: The caches' row of each live row, and the caches' row count
        #: (larger than ``len(rows)`` while rows are parked).
        self.slots = [0]
        self.width = 1
        self._parked_for = 0
        self.tokens = mx.array([row.last_prompt_token], mx.uint32)
        self.chosen = mx.zeros((1,), mx.float32)
        self.extras = [_Extras()]
        #: Whether each row's current token was generated (else: its last prompt token).
        self.emit = [False]

    def __len__(self) -> int:
        return len(self.rows)

    # --- grouping -------------------------------------------------------------

    @property
    def key(self) -> Hashable | None:
        """Rows with equal keys may share a batch; ``None``: this group stays alone."""
        if self.stacked:
            return self._key
        row = self.rows[0]
        if not stackable(self.caches) or quantization_pending(self.caches, row.request.kv.bits):
            return None
        return layout(self.caches), adapter_batch_key(self.model, row)

    def absorb(self, others: list[DecodeGroup]) -> None:
        """Take every row of ``others`` (groups with this group's :attr:`key`).

        Lone rows are stacked all at once (one ``stack`` per layer, not one
        per row), then appended to this group's batch with one ``extend``:
        a burst of new rows costs one copy of their caches, not one each.
        """
        if self._into_parked(others):
            return
        batches = [g for g in [self, *others] if g.stacked]
        lone = [g for g in [self, *others] if not g.stacked]
        for group in batches:
            group._compact()  # the join copies every row: parked rows go now
        order = batches + lone
        if not self.stacked:
            self._key = self.key
        # Rows of different KV codecs share the batch through mixed caches
        # (each row still computed by its own codec's batch, as alone).
        layers: list[Any] | None = None
        for group in batches:
            if layers is None:
                layers = group.caches
            else:
                layers = [join_rows(m, t) for m, t in zip(layers, group.caches, strict=True)]
        if lone:
            fresh = [stack_rows([g.caches[i] for g in lone]) for i in range(len(lone[0].caches))]
            if layers is None:
                layers = fresh
            else:
                layers = [join_rows(m, t) for m, t in zip(layers, fresh, strict=True)]
        self.caches = layers or []
        self.stacked = True
        self._take_rows(order, others)
        self.slots, self.width = list(range(len(self.rows))), len(self.rows)

    def _into_parked(self, others: list[DecodeGroup]) -> bool:
        """Put lone rows joining this batch in parked rows' places, writing their caches
        into the batch's buffers in place (no other row is copied); ``False``, and
        nothing done, unless every newcomer's every cache fits a parked place
        (``takes_row`` of the batch cache kind: e.g. no longer than the batch)."""
        taken = set(self.slots)
        parked = [p for p in range(self.width) if p not in taken]
        if not self.stacked or len(others) > len(parked) or any(g.stacked for g in others):
            return False
        for g in others:
            for mine, theirs in zip(self.caches, g.caches, strict=True):
                if not isinstance(mine, RowPlaces) or not mine.takes_row(theirs):
                    return False
        for g, place in zip(others, parked, strict=False):
            for mine, theirs in zip(self.caches, g.caches, strict=True):
                cast(RowPlaces, mine).put_row(place, theirs)
            self.slots.append(place)
        self._take_rows([self, *others], others)
        return True

    def _take_rows(self, order: list[DecodeGroup], others: list[DecodeGroup]) -> None:
        """The rows of ``order`` (this group among them), with their pending tokens,
        as this group's, in that order; ``others`` are left empty."""
        self.rows = [row for g in order for row in g.rows]
        self.tokens = mx.concatenate([g.tokens.astype(mx.uint32) for g in order])
        self.chosen = mx.concatenate([g.chosen.astype(mx.float32) for g in order])
        self.extras = [e for g in order for e in g.extras]
        self.emit = [e for g in order for e in g.emit]
        for g in others:
            g.rows = []

    def _row_caches(self, i: int) -> list[Any]:
        """Row ``i``'s caches as single-row caches (its own list when alone).

        A copy taken out of a batch is evaluated here: while it is lazy it
        holds the batch's buffers, and the next step's cache writes, which
        otherwise update those buffers in place, would copy them whole.
        """
        if not self.stacked:
            return self.caches
        single = [c.extract(self.slots[i]) for c in self.caches]
        mx.eval([c.state for c in single])
        return single

    def _compact(self) -> None:
        """Drop the parked rows from the batch caches."""
        if self.stacked and self.width != len(self.rows):
            for c in self.caches:
                c.filter(self.slots)
            self.slots, self.width = list(range(len(self.rows))), len(self.rows)

    def _keep(self, keep: list[int]) -> None:
        """Keep only rows ``keep`` (indices, in order), in caches and pending tokens."""
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
        self.emit = [self.emit[i] for i in keep]
        self.extras = [self.extras[i] for i in keep]
        if not keep:
            self.caches = []
            return
        idx = mx.array(keep, mx.int32)
        self.tokens, self.chosen = self.tokens[idx], self.chosen[idx]
        self.slots = [self.slots[i] for i in keep]
        if self.stacked:
            if len(keep) == 1:
                # A lone row goes back to its own caches: the cheaper single-row
                # path (no masks, slice writes), with identical values.
                row = self.rows[0]
                single = [c.extract(self.slots[0]) for c in self.caches]
                self.caches = _into(row, single)
                self.stacked = False
                self.slots, self.width = [0], 1
            elif not self.parks or 2 * len(keep) < self.width:
                self._compact()

    def remove(self, uid: int) -> Left | None:
        """Take row ``uid`` out now (cancelled); ``None`` if it is not here."""
        for i, row in enumerate(self.rows):
            if row.uid == uid:
                left = Left(row, self._row_caches(i))
                self._keep([j for j in range(len(self.rows)) if j != i])
                return left
        return None

    # --- one step -------------------------------------------------------------

    def step(self) -> StepResult:
        out = StepResult()
        rows = self.rows
        last = [self.emit[i] and row.at_last_token for i, row in enumerate(rows)]
        going = [i for i in range(len(rows)) if not last[i]]
        cur_tokens, cur_chosen, cur_extras, cur_emit = (
            self.tokens,
            self.chosen,
            self.extras,
            self.emit,
        )
        ending: list[tuple[int, list[Any] | None]] = []
        if len(going) < len(rows):
            ending = [(i, self._row_caches(i)) for i in range(len(rows)) if last[i]]
        self._keep(going)
        self._parked_for = self._parked_for + 1 if self.width != len(self.rows) else 0
        if self._parked_for > self.park_steps:
            self._compact()
        failed: dict[int, BaseException] = {}
        if self.rows:
            failed = self._queue_next()
        # Read the current tokens back (the next step is already queued).
        tokens = host_ints(cur_tokens)
        chosen = host_floats(cur_chosen) if any(cur_emit) else [0.0] * len(tokens)
        fed_rows = set(going)
        leaving: dict[int, Left] = {}
        for i, row in enumerate(rows):
            if i in fed_rows:
                row.note_fed(tokens[i])
            if not cur_emit[i]:
                continue
            extra = cur_extras[i]
            top: list[tuple[int, float]] = []
            if extra.top is not None:
                ids, vals = extra.top
                top = list(zip(host_ints(ids[0]), host_floats(vals[0]), strict=True))
            out.events.append(row.accept(tokens[i], chosen[i], top, extra.vector))
        for i, caches in ending:
            leaving[rows[i].uid] = Left(rows[i], caches)
        # Rows that finished by content, or whose own processing failed, leave now.
        done = [j for j, row in enumerate(self.rows) if row.finished or j in failed]
        for j in done:
            row = self.rows[j]
            leaving[row.uid] = Left(row, self._row_caches(j), failed.get(j))
        if done:
            self._keep([j for j in range(len(self.rows)) if j not in done])
        out.left = list(leaving.values())
        return out

    def _queue_next(self) -> dict[int, BaseException]:
        """Build and queue the forward and sampling of the next tokens of every row."""
        rows, B = self.rows, len(self.rows)
        inputs = self.tokens
        feed, adapters = inputs, row_adapters(rows)
        if self.width != B:
            # Parked rows are fed the first live row's token; their logits are dropped.
            live = dict(zip(self.slots, range(B), strict=True))
            source = [live.get(p, 0) for p in range(self.width)]
            feed = inputs[mx.array(source, mx.int32)]
            if adapters is not None:
                adapters = [adapters[live[p]] if p in live else None for p in range(self.width)]
        logits = self.model.forward(feed[:, None], self.caches, adapters=adapters)
        logits = logits[:, -1, :]
        if self.width != B:
            logits = logits[mx.array(self.slots, mx.int32)]
        if not self.stacked:
            rows[0].request.kv.apply(self.caches)
        failed: dict[int, BaseException] = {}
        pickers = [row.picker for row in rows]
        for j, picker in enumerate(pickers):
            if self.emit[j]:  # the token fed now was generated: the history takes it
                picker.note(inputs[j : j + 1])
        logits = process_batch(pickers, logits, failed)
        if any(row.constraint is not None for row in rows):
            # The forward runs while the masks are computed; each mask needs
            # its row's newest token, so the current tokens are read here.
            mx.async_eval(logits)
            fed: list[int] = inputs.tolist()  # type: ignore[assignment]
            logits = constrain_rows(
                [row.constraint for row in rows],
                [fed[j] if self.emit[j] else None for j in range(B)],
                logits,
                failed,
            )
        logprobs = log_probs(self.model, logits)
        tokens = sample_batch(pickers, logprobs, failed)
        chosen = mx.take_along_axis(logprobs, tokens[:, None].astype(mx.int32), axis=-1)[:, 0]
        extras = []
        for j, row in enumerate(rows):
            k = row.request.params.logprobs
            row_lp = logprobs if B == 1 else logprobs[j : j + 1]
            extras.append(
                _Extras(
                    top=logprobs_top_k(row_lp, k) if k else None,
                    vector=(row_lp[0] if B == 1 else mx.contiguous(row_lp[0]))
                    if row.request.logprobs_vector
                    else None,
                )
            )
        pending: list[Any] = [tokens, logprobs, chosen]
        for e in extras:
            if e.top is not None:
                pending.extend(e.top)
            if e.vector is not None:
                pending.append(e.vector)
        pending.extend(p.history for p in pickers if p.history is not None)
        mx.async_eval(*pending)
        self.tokens, self.chosen, self.extras = tokens, chosen, extras
        self.emit = [True] * B
        return failed


def _into(row: Row, caches: list[Any]) -> list[Any]:
    """Caches for a row that decodes alone again: into its caller's list, if it brought one."""
    own = row.request.cache
    if own is None:
        return caches
    own[:] = caches
    return own
