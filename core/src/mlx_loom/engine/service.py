"""One thread per model runs its engine; every generation goes through it.

The thread-safety contract of the Python API rests here. MLX streams belong
to the thread that made them, and a thread that has used MLX streams and
exits without destroying them makes the process abort at exit ("terminate
called without an active exception"); two threads evaluating one shared
cache can crash inside ``mx.eval``. So no caller thread runs a forward:
``generate``, ``stream_generate``, ``batch_generate`` and the server all
:meth:`~EngineService.submit` requests to the model's service, whose one
thread owns every MLX array the generations build. Calls from several
threads on one model are therefore truly concurrent — their requests share
decode batches — and the process never aborts at exit: the thread destroys
its streams when it stops, which it does when idle for
``idle_seconds``, on :meth:`~EngineService.close`, and at interpreter exit.

What crosses threads is plain data: requests (validated on the caller's
thread), events (ints, floats, strings; a log-probability vector only when
asked, already evaluated) and outcomes.

*How* the thread takes its turns is a policy object (:class:`Turns`): by
default one process applies commands as they arrive; the ranks of a split
model run :class:`~mlx_loom.engine.lockstep_service.LockstepTurns`, where rank 0
decides every turn. The service owns the thread, the inbox and the
bookkeeping either way.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from mlx_loom.device import wired_limit
from mlx_loom.engine.core import Engine, EngineStats
from mlx_loom.engine.disk import check_directory
from mlx_loom.engine.events import Done, Event, TokenEvent
from mlx_loom.engine.kv_budget import check_kv_budget
from mlx_loom.engine.request import Request
from mlx_loom.engine.settings import EngineSettings
from mlx_loom.errors import EngineBusy, EngineStopped, RequestError
from mlx_loom.streams import generation_stream

if TYPE_CHECKING:
    from mlx_loom.model import Model

log = logging.getLogger("mlx_loom.engine")

#: Called on the engine thread with each event of a request; must not block.
Sink = Callable[[Event], None]

#: After idling: how long a first submission waits for a second (a lone request
#: pays this), the pause that then ends a burst, and the longest an idle engine
#: waits for one to end (see ``EngineService._drain``).
GATHER_FIRST = 0.002
GATHER_SECONDS = 0.005
GATHER_LIMIT = 0.05


class Handle:
    """The caller's end of one submitted request: its events, its outcome, cancel.

    Iterate it for the request's :class:`~mlx_loom.engine.TokenEvent` s (the
    iteration ends after the last one and raises the request's error if it
    failed); :meth:`cancel` stops it (its row leaves at the next step
    boundary); :meth:`wait` blocks until it is over and returns its
    :class:`~mlx_loom.engine.Done`.
    """

    def __init__(self, service: EngineService, request: Request, sink: Sink | None) -> None:
        self.request = request
        self._service = service
        self._queue: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._sink = sink
        self._done = threading.Event()
        self.done: Done | None = None
        self.uid: int | None = None  # the engine's uid, once the engine has it
        self._cancelled = False

    # --- engine side ------------------------------------------------------------

    def _deliver(self, event: Event) -> None:
        if isinstance(event, Done):
            self.done = event
        if self._sink is not None:
            try:
                self._sink(event)
            except Exception:  # a consumer's bug must not stop the engine
                log.exception("an event sink failed")
        else:
            self._queue.put(event)
        if isinstance(event, Done):
            self._done.set()

    # --- caller side ----------------------------------------------------------------

    def cancel(self) -> None:
        """Stop this request (idempotent; a no-op once it is over)."""
        if self._cancelled or self._done.is_set():
            return
        self._cancelled = True
        self._service._post(("cancel", self))

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def __iter__(self) -> Iterator[TokenEvent]:
        if self._sink is not None:
            raise RuntimeError("this request delivers its events to a sink")
        while True:
            event = self._queue.get()
            if isinstance(event, Done):
                if event.outcome == "failed" and event.error is not None:
                    raise event.error
                return
            yield event

    def wait(self, timeout: float | None = None) -> Done:
        """Block until the request is over; its outcome."""
        if not self._done.wait(timeout):
            raise TimeoutError("the request is still running")
        assert self.done is not None
        return self.done


@dataclass(frozen=True)
class ServiceStats:
    """:class:`~mlx_loom.engine.EngineStats` plus what waits to reach the engine."""

    engine: EngineStats
    submitted: int
    running: bool

    @property
    def queued(self) -> int:
        """Requests waiting for a row: not yet prefilling or decoding."""
        return self.engine.waiting + self.submitted


class Turns:
    """How an engine thread takes its turns: the policy an :class:`EngineService` runs.

    This default runs one process on its own timing: each turn takes the
    commands that arrived (after idling, a burst's worth), applies them and
    steps the engine. A policy is bound to one service (:meth:`bind`) and
    works on its state; the service calls :meth:`new_engine` when it needs
    an engine (at start, after an engine failure), :meth:`admit` for each
    command posted to its thread, and :meth:`run` as the thread's body.
    """

    service: EngineService

    def bind(self, service: EngineService) -> None:
        self.service = service

    def new_engine(self) -> Engine:
        return Engine(self.service.model, self.service.settings)

    def admit(self, command: tuple[str, Any]) -> bool:
        """Whether a command posted to the thread is queued (every one, here)."""
        return True

    def run(self) -> None:
        """The thread's body: turns until stopped or idle for ``idle_seconds``."""
        service = self.service
        handles: dict[int, Handle] = {}
        try:
            # Metal: the model's memory stays wired while this thread generates.
            with wired_limit(service.model.module, generation_stream()):
                while self.serve(handles):
                    pass
        finally:
            stopped = EngineStopped(
                "The generation engine stopped before this request finished.",
                fix="Generate again (load the model again if it was closed).",
            )
            for uid, handle in list(handles.items()):
                handle._deliver(Done(uid, "failed", error=stopped))
            while True:
                try:
                    kind, item = service._inbox.get_nowait()
                except queue.Empty:
                    break
                if kind == "submit":
                    with service._lock:
                        service._submitted -= 1
                    item._deliver(Done(-1, "failed", error=stopped))
            # Destroy this thread's MLX streams before it exits: see the module docstring.
            mx.synchronize()
            mx.clear_streams()

    def serve(self, handles: dict[int, Handle]) -> bool:
        """One turn of the thread: take commands, step the engine; False to exit."""
        service = self.service
        engine = service._engine
        commands: list[tuple[str, Any]] = []
        idle = not engine.has_work
        if idle:
            try:
                commands.append(service._inbox.get(timeout=service.settings.idle_seconds))
            except queue.Empty:
                with service._lock:
                    if service._inbox.empty():
                        service._thread = None  # idle: exit; the next submit starts a thread
                        return False
                return True
        service._drain(commands, gather=idle)
        taken = 0
        try:
            for kind, item in commands:
                if kind == "stop":
                    engine.flush()  # the prefix store's disk tier takes what memory holds
                    return False
                if kind == "configure":
                    engine.configure(item)
                elif kind == "submit":
                    taken += 1
                    (uid,) = engine.insert([item.request])
                    item.uid = uid
                    handles[uid] = item
                    if item.cancelled:
                        service._dispatch(engine.remove([uid]), handles)
                elif kind == "cancel" and item.uid is not None:
                    service._dispatch(engine.remove([item.uid]), handles)
        finally:
            # One update, under the lock: a request moves from "submitted" to
            # the engine's waiting count at once. Decremented before the stats
            # were refreshed, it would count nowhere for a whole step, and
            # the queue bound (and /health) would miss it.
            with service._lock:
                service._submitted -= taken
                service._stats = engine.stats()
        if engine.has_work:
            try:
                events = engine.step()
            except BaseException as err:  # an engine bug: fail what runs, keep serving
                log.exception("the engine failed; its requests are failed and it restarts")
                events = [Done(uid, "failed", error=err) for uid in handles]
                service._engine = self.new_engine()
            service._dispatch(events, handles)
        with service._lock:
            service._stats = service._engine.stats()
        return True


class EngineService:
    """The thread that owns one model's :class:`~mlx_loom.engine.Engine`.

    Create it through ``model.engine`` (one per model); start is lazy.
    ``turns`` is how its thread takes turns (:class:`Turns` by default).
    """

    def __init__(
        self, model: Model, settings: EngineSettings | None = None, *, turns: Turns | None = None
    ) -> None:
        self.model = model
        self._settings = settings or EngineSettings()
        self.turns = turns or Turns()
        self.turns.bind(self)
        self._engine = self.turns.new_engine()
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        # Every thread started and perhaps still running: one that left for
        # idleness may still be destroying its streams when close() runs.
        self._threads: list[threading.Thread] = []
        self._submitted = 0  # posted, not yet taken in by the engine thread
        self._stats = self._engine.stats()
        self._closed = False
        _services.add(self)

    # --- any thread ---------------------------------------------------------------

    @property
    def settings(self) -> EngineSettings:
        return self._settings

    def configure(self, settings: EngineSettings | None = None, **changes: Any) -> EngineSettings:
        """Change scheduling settings (from the next step); return the new settings."""
        new = settings if settings is not None else self._settings.model_copy(update=changes)
        if changes and settings is None:
            new = EngineSettings(**new.model_dump())  # validate the changed values
        if new.prompt_cache_dir is not None:
            check_directory(new.prompt_cache_dir)  # refused here, not on the engine thread
        check_kv_budget(self.model, new.max_kv_bytes)
        self._settings = new
        self._post(("configure", new))
        return new

    def submit(self, request: Request, *, sink: Sink | None = None) -> Handle:
        """Queue ``request`` and return its :class:`Handle`.

        Raises :class:`~mlx_loom.errors.EngineBusy` when ``max_queued``
        requests already wait for a row.
        """
        handle = Handle(self, request, sink)
        with self._lock:
            if self._thread is threading.current_thread():
                raise RequestError(
                    "A generation was started from inside a generation on the same model (a "
                    "custom sampler or logits processor called generate); it would wait on "
                    "itself forever.",
                    fix="Do not generate from inside a sampler or logits processor.",
                )
            if self._closed:
                raise EngineStopped(
                    "The model's generation engine has been shut down.",
                    fix="Load the model again to generate.",
                )
            limit = self._settings.max_queued
            queued = self._submitted + self._stats.waiting
            if limit is not None and queued >= limit:
                raise EngineBusy(
                    f"{queued} requests are already waiting for a free row (the limit is {limit}).",
                    fix="Retry in a moment, or raise the queue limit (max_queued / --queue-size).",
                )
            self._submitted += 1
            self._inbox.put(("submit", handle))
            self._ensure_thread()
        return handle

    def stats(self) -> ServiceStats:
        with self._lock:
            running = self._thread is not None and self._thread.is_alive()
            return ServiceStats(self._stats, self._submitted, running)

    @property
    def alive(self) -> bool:
        """False once closed (a service that is merely idle is alive)."""
        return not self._closed

    def close(self, timeout: float = 10.0) -> None:
        """Cancel everything, stop the thread (destroying its streams) and wait for it."""
        with self._lock:
            self._closed = True
            running = self._thread is not None
            if running:
                self._inbox.put(("stop", None))
            threads = [t for t in self._threads if t is not threading.current_thread()]
        if not running:
            self._engine.flush()  # no thread owns the engine: write its caches from here
        for thread in threads:
            thread.join(timeout)
        _services.discard(self)

    def _post(self, command: tuple[str, Any]) -> None:
        if not self.turns.admit(command):
            return
        with self._lock:
            self._inbox.put(command)
            if not self._closed:
                self._ensure_thread()

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(
                target=self.turns.run, name=f"loom-engine-{self.model.model_type}", daemon=True
            )
            self._threads = [t for t in self._threads if t.is_alive()] + [self._thread]
            self._thread.start()

    # --- the engine thread (what its turns use) ------------------------------------------

    def _drain(self, commands: list[tuple[str, Any]], *, gather: bool) -> None:
        """Take every queued command; after idling, also those of a burst still arriving.

        The clients of a burst (a server's concurrent connections, a batch)
        submit a few milliseconds apart, and an engine that starts computing
        at the first submission holds the interpreter lock long enough to
        delay the others' submissions by tens of milliseconds (measured: the
        second of 8 concurrent HTTP requests reached the engine 65 ms after
        the first). Waiting, lock released, until submissions pause for
        ``GATHER_SECONDS`` (at most ``GATHER_LIMIT`` in all) lets the burst
        arrive and be prefilled together; a lone request waits only
        ``GATHER_FIRST`` for a second one. A busy engine never waits: its
        running rows' next step comes first.
        """
        deadline = time.monotonic() + GATHER_LIMIT
        pause = GATHER_FIRST
        while True:
            try:
                commands.append(self._inbox.get_nowait())
                continue
            except queue.Empty:
                pass
            remaining = deadline - time.monotonic()
            if not gather or remaining <= 0:
                return
            try:
                commands.append(self._inbox.get(timeout=min(pause, remaining)))
            except queue.Empty:
                return
            pause = GATHER_SECONDS  # a burst: wait for it to pause

    def _dispatch(self, events: Sequence[Event], handles: dict[int, Handle]) -> None:
        for event in events:
            handle = handles.get(event.uid)
            if handle is None:
                continue
            if isinstance(event, Done):
                del handles[event.uid]
            handle._deliver(event)


# Every live service, so that interpreter exit stops their threads (which
# destroy their MLX streams) before MLX tears down. Weak: a service that is
# garbage collected is not kept alive by this set.
_services: weakref.WeakSet[EngineService] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    # Each thread stops after its current step (one decode step or prefill
    # chunk); waiting for that is what keeps the exit clean.
    for service in list(_services):
        service.close(timeout=60.0)
