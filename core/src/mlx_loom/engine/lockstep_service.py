"""A split model's engine: rank 0 decides every turn, every rank runs it.

Each rank of a split model runs its own continuous-batching engine
(:mod:`mlx_loom.engine`), and every forward's collectives wait for every
rank, so the engines must do the same work in the same order: the same
requests joining at the same step, leaving at the same step, sampled with
the same seeds. What a step computes follows from that (every rank holds the
same logits, so tokens and stop conditions agree); *when* requests join and
leave does not — it is the timing of caller threads, of clients going away,
and of a first request waiting for a burst — so rank 0 decides it.

Each turn of rank 0's engine thread announces the operations it takes before
stepping: requests submitted (with the seed each samples from, and for
``loom serve`` a plain description the other ranks build the same request
from), cancellations, settings, values rank 0 shares with its peers, and the
stop. Every rank then applies them in that order and steps. The other ranks
never act on their own timing: a request their callers submit waits for rank
0's matching submission (the Python API's rule: every rank makes the same
calls in the same order), and a cancellation of theirs is ignored — the
request ends when rank 0's does.

Every collective of a split model's generations runs on this one thread per rank
(forwards, messages, the prefix store's agreement), in this order, so no two
can interleave. Callers share values through :meth:`LockstepService.share`
and :meth:`LockstepService.gather`, never through the group directly.

When the engine runs dry, rank 0 says whether the threads park (leave, to
start again on the next call) — every rank's thread does the same. That
keeps a caller's own collectives (a forward it evaluates, another split
model's load) from meeting a thread that waits in one; the decision comes
before the turn's last events are handed out, so no caller is released
while its thread still exchanges. A server (``idle_seconds=None``) never
parks, and neither do the ranks following it: they wait for rank 0's next
announcement.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from mlx_loom.device import wired_limit
from mlx_loom.engine.core import Engine
from mlx_loom.engine.events import Done, Event
from mlx_loom.engine.prefix import PrefixStore
from mlx_loom.engine.request import Request
from mlx_loom.engine.service import EngineService, Handle, Sink, Turns
from mlx_loom.engine.settings import EngineSettings
from mlx_loom.errors import EngineStopped, LoomError, ParallelRefused, RequestError
from mlx_loom.parallel.lockstep import Lockstep
from mlx_loom.streams import generation_stream

if TYPE_CHECKING:
    from mlx_loom.model import Model

__all__ = ["AgreeingPrefixStore", "LockstepService", "LockstepTurns"]

log = logging.getLogger("mlx_loom.parallel")

#: Builds a request from the plain description rank 0 announced (``loom serve``).
Builder = Callable[[Any], Request]


class _Shared:
    """A caller waiting for a value the engine thread exchanges with the other ranks."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.result: Any = None
        self.error: BaseException | None = None
        self._ready = threading.Event()

    def resolve(self, result: Any = None, error: BaseException | None = None) -> None:
        self.result, self.error = result, error
        self._ready.set()

    def wait(self) -> Any:
        self._ready.wait()
        if self.error is not None:
            raise self.error
        return self.result


def _discard(event: Event) -> None:
    """The sink of a request this rank runs only to keep step (``loom serve``'s followers)."""


class AgreeingPrefixStore(PrefixStore):
    """The prefix store, with what decides reuse agreed across the ranks.

    Whether an entry can serve a shorter prompt (every cache trims) and how
    many bytes it holds are per-rank facts — a pipeline stage may hold only
    attention layers, or more layers than another — but reuse decides how
    many prompt tokens each rank feeds, which must be the same everywhere.
    So an entry counts as trimmable only if it is on every rank, and weighs
    what the largest rank's part weighs. Insertions happen at the same point
    of the same step on every rank, so this exchange is in step too.
    """

    def __init__(self, lockstep: Lockstep, max_entries: int, max_bytes: int | None) -> None:
        super().__init__(max_entries, max_bytes)
        self._lockstep = lockstep

    def measure(self, caches: Sequence[Any]) -> tuple[int, bool]:
        nbytes, trimmable = super().measure(caches)
        every = self._lockstep.gather([float(nbytes), float(trimmable)])
        return int(max(n for n, _ in every)), all(t == 1.0 for _, t in every)

    def weigh(self, nbytes: int) -> int:
        # A stage may hold no layer that checkpoints: weigh the largest rank's part.
        return int(max(n for (n,) in self._lockstep.gather([float(nbytes)])))


