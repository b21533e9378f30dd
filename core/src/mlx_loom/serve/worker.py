"""The one thread that runs every generation, one request at a time.

Why one thread, not a lock taken by each HTTP handler thread: MLX 0.32 gives
every thread its own default stream, backed by a scheduler thread of its own.
A thread that used MLX and exits without destroying its streams makes the
process abort at exit ("terminate called without an active exception"), and
``ThreadingHTTPServer`` starts a fresh thread per connection. So MLX work is
confined to this worker: it is started with the server, runs the queued
requests in arrival order (which is what serialises generation — a model's
forward pass and its caches are not safe to share between concurrent
requests), and destroys its streams when it stops. The HTTP threads only
validate, tokenize and write; they never touch an ``mx.array``.

The worker owns the server's single :class:`~mlx_loom.generate.PromptCache`,
so it is only ever touched from this thread. Each request reuses the longest
prefix of the previous one that the cache still holds.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from ..errors import LoomError
from ..generate import GenerationResponse, PromptCache, stream_generate
from ..host import PROMPT_CACHE
from ..model import Model
from ..text import Tokenizer

log = logging.getLogger("mlx_loom.serve")


@dataclass(frozen=True)
class Piece:
    """A :class:`GenerationResponse` reduced to plain Python, safe to hand to another thread."""

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
    def of(cls, r: GenerationResponse) -> Piece:
        return cls(
            text=r.text,
            token=int(r.token),
            logprob=float(r.logprob),
            top_logprobs=[(int(t), float(v)) for t, v in r.top_logprobs],
            prompt_tokens=r.prompt_tokens,
            generation_tokens=r.generation_tokens,
            cached_tokens=r.cached_tokens,
            finish_reason=r.finish_reason,
            stop=r.stop,
        )


class _End:
    """Marks the end of a job's event stream."""


END = _End()


@dataclass
class Job:
    """One validated generation request and the channel its results come back on.

    ``sampling`` holds :class:`~mlx_loom.generate.SamplingParams` fields,
    already validated by the HTTP thread (``stream_generate`` checks them
    again; that is cheap and keeps the engine's own guarantees).
    """

    prompt: list[int]
    max_tokens: int
    stop: list[str] = field(default_factory=list)
    sampling: dict[str, Any] = field(default_factory=dict)
    #: KV-cache quantization (the server's ``--kv-bits`` ...), as ``stream_generate`` takes it.
    kv_bits: int | None = None
    kv_group_size: int = 64
    quantized_kv_start: int = 0
    events: queue.Queue = field(default_factory=queue.Queue)
    _cancel: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Ask the worker to stop this job (the client went away); idempotent."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()


@dataclass
class WorkerStats:
    """Counters for ``/health`` and tests; written only by the worker thread."""

    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    #: Tokens the most recent job generated before it finished or was cancelled.
    last_generation_tokens: int = 0
    #: Prompt tokens the most recent job found in the prompt cache.
    last_cached_tokens: int = 0


class GenerationWorker:
    """Runs submitted :class:`Job` s in order on one thread; see the module docstring."""

    def __init__(self, model: Model, tokenizer: Tokenizer) -> None:
        self.model = model
        self.tokenizer = tokenizer
        #: Reuse needs the profile's prompt-cache capability; without it every
        #: request starts from an empty cache (still correct, just slower).
        self.reuses_prompt_cache = PROMPT_CACHE in model.capabilities
        self.stats = WorkerStats()
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._active: Job | None = None
        self._prompt_cache: PromptCache | None = None
        self._thread = threading.Thread(target=self._run, name="loom-generation", daemon=True)
        self._thread.start()

    # --- called from HTTP threads ---------------------------------------------

    def submit(self, job: Job) -> None:
        self._jobs.put(job)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def busy(self) -> bool:
        return self._active is not None

    @property
    def queued(self) -> int:
        return self._jobs.qsize()

    def close(self, timeout: float = 10.0) -> None:
        """Cancel the running and queued jobs, stop the thread and wait for it."""
        active = self._active
        if active is not None:
            active.cancel()
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel()
                job.events.put(END)
        self._jobs.put(None)
        self._thread.join(timeout)

    # --- the worker thread ----------------------------------------------------

    def _run(self) -> None:
        try:
            if self.reuses_prompt_cache:
                self._prompt_cache = PromptCache(self.model)
            while True:
                job = self._jobs.get()
                if job is None:
                    break
                self._serve(job)
        finally:
            # Destroy this thread's MLX streams before it exits (see the module
            # docstring): without this the process aborts at interpreter exit.
            mx.synchronize()
            mx.clear_streams()

    def _serve(self, job: Job) -> None:
        if job.cancelled:
            self.stats.cancelled += 1
            job.events.put(END)
            return
        self._active = job
        stream: Iterator[GenerationResponse] | None = None
        generated = 0
        cut_short = False
        try:
            stream = stream_generate(
                self.model,
                self.tokenizer,
                job.prompt,
                max_tokens=job.max_tokens,
                stop=job.stop,
                prompt_cache=self._prompt_cache,
                kv_bits=job.kv_bits,
                kv_group_size=job.kv_group_size,
                quantized_kv_start=job.quantized_kv_start,
                **job.sampling,
            )
            for response in stream:
                generated = response.generation_tokens
                self.stats.last_cached_tokens = response.cached_tokens
                job.events.put(Piece.of(response))
                if response.finish_reason is not None:
                    break
                if job.cancelled:
                    cut_short = True
                    break
            if cut_short:
                self.stats.cancelled += 1
            else:
                self.stats.completed += 1
        except LoomError as err:
            self.stats.failed += 1
            job.events.put(err)
        except Exception as err:  # the server must outlive any one request
            log.exception("generation failed")
            self.stats.failed += 1
            # The caches may hold a half-written step: start the next request afresh.
            if self._prompt_cache is not None:
                self._prompt_cache.reset()
            job.events.put(err)
        finally:
            if stream is not None:
                stream.close()  # stream_generate records what the caches now hold
            self.stats.last_generation_tokens = generated
            self._active = None
            job.events.put(END)
