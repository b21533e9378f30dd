"""The continuous-batching engine: insert requests, remove them, step.

Shaped like mlx-lm's ``BatchGenerator``. :meth:`Engine.insert` queues
requests, :meth:`Engine.remove` takes them out (cancellation), and each
:meth:`Engine.step` does one round of work and returns what it produced:

1. one decode step of every decode group (:mod:`mlx_loom.engine.group`),
   each pipelined with ``mx.async_eval`` so the next step computes while
   the current tokens are handed out; a speculative request's group
   (:mod:`mlx_loom.engine.speculative`) drafts and verifies a window in its
   step and hands out every token it accepted;
2. admission: waiting requests take free rows (at most
   ``decode_concurrency`` requests decode or prefill at once, at most
   ``prompt_concurrency`` prefill), reusing the longest usable prefix from
   the shared prefix store;
3. one prefill chunk (``prefill_step_size`` tokens) of every prompt being
   prefilled (:mod:`mlx_loom.engine.prefill`), so a long prompt arriving
   delays the running streams by one chunk per step, never by its whole
   prefill, and its caches come out exactly as a lone prefill makes them;
4. regrouping: a row whose prompt is done joins the decode group its caches
   can be stacked with.

Requests join and leave only between steps. A row that finishes or is
removed leaves its group at once (its cache rows are dropped and their
memory freed when the arrays go), and its caches go back to the prefix store.

An :class:`Engine` is not thread-safe: one thread drives it.
:class:`~mlx_loom.engine.service.EngineService` is that thread for a model.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx

from mlx_loom.capabilities import BATCH
from mlx_loom.engine.caches import fresh_caches
from mlx_loom.engine.events import Done, Event
from mlx_loom.engine.group import DecodeGroup, Left
from mlx_loom.engine.prefill import prefill_step
from mlx_loom.engine.prefix import PrefixStore
from mlx_loom.engine.request import Request
from mlx_loom.engine.row import Row
from mlx_loom.engine.settings import EngineSettings
from mlx_loom.engine.speculative import SpeculativeGroup
from mlx_loom.errors import LoomError, RequestError
from mlx_loom.streams import generation_stream

if TYPE_CHECKING:
    from mlx_loom.model import Model

log = logging.getLogger("mlx_loom.engine")


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of an engine: what waits, what runs, and what it has done."""

    waiting: int = 0
    prefilling: int = 0
    decoding: int = 0
    groups: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    generated_tokens: int = 0
    steps: int = 0
    #: The most requests that were ever decoding in one step.
    peak_decoding: int = 0
    prefix_entries: int = 0
    prefix_bytes: int = 0
    prefix_hits: int = 0
    #: Speculative decoding: draft tokens proposed, and how many the target accepted.
    draft_tokens: int = 0
    accepted_drafts: int = 0

    @property
    def active(self) -> int:
        return self.prefilling + self.decoding

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted share of the draft tokens proposed (``None`` before any was)."""
        return self.accepted_drafts / self.draft_tokens if self.draft_tokens else None


class Engine:
    """Continuous batching over one model (see the module docstring)."""

    def __init__(self, model: Model, settings: EngineSettings | None = None) -> None:
        self.model = model
        self.settings = settings or EngineSettings()
        self._uids = itertools.count()
        self._waiting: deque[Row] = deque()
        self._prefilling: list[Row] = []
        self._groups: list[DecodeGroup | SpeculativeGroup] = []
        self.store = PrefixStore(self.settings.prompt_cache_size, self.settings.prompt_cache_bytes)
        self._batchable = BATCH in model.capabilities
        self._counts = dict(
            completed=0,
            cancelled=0,
            failed=0,
            generated_tokens=0,
            steps=0,
            draft_tokens=0,
            accepted_drafts=0,
        )
        self._peak = 0

    # --- configuration --------------------------------------------------------

    def configure(self, settings: EngineSettings) -> None:
        """New scheduling settings, taking effect from the next step."""
        self.settings = settings
        self.store.resize(settings.prompt_cache_size, settings.prompt_cache_bytes)

    # --- the BatchGenerator-shaped API ------------------------------------------

    def insert(self, requests: Sequence[Request]) -> list[int]:
        """Queue ``requests``; return their uids, in order."""
        uids = []
        for request in requests:
            if not isinstance(request, Request):
                raise RequestError(
                    f"Engine.insert takes Request objects; got {type(request).__name__}.",
                    fix="Build requests with mlx_loom.engine.make_request(...).",
                )
            uid = next(self._uids)
            self._waiting.append(Row(uid, request, to_feed=list(request.prompt), cached=0))
            uids.append(uid)
        return uids

    def remove(self, uids: Sequence[int]) -> list[Done]:
        """Take requests out now, wherever they are; return their outcomes."""
        out = []
        for uid in uids:
            done = self._remove(uid)
            if done is not None:
                out.append(done)
        return out

    def _remove(self, uid: int) -> Done | None:
        for row in self._waiting:
            if row.uid == uid:
                self._waiting.remove(row)
                self._counts["cancelled"] += 1
                return Done(uid, "cancelled", caches=row.request.cache)
        for row in self._prefilling:
            if row.uid == uid:
                self._prefilling.remove(row)
                return self._leave(Left(row, row.caches), "cancelled")
        for group in self._groups:
            left = group.remove(uid)
            if left is not None:
                if not group.rows:
                    self._groups.remove(group)
                return self._leave(left, "cancelled")
        return None

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._prefilling or self._groups)

    def stats(self) -> EngineStats:
        decoding = sum(len(g) for g in self._groups)
        store = self.store.stats()
        return EngineStats(
            waiting=len(self._waiting),
            prefilling=len(self._prefilling),
            decoding=decoding,
            groups=len(self._groups),
            peak_decoding=self._peak,
            prefix_entries=store.entries,
            prefix_bytes=store.nbytes,
            prefix_hits=store.hits,
            **self._counts,
        )

    def step(self) -> list[Event]:
        """One round of work (see the module docstring); the events it produced."""
        events: list[Event] = []
        with mx.stream(generation_stream()):
            self._decode(events)
            self._admit(events)
            self._prefill(events)
            self._regroup()
        self._counts["steps"] += 1
        if self._counts["steps"] % 256 == 0:
            mx.clear_cache()
        return events

    # --- the parts of a step ----------------------------------------------------

    def _decode(self, events: list[Event]) -> None:
        self._peak = max(self._peak, sum(len(g) for g in self._groups))
        for group in list(self._groups):
            try:
                result = group.step()
            except BaseException as err:  # a plugin or user callable may raise anything
                self._groups.remove(group)
                for row in group.rows:
                    events.append(self._leave(Left(row, None, _typed(err)), "failed"))
                continue
            events.extend(result.events)
            self._counts["generated_tokens"] += len(result.events)
            self._counts["draft_tokens"] += result.drafted
            self._counts["accepted_drafts"] += result.accepted
            for left in result.left:
                outcome = "failed" if left.error is not None else "finished"
                events.append(self._leave(left, outcome))
            if not group.rows:
                self._groups.remove(group)

    def _admit(self, events: list[Event]) -> None:
        s = self.settings
        active = len(self._prefilling) + sum(len(g) for g in self._groups)
        while (
            self._waiting
            and active < s.decode_concurrency
            and len(self._prefilling) < s.prompt_concurrency
        ):
            row = self._waiting.popleft()
            try:
                self._start(row)
            except BaseException as err:  # a plugin or user callable may raise anything
                events.append(self._leave(Left(row, None, _typed(err)), "failed"))
                continue
            active += 1

    def _start(self, row: Row) -> None:
        request = row.request
        if request.sampler is not None and request.params.seed is not None:
            # A custom sampler (mlx-lm's) draws from MLX's global generator,
            # which is per thread: seed this thread's, as mlx-lm's user would
            # call mx.random.seed(seed) before generating.
            mx.random.seed(request.params.seed)
        if request.cache is not None:
            row.caches = request.cache
            row.cached = len(request.history)
        else:
            key = self._store_key(request)
            hit = self.store.fetch(key, request.prompt) if self.store.max_entries else None
            if hit is not None:
                row.caches, row.cached = hit
                row.to_feed = list(request.prompt[row.cached :])
            else:
                row.caches = fresh_caches(self.model, request.max_kv_size)
        if row.prefill_left > 0:
            self._prefilling.append(row)
        else:
            self._groups.append(self._group(row))

    def _group(self, row: Row) -> DecodeGroup | SpeculativeGroup:
        """The decode group a row whose prompt is in its caches starts in."""
        assert row.caches is not None
        if row.request.speculation is not None:
            step = row.request.prefill_step_size or self.settings.prefill_step_size
            return SpeculativeGroup(self.model, row, row.caches, step)
        return DecodeGroup(self.model, row, row.caches)

    def _prefill(self, events: list[Event]) -> None:
        rows = self._prefilling[: self.settings.prompt_concurrency]
        if not rows:
            return
        steps = [r.request.prefill_step_size or self.settings.prefill_step_size for r in rows]
        failed = prefill_step(self.model, rows, steps, self._batchable)
        for row in rows:
            if row.uid in failed:
                self._prefilling.remove(row)
                events.append(self._leave(Left(row, None, _typed(failed[row.uid])), "failed"))
            elif row.prefill_left == 0:
                self._prefilling.remove(row)
                try:
                    self._groups.append(self._group(row))
                except BaseException as err:  # a draft model may raise anything
                    events.append(self._leave(Left(row, None, _typed(err)), "failed"))

    def _regroup(self) -> None:
        """Merge groups whose caches can share a batch (a model with the batch capability)."""
        if not self._batchable or len(self._groups) < 2:
            return
        by_key: dict[Hashable, list[DecodeGroup]] = {}
        for group in self._groups:
            key = group.key
            if key is not None:
                by_key.setdefault(key, []).append(group)
        for groups in by_key.values():
            if len(groups) < 2:
                continue
            # A running batch takes the newcomers in, so its caches grow in place.
            home = next((g for g in groups if g.stacked), groups[0])
            others = [g for g in groups if g is not home]
            home.absorb(others)
            self._groups = [g for g in self._groups if g not in others]

    # --- leaving ------------------------------------------------------------------

    def _store_key(self, request: Request) -> Hashable:
        kv = request.kv
        # A prefix computed with one adapter is not another's (nor the base model's),
        # and one stored in one KV codec is not another's.
        return (request.max_kv_size, kv.codec, kv.bits, kv.group_size, kv.start, request.adapter)

    def _leave(self, left: Left, outcome: str) -> Done:
        row, request = left.row, left.row.request
        self._counts[{"finished": "completed"}.get(outcome, outcome)] += 1
        caches = left.caches
        if outcome == "failed":
            # The caches may hold a half-written step: nothing of them is kept.
            if request.cache is not None:
                request.cache[:] = fresh_caches(self.model, request.max_kv_size)
            return Done(row.uid, "failed", error=left.error, fed=())
        if caches is not None and request.cache is not None:
            if caches is not request.cache:
                request.cache[:] = caches
            caches = request.cache
            # The caller's thread may save these caches, or a later engine
            # thread continue them: no lazy graph of this thread may remain.
            mx.eval([c.state for c in caches])
        elif caches is not None and self.store.max_entries and row.fed:
            held = [*request.prompt[: row.cached], *row.fed]
            try:
                self.store.insert(self._store_key(request), held, caches)
            except LoomError:
                log.exception("could not keep a prompt cache")
        return Done(row.uid, outcome, caches=caches, fed=tuple(row.fed))  # type: ignore[arg-type]


def _typed(err: BaseException) -> BaseException:
    """A clearer error for the one MLX failure callers can cause from another thread."""
    if isinstance(err, RuntimeError) and "There is no Stream(" in str(err):
        return RequestError(
            f"Generation touched an MLX array built on another thread ({err}).",
            fix="Evaluate arrays before handing them to the engine (mx.eval), e.g. those a "
            "custom sampler or logits processor captures, or load the model without lazy=True.",
        )
    return err
