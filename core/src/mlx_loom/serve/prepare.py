"""The few threads that turn request bodies into jobs, so connection threads never do heavy work.

Preparing a completion request — parsing its JSON, validating it, rendering
the chat template, tokenizing the prompt — costs time and memory that grow
with the body: a 7 MB prompt took 9 s and 1.8 GB to tokenize. Done on each
connection's own thread, as many of these run at once as there are clients
(each adding its memory), and they compete with everything else the server
does. Here they run on a small fixed pool instead, and a connection thread
only waits for its result (still noticing if its client leaves).

Large bodies (:data:`LARGE_BODY_BYTES` and up) may occupy all threads but
one: the last is kept for small requests, so a chat turn is prepared at once
even while huge prompts are tokenized, and the memory in use for
preparation is bounded by the pool's size times the prompt-size limits.
With one thread there is nothing to keep back, and requests take turns.

Why threads, not processes: the tokenizer (``tokenizers``, in Rust) releases
the GIL while it encodes (through ``encode_batch``; its ``encode`` keeps it,
see :meth:`mlx_loom.text.Tokenizer.encode`) — measured here, while a
1 Mi-character prompt was prepared for 2-9 s, ``/health`` answered every
poll within 0.05 s; what still holds the GIL is building the Python list of
ids, ~0.1 s — and the template renderer yields the GIL like any Python code.
A process pool would copy each body to another process and the tokenizer
into each worker, for no gain in responsiveness.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

#: Threads preparing requests unless the server is told otherwise.
DEFAULT_THREADS = 2

#: A body at least this big may not take the pool's last thread. 256 KiB of
#: prompt tokenizes in well under a second; 8 MiB (the body limit) in tens.
LARGE_BODY_BYTES = 256 * 1024

#: How often a waiting connection thread checks that its client is still there.
POLL_SECONDS = 0.05


class ClientGone(Exception):
    """The client closed its connection; stop working for it."""


class PoolClosed(Exception):
    """The server is stopping: no new preparation starts."""


class PreparePool:
    """Runs preparation callables on ``threads`` threads; see the module docstring."""

    def __init__(self, threads: int = DEFAULT_THREADS) -> None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads={threads!r}: the pool needs at least one thread")
        self.threads = threads
        self._executor = concurrent.futures.ThreadPoolExecutor(
            threads, thread_name_prefix="loom-prepare"
        )
        #: Large jobs admitted to the executor at once: all threads but one.
        self._large = threading.BoundedSemaphore(max(1, threads - 1))
        self._lock = threading.Lock()
        self._running = 0
        self._waiting = 0

    @property
    def running(self) -> int:
        """Preparations running now."""
        return self._running

    @property
    def waiting(self) -> int:
        """Requests waiting for a thread (or, for large ones, for their turn)."""
        return self._waiting

    def run(self, work: Callable[[], T], *, large: bool, gone: Callable[[], bool]) -> T:
        """Run ``work()`` on a pool thread and return its result (or raise its exception).

        ``gone()`` is polled while waiting; once it is true the request is
        abandoned with :class:`ClientGone` — dropped if it had not started;
        if it had, it runs to its end (it is bounded by the prompt limits)
        and its result is discarded. Raises :class:`PoolClosed` once the
        server is stopping.
        """
        with self._lock:
            self._waiting += 1
        future = None
        try:
            if large:
                while not self._large.acquire(timeout=POLL_SECONDS):
                    if gone():
                        raise ClientGone
            try:
                future = self._executor.submit(self._call, work, large)
            except RuntimeError:  # shut down
                raise PoolClosed from None
            finally:
                if future is None and large:
                    self._large.release()
        finally:
            if future is None:
                with self._lock:
                    self._waiting -= 1
        while True:
            # wait(), not result(timeout=): work that itself raises TimeoutError
            # must not read as "not finished yet".
            done, _ = concurrent.futures.wait([future], timeout=POLL_SECONDS)
            if done:
                if future.cancelled():  # dropped by close() before it ran
                    self._forget(large)
                    raise PoolClosed
                return future.result()
            if gone():
                if future.cancel():
                    self._forget(large)  # it never started, so _call will not settle it
                raise ClientGone

    def _call(self, work: Callable[[], T], large: bool) -> T:
        with self._lock:
            self._waiting -= 1
            self._running += 1
        try:
            return work()
        finally:
            with self._lock:
                self._running -= 1
            if large:
                self._large.release()

    def _forget(self, large: bool) -> None:
        """Account for a job cancelled before it ran."""
        with self._lock:
            self._waiting -= 1
        if large:
            self._large.release()

    def close(self) -> None:
        """Drop what has not started; let running work finish on its own (it is bounded)."""
        self._executor.shutdown(wait=False, cancel_futures=True)