class LockstepTurns(Turns):
    """The turns of one rank of a split model's engine thread (see the module docstring).

    The policy :class:`LockstepService` gives its :class:`EngineService`:
    rank 0 plans each turn and announces it, every rank applies it.
    """

    def __init__(self, lockstep: Lockstep) -> None:
        self.lockstep = lockstep
        self.builder: Builder | None = None
        self._seq = 0  # submissions announced so far, numbering them on every rank
        self._uids: dict[int, int] = {}  # announced number -> engine uid
        self._specs: dict[int, Any] = {}  # id(request) -> its description, until announced
        self._local: dict[str, deque[Any]] = {"submit": deque(), "share": deque()}
        self._pending: set[_Shared] = set()  # exchanges posted, not yet resolved
        self.failure: BaseException | None = None
        self._live: dict[int, Handle] = {}  # running requests, kept across parked threads

    @property
    def leader(self) -> bool:
        return self.lockstep.leader

    # --- any thread ---------------------------------------------------------------

    def describe(self, request: Request, spec: Any) -> None:
        """Remember ``spec``, the plain description rank 0 announces ``request`` with."""
        with self.service._lock:
            self._specs[id(request)] = spec

    def forget(self, request: Request) -> None:
        with self.service._lock:
            self._specs.pop(id(request), None)

    def admit(self, command: tuple[str, Any]) -> bool:
        kind, item = command
        if not self.leader and kind in ("cancel", "configure"):
            return False  # rank 0's cancellations and settings are the ones every rank applies
        if kind == "cancel" and item.done is not None:
            # Already over (its reader saw the end before the engine marked it done):
            # a cancel must not restart a parked thread, which would wait alone.
            return False
        return True

    def exchange(self, value: Any) -> Any:
        service = self.service
        shared = _Shared(value)
        with service._lock:
            if service._thread is threading.current_thread():
                raise RequestError(
                    "The engine thread cannot wait for its own exchange.",
                    fix="Share values from the caller's thread.",
                )
            if service._closed:
                raise EngineStopped(
                    "The model's generation engine has been shut down.",
                    fix="Load the model again to generate.",
                )
            self._pending.add(shared)
            service._inbox.put(("share", shared))
            service._ensure_thread()
        try:
            return shared.wait()
        finally:
            with service._lock:
                self._pending.discard(shared)

    # --- the engine thread ------------------------------------------------------------

    def new_engine(self) -> Engine:
        service = self.service
        settings = service.settings
        engine = Engine(service.model, settings)
        engine.store = AgreeingPrefixStore(
            self.lockstep, settings.prompt_cache_size, settings.prompt_cache_bytes
        )
        return engine

    def run(self) -> None:
        service = self.service
        # A thread started while the last one parks waits for it: one thread at a
        # time runs this rank's collectives.
        me = threading.current_thread()
        for thread in [t for t in service._threads if t is not me]:
            thread.join()
        handles = self._live
        parked = False
        try:
            # Custom samplers draw from this thread's global generator: alike everywhere.
            mx.random.seed(self.lockstep.share_int(secrets.randbits(63)))
            # Metal: the model's memory stays wired while this thread generates.
            with wired_limit(service.model.module, generation_stream()):
                while True:
                    outcome = self.turn(handles)
                    if outcome == "park":
                        parked = True
                        break
                    if outcome == "stop":
                        break
        except BaseException as err:  # follow() raises it; mlx.launch tells the other ranks
            log.exception("a split model's engine failed; this rank cannot stay in step")
            self.failure = err
        finally:
            if not parked:
                self._fail_everything(self.failure)
            mx.synchronize()
            mx.clear_streams()

    def _fail_everything(self, failure: BaseException | None) -> None:
        service = self.service
        stopped: BaseException = EngineStopped(
            "The generation engine stopped before this request finished.",
            fix="Generate again (load the model again if it was closed).",
        )
        if isinstance(failure, LoomError):
            stopped = failure
        with service._lock:
            service._closed = True
            service._thread = None
            leftover = []
            while not service._inbox.empty():
                leftover.append(service._inbox.get_nowait())
            pending = [*self._pending, *self._local["share"]]
            local = list(self._local["submit"])
            self._local["share"].clear()
            self._local["submit"].clear()
        for uid, handle in list(self._live.items()):
            handle._deliver(Done(uid, "failed", error=stopped))
        self._live.clear()
        for kind, item in leftover:
            if kind == "submit":
                local.append(item)
            elif kind == "share":
                pending.append(item)
        for handle in local:
            handle._deliver(Done(-1, "failed", error=stopped))
        for shared in pending:
            shared.resolve(error=stopped)

    def turn(self, handles: dict[int, Handle]) -> str:
        """One turn: agree on the operations, apply them, step; "go", "park" or "stop"."""
        service = self.service
        if self.leader:
            ops, items = self._plan()
            self.lockstep.share_list(ops)
        else:
            ops = self.lockstep.share_list()
            items = [None] * len(ops)
        for op, item in zip(ops, items, strict=True):
            if not self._apply(op, item, handles):
                with service._lock:
                    service._stats = service._engine.stats()
                return "stop"
        events: list[Event] = []
        if service._engine.has_work:
            try:
                events = service._engine.step()
            except BaseException as err:  # an engine bug: fail what runs, keep serving
                events = [Done(uid, "failed", error=err) for uid in handles]
                service._engine = self.new_engine()
        outcome = "go" if service._engine.has_work else self._idle()
        self._dispatch(events, handles)
        with service._lock:
            service._stats = service._engine.stats()
        return outcome

    def _idle(self) -> str:
        """Idle after this turn (alike on every rank): rank 0 says whether the threads park.

        They park — leave, to restart on the next command — so that nothing
        waits in a collective while the program runs other collectives (a
        forward called directly, another split model's load). Decided before
        this turn's last events are handed out, so that no caller is released
        while this thread still exchanges. A server (``idle_seconds=None``)
        never parks; neither do the ranks following it.
        """
        service = self.service
        if self.leader:
            with service._lock:
                park = service.settings.idle_seconds is not None and service._inbox.empty()
                if park:
                    service._thread = None
            self.lockstep.share_int(int(park))
            return "park" if park else "go"
        park = bool(self.lockstep.share_int())
        if not park or self.builder is not None:
            return "go"  # a server's follower listens on (it has nothing else to do)
        with service._lock:
            service._thread = None
            if not service._inbox.empty() or any(self._local.values()):
                service._ensure_thread()  # its callers already asked for more
        return "park"

    def _plan(self) -> tuple[list[Any], list[Any]]:
        """Rank 0: this turn's commands, as operations to announce and the items behind them."""
        service = self.service
        commands: list[tuple[str, Any]] = []
        idle = not service._engine.has_work
        if idle:
            commands.append(service._inbox.get())
        service._drain(commands, gather=idle)
        ops: list[Any] = []
        items: list[Any] = []
        for kind, item in commands:
            if kind == "stop":
                ops.append(["stop"])
                items.append(None)
                break
            if kind == "configure":
                ops.append(["configure", item.model_dump()])
                items.append(None)
            elif kind == "submit":
                item.seq = self._seq
                self._seq += 1
                with service._lock:
                    spec = self._specs.pop(id(item.request), None)
                ops.append(["submit", spec, _seed_for(item.request)])
                items.append(item)
                if item.cancelled:
                    ops.append(["cancel", item.seq])
                    items.append(None)
            elif kind == "cancel" and getattr(item, "seq", None) is not None:
                ops.append(["cancel", item.seq])
                items.append(None)
            elif kind == "share":
                ops.append(["share", item.value])
                items.append(item)
        return ops, items

    def _apply(self, op: list[Any], item: Any, handles: dict[int, Handle]) -> bool:
        """Apply one announced operation, as every rank does; False to stop."""
        service = self.service
        kind = op[0]
        if kind == "stop":
            return False
        if kind == "configure":
            service._settings = EngineSettings(**op[1])
            service._engine.configure(service._settings)
        elif kind == "submit":
            _, spec, seed = op
            if item is None:
                item = self._follow_submit(spec)
            else:
                self._taken()
            request = item.request
            if seed is not None:
                request = dataclasses.replace(
                    request, params=request.params.model_copy(update={"seed": seed})
                )
            (uid,) = service._engine.insert([request])
            item.uid = uid
            handles[uid] = item
            self._uids[item.seq] = uid
        elif kind == "cancel":
            cancelled = self._uids.get(op[1])
            if cancelled is not None:
                self._dispatch(service._engine.remove([cancelled]), handles)
        elif kind == "share":
            value = op[1]
            if item is None:
                item = self._next_local("share")
            if isinstance(value, dict) and "gather" in value:
                item.resolve(self.lockstep.gather(item.value["gather"]))
            else:
                item.resolve(value)
        return True

    def _taken(self) -> None:
        with self.service._lock:
            self.service._submitted -= 1

    def _follow_submit(self, spec: Any) -> Handle:
        """A follower's request for rank 0's submission: built from ``spec``, or its own."""
        if spec is None:
            handle = self._next_local("submit")
            self._taken()
        else:
            if self.builder is None:
                raise ParallelRefused(
                    "Rank 0 submitted a server request, but this rank is not following a "
                    "server (its program differs from rank 0's).",
                    fix="Run the same command on every rank (loom serve --parallel ...).",
                )
            handle = Handle(self.service, self.builder(spec), _discard)
        handle.seq = self._seq  # type: ignore[attr-defined]
        self._seq += 1
        return handle

    def _next_local(self, kind: str) -> Any:
        """A follower: its own next ``kind`` item, waiting for its caller to post it.

        The follower's own cancellations, settings and stop are dropped: rank
        0's decide.
        """
        while not self._local[kind]:
            other, item = self.service._inbox.get()
            if other in self._local:
                self._local[other].append(item)
        return self._local[kind].popleft()

    def _dispatch(self, events: Sequence[Event], handles: dict[int, Handle]) -> None:
        for event in events:
            if isinstance(event, Done):
                seq = getattr(handles.get(event.uid), "seq", None)
                if seq is not None:
                    self._uids.pop(seq, None)
        self.service._dispatch(events, handles)


