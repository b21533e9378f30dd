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
   ``prompt_concurrency`` prefill, and with ``max_kv_bytes`` set only while
   their caches fit the KV byte budget, :mod:`mlx_loom.engine.kv_budget`),
   reusing the longest usable prefix from the shared prefix store;
3. one prefill chunk (``prefill_step_size`` tokens) of every prompt being
   prefilled (:mod:`mlx_loom.engine.prefill`), so a long prompt arriving
   delays the running streams by one chunk per step, never by its whole
   prefill, and its caches come out exactly as a lone prefill makes them;
   while rows decode, only as many chunks as fit ``prefill_token_budget``
   tokens (first come, first served; at least one), so that a burst of long
   prompts does not put all their chunks between two tokens of a stream;
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
from mlx_loom.engine.disk import DiskTier
from mlx_loom.engine.events import Done, Event
from mlx_loom.engine.group import DecodeGroup, Left
from mlx_loom.engine.kv_budget import KVBudget, check_kv_budget
from mlx_loom.engine.prefill import prefill_step
from mlx_loom.engine.prefix import MAX_CHECKPOINTS_PER_ENTRY, PrefixStore, take_checkpoint
from mlx_loom.engine.request import Request
from mlx_loom.engine.row import Row
from mlx_loom.engine.settings import EngineSettings, prefill_step_for
from mlx_loom.engine.splits import ends_chunk, takes_checkpoint
from mlx_loom.engine.speculative import SpeculativeGroup
from mlx_loom.errors import CapabilityRefused, LoomError, RequestError
from mlx_loom.model import check_token_ids
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
    prefix_misses: int = 0
    #: Checkpoints of caches that cannot trim (part of ``prefix_bytes``).
    prefix_checkpoints: int = 0
    prefix_checkpoint_bytes: int = 0
    prefix_checkpoint_hits: int = 0
    #: The prefix store's disk tier.
    prefix_disk_bytes: int = 0
    prefix_disk_files: int = 0
    prefix_disk_hits: int = 0
    #: The KV byte budget (``max_kv_bytes``): bytes reserved by the running
    #: requests, and the budget (``None``: no byte bound).
    kv_bytes_reserved: int = 0
    max_kv_bytes: int | None = None
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
        self.store = PrefixStore(
            self.settings.prompt_cache_size, self.settings.prompt_cache_bytes, self._disk()
        )
        self._batchable = BATCH in model.capabilities
        check_kv_budget(model, self.settings.max_kv_bytes)
        self.kv_budget = KVBudget(model, self.settings.max_kv_bytes)
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
        old, self.settings = self.settings, settings
        if (old.prompt_cache_dir, old.prompt_cache_disk_bytes) != (
            settings.prompt_cache_dir,
            settings.prompt_cache_disk_bytes,
        ):
            self.flush()
            try:
                self.store.disk = self._disk()
            except LoomError:  # the service checked the directory; it changed since
                log.exception("the prompt-cache directory cannot be used; keeping none")
                self.store.disk = None
        self.store.resize(settings.prompt_cache_size, settings.prompt_cache_bytes)
        # Running rows keep their reservations; the new bound applies to admissions.
        self.kv_budget.max_bytes = settings.max_kv_bytes

    def _disk(self) -> DiskTier | None:
        s = self.settings
        if s.prompt_cache_dir is None:
            return None
        if self.model.parallel is not None:
            # Each rank holds its own part of every cache; one directory would mix them.
            raise CapabilityRefused(
                "A prompt-cache directory is not supported for a model split across ranks.",
                fix="Drop --prompt-cache-dir (prompt_cache_dir) for a split model.",
            )
        return DiskTier(s.prompt_cache_dir, s.prompt_cache_disk_bytes, self.model)

    def flush(self) -> None:
        """Write the prefix store's entries to its disk tier (when the engine stops)."""
        try:
            self.store.flush()
        except Exception:  # never let a full disk stop a shutdown
            log.exception("could not write the prompt caches to disk")

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
            # The one check every engine door passes (a Request can be built by hand);
            # the engine's forwards skip it after this (Model.forward).
            check_token_ids(request.prompt, self.model.vocab_size)
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
            prefix_misses=store.misses,
            prefix_checkpoints=store.checkpoints,
            prefix_checkpoint_bytes=store.checkpoint_bytes,
            prefix_checkpoint_hits=store.checkpoint_hits,
            prefix_disk_bytes=store.disk_bytes,
            prefix_disk_files=store.disk_files,
            prefix_disk_hits=store.disk_hits,
            kv_bytes_reserved=self.kv_budget.reserved,
            max_kv_bytes=self.kv_budget.max_bytes,
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
            row = self._waiting[0]
            try:
                cost = self.kv_budget.cost(row.request, self._step(row.request))
                self.kv_budget.check_alone(cost)
            except BaseException as err:  # the probe runs the plugin's graph
                self._waiting.popleft()
                events.append(self._leave(Left(row, None, _typed(err)), "failed"))
                continue
            if not self.kv_budget.fits(cost):
                break  # the head waits for bytes; those behind it wait their turn
            self._waiting.popleft()
            row.kv_bytes = cost
            self.kv_budget.reserved += cost
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
            if request.checkpoints:
                row.aligned = request.eos
        else:
            row.aligned = request.eos
            step = self._step(request)
            hit = None
            if self.store.max_entries:
                hit = self.store.find(
                    self._store_key(request),
                    request.prompt,
                    lambda p: ends_chunk(request.prompt, p, step, request.eos),
                )
            if hit is not None:
                row.caches, row.cached, row.exact = hit.caches, hit.reused, hit.from_checkpoint
                row.checkpoints = list(hit.earlier)
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
            return SpeculativeGroup(self.model, row, row.caches, self._step(row.request))
        return DecodeGroup(self.model, row, row.caches)

    def _step(self, request: Request) -> int:
        """The request's prefill chunk: its own, else the engine's, else the model's default."""
        kernels = self.model.cpu_path.kernel_set if self.model.cpu_path is not None else None
        return (
            request.prefill_step_size
            or self.settings.prefill_step_size
            or prefill_step_for(kernels)
        )

    def _prefill(self, events: list[Event]) -> None:
        rows = self._prefilling[: self.settings.prompt_concurrency]
        if not rows:
            return
        steps = [self._step(r.request) for r in rows]
        budget = self.settings.prefill_token_budget
        if budget and self._groups:
            rows, steps = within_budget(rows, steps, budget)
        failed = prefill_step(self.model, rows, steps, self._batchable)
        for row, step in zip(rows, steps, strict=True):
            if row.uid in failed:
                self._prefilling.remove(row)
                events.append(self._leave(Left(row, None, _typed(failed[row.uid])), "failed"))
                continue
            self._checkpoint(row, step)
            if row.prefill_left == 0:
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

    def _checkpoint(self, row: Row, step: int) -> None:
        """Keep the row's caches at this position if the prefix store wants them here.

        Only rows whose caches are exact (a fresh start or a restored
        checkpoint) and whose chunks follow the prompt's own grid take them.
        """
        request = row.request
        if row.aligned is None or not row.exact:
            return
        if request.cache is None and not self.store.max_entries:
            return
        # A caller's own caches (a PromptCache) keep turn boundaries and the prompt's end.
        every = self.settings.checkpoint_chunks if request.cache is None else 0
        if takes_checkpoint(request.prompt, row.prompt_position, step, request.eos, every):
            assert row.caches is not None
            row.checkpoints.append(take_checkpoint(row.position, row.caches))
            # A long history of short messages must not hold a state per message.
            del row.checkpoints[:-MAX_CHECKPOINTS_PER_ENTRY]

    # --- leaving ------------------------------------------------------------------

    def _store_key(self, request: Request) -> Hashable:
        kv = request.kv
        # A prefix computed with one adapter is not another's (nor the base model's),
        # and one stored in one KV codec is not another's; checkpoints sit on the
        # grid of one prefill step.
        return (
            request.max_kv_size,
            kv.codec,
            kv.bits,
            kv.group_size,
            kv.start,
            request.adapter,
            self._step(request),
        )

    def _leave(self, left: Left, outcome: str) -> Done:
        row, request = left.row, left.row.request
        self._counts[{"finished": "completed"}.get(outcome, outcome)] += 1
        self.kv_budget.reserved -= row.kv_bytes  # every running row leaves through here
        row.kv_bytes = 0
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
                self.store.insert(self._store_key(request), held, caches, row.checkpoints)
            except LoomError:
                log.exception("could not keep a prompt cache")
        taken = tuple(row.checkpoints) if request.cache is not None else ()
        return Done(
            row.uid,
            outcome,  # type: ignore[arg-type]
            caches=caches,
            fed=tuple(row.fed),
            checkpoints=taken,
        )


def within_budget(rows: list[Row], steps: list[int], budget: int) -> tuple[list[Row], list[int]]:
    """The rows (and their steps) whose next chunks this step prefills while rows decode.

    In order of arrival, each row whose whole next chunk still fits the
    ``budget`` of prompt tokens; the first row always, so that a chunk larger
    than the budget still advances. Chunks are never cut: a prompt's chunk
    grid is what makes its caches equal a lone prefill's.
    """
    chosen, taken, used = [rows[0]], [steps[0]], rows[0].chunk_len(steps[0])
    for row, step in zip(rows[1:], steps[1:], strict=True):
        n = row.chunk_len(step)
        if used + n <= budget:
            chosen.append(row)
            taken.append(step)
            used += n
    return chosen, taken


def _typed(err: BaseException) -> BaseException:
    """A clearer error for the one MLX failure callers can cause from another thread."""
    if isinstance(err, RuntimeError) and "There is no Stream(" in str(err):
        return RequestError(
            f"Generation touched an MLX array built on another thread ({err}).",
            fix="Evaluate arrays before handing them to the engine (mx.eval), e.g. those a "
            "custom sampler or logits processor captures, or load the model without lazy=True.",
        )
    return err
