"""The server's seam to the engine: a :class:`Job` goes in, :class:`Piece` s come out.

Every completion request becomes one :class:`Job` (prompt ids, ``max_tokens``,
stop strings, sampling options), submitted to the model's continuous-batching
engine (``model.engine``, :mod:`mlx_loom.engine`). Jobs therefore run
concurrently, batched with each other, each with the tokens it would get
alone. The engine's thread puts each job's pieces on ``job.events`` as they
are produced, then :data:`END` (or the job's error, then ``END``); HTTP
threads only validate, wait and write, and never touch an ``mx.array``.

Backpressure: the engine keeps at most ``max_queued`` jobs waiting for a free
row; :meth:`GenerationWorker.submit` raises :class:`~mlx_loom.errors.EngineBusy`
past that (the server answers 503 with ``Retry-After``). A client that goes
away cancels its job (:meth:`Job.cancel`): its row leaves the batch at the
next step boundary.

A model split across ranks (``loom serve --parallel``) submits each job with
a plain description of it, which its engine announces to the other ranks;
they run :func:`~mlx_loom.serve.ranks.follow_jobs` instead of a server
and run every job in the same engine steps.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Any

from ..capabilities import PROMPT_CACHE
from ..engine import (
    Done,
    EngineSettings,
    Handle,
    Request,
    ServiceStats,
    Speculation,
    TokenEvent,
    make_request,
)
from ..engine.constraints import Constraint
from ..engine.lockstep_service import LockstepService
from ..engine.params import SamplingParams
from ..model import Model
from ..text import Tokenizer
from .ranks import describe


@dataclass(frozen=True)
class Piece:
    """One generated token of a job, as plain Python (safe on any thread)."""

    text: str
    token: int
    logprob: float
    top_logprobs: list[tuple[int, float]]
    prompt_tokens: int
    generation_tokens: int
    cached_tokens: int
    finish_reason: str | None
    #: The stop string that ended the generation, if one did.
    stop: str | None = None

    @classmethod
    def of(cls, event: TokenEvent) -> Piece:
        return cls(
            text=event.text,
            token=event.token,
            logprob=event.logprob,
            top_logprobs=list(event.top_logprobs),
            prompt_tokens=event.prompt_tokens,
            generation_tokens=event.generation_tokens,
            cached_tokens=event.cached_tokens,
            finish_reason=event.finish_reason,
            stop=event.stop,
        )


class _End:
    """Marks the end of a job's event stream."""


END = _End()


@dataclass
class Job:
    """One validated generation request and the channel its results come back on.

    ``sampling`` holds :class:`~mlx_loom.engine.params.SamplingParams` fields,
    already validated by the HTTP thread; ``request`` is the engine request
    built from these fields there (``None``: built at submission). The plain
    fields stay: the other ranks of a split model build the request from them.
    """

    prompt: list[int]
    max_tokens: int
    stop: list[str] = field(default_factory=list)
    sampling: dict[str, Any] = field(default_factory=dict)
    #: KV-cache quantization (the server's ``--kv-bits`` ...), as ``make_request`` takes it.
    kv_bits: int | None = None
    kv_group_size: int | None = None
    quantized_kv_start: int = 0
    kv_codec: str | None = None
    #: The registered adapter this job runs with (``None``: the base model).
    adapter: str | None = None
    speculation: Speculation | None = None
    request: Request | None = None
    #: Structured output: the grammar the reply follows (``None``: free text).
    constraint: Constraint | None = None
    events: queue.Queue = field(default_factory=queue.Queue)
    _cancel: threading.Event = field(default_factory=threading.Event)
    _handle: Handle | None = None

    def cancel(self) -> None:
        """Stop this job (the client went away); idempotent."""
        self._cancel.set()
        if self._handle is not None:
            self._handle.cancel()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def _sink(self, event: TokenEvent | Done) -> None:
        """Called on the engine thread with each event: queue it for the HTTP thread."""
        if isinstance(event, TokenEvent):
            self.events.put(Piece.of(event))
            return
        if event.outcome == "failed" and event.error is not None:
            self.events.put(event.error)
        self.events.put(END)


class GenerationWorker:
    """Submits jobs to the model's engine, configured with the server's settings."""

    def __init__(
        self, model: Model, tokenizer: Tokenizer, settings: EngineSettings | None = None
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        settings = settings or EngineSettings()
        #: Reuse needs the profile's prompt-cache capability; without it every
        #: request starts from empty caches (still correct, just slower).
        self.reuses_prompt_cache = PROMPT_CACHE in model.capabilities
        if not self.reuses_prompt_cache:
            settings = settings.model_copy(update={"prompt_cache_size": 0})
        self.service = model.engine
        self.service.configure(settings)

    def submit(self, job: Job) -> None:
        """Queue ``job``; raises :class:`~mlx_loom.errors.EngineBusy` when the queue is full."""
        request = job.request or make_request(
            self.model,
            self.tokenizer,
            job.prompt,
            max_tokens=job.max_tokens,
            params=SamplingParams(**job.sampling),
            stop=job.stop,
            kv_bits=job.kv_bits,
            kv_group_size=job.kv_group_size,
            quantized_kv_start=job.quantized_kv_start,
            kv_codec=job.kv_codec,
            adapter=job.adapter,
            speculation=job.speculation,
            constraint=job.constraint,
        )
        service = self.service
        if isinstance(service, LockstepService):
            # the other ranks build the same request from its description
            job._handle = service.submit(request, sink=job._sink, spec=describe(job))
        else:
            job._handle = service.submit(request, sink=job._sink)
        if job.cancelled:
            job._handle.cancel()

    def stats(self) -> ServiceStats:
        return self.service.stats()

    @property
    def alive(self) -> bool:
        return self.service.alive

    @property
    def busy(self) -> bool:
        return self.stats().engine.active > 0

    @property
    def queued(self) -> int:
        return self.stats().queued

    def close(self, timeout: float = 10.0) -> None:
        """Stop the engine (cancelling what runs) and wait for its thread.

        The model lets go of it too, so an unloaded model's caches go with it.
        """
        self.service.close(timeout)
        if self.model.started_engine is None:
            self.model.close_engine(timeout)