class LockstepService(EngineService):
    """The engine service of one rank of a split model: its turns are :class:`LockstepTurns`.

    Adds what callers of a split model need — describing a server's
    requests to the other ranks, sharing values, following rank 0 — to the
    engine service's public methods; how the thread runs is all the policy's.
    """

    turns: LockstepTurns

    def __init__(self, model: Model, settings: EngineSettings | None = None) -> None:
        assert model.parallel is not None
        super().__init__(model, settings, turns=LockstepTurns(model.parallel.lockstep()))

    @property
    def leader(self) -> bool:
        return self.turns.leader

    def submit(self, request: Request, *, sink: Sink | None = None, spec: Any = None) -> Handle:
        """Queue ``request``; on rank 0, ``spec`` lets the other ranks build it themselves."""
        if spec is not None:
            self.turns.describe(request, spec)
        try:
            return super().submit(request, sink=sink)
        except BaseException:
            self.turns.forget(request)
            raise

    def share(self, value: Any = None) -> Any:
        """Rank 0's JSON ``value`` on every rank, exchanged in turn by the engine thread."""
        return self.turns.exchange(value)

    def gather(self, values: list[float]) -> list[list[float]]:
        """Every rank's ``values`` (the same length everywhere), in rank order."""
        result: list[list[float]] = self.turns.exchange({"gather": values})
        return result

    def follow(self, builder: Builder) -> None:
        """Run rank 0's requests, built with ``builder``, until rank 0 stops (followers)."""
        if self.leader:
            raise RuntimeError("rank 0 leads; only the other ranks follow")
        self.turns.builder = builder
        with self._lock:
            self._ensure_thread()
            thread = self._thread
        assert thread is not None
        thread.join()
        if self.turns.failure is not None:
            raise self.turns.failure

    def close(self, timeout: float = 10.0) -> None:
        if self.turns.builder is not None:
            # A follower of a server stops when rank 0's server does (announced).
            with self._lock:
                self._closed = True
            for thread in [t for t in self._threads if t is not threading.current_thread()]:
                thread.join(timeout)
            return
        super().close(timeout)


def _seed_for(request: Request) -> int | None:
    """A seed for a request that samples without one (each process would draw its own)."""
    if request.params.greedy or request.params.seed is not None:
        return None
    return secrets.randbits(63)


def lockstep_of(model: Any) -> LockstepService:
    """A split model's engine service: the one with the calls every rank makes together.

    A model built across ranks is given a :class:`LockstepService`; asking for
    one of a model in one process is a caller's mistake, refused by name.
    """
    service = model.engine
    if not isinstance(service, LockstepService):
        raise ParallelRefused(
            "This model runs in one process; it has no ranks to exchange values with.",
            fix="Call this only for a model loaded with parallel= (loom ... --parallel).",
        )
    return service
