"""Connections under bounds: deadlines for each phase of a request, and a cap on connections.

``http.server`` gives each connection a thread that blocks on the socket
with no deadline at all: a client that connects and sends nothing, trickles
its headers a byte at a time (slowloris), sends half a body, or stops reading
its answer holds that thread forever, and nothing caps how many such threads
exist (1,000 idle connections held 1,010 threads). Here every blocking step
has a deadline, and the server accepts at most ``max_connections`` at once:

* **idle** — from the connection's start, or the end of its previous answer,
  to the first byte of the next request line;
* **header** — from that first byte to the end of the headers, however
  slowly they trickle in;
* **body** — from the end of the headers to the last byte of the body;
* **write** — each write of an answer (a stream writes once per event): a
  client that stops reading fills the socket buffers, and the write that
  would block past the deadline ends the connection (and so its generation).

A per-``recv`` socket timeout would not do: a slowloris client sends one
byte just before each timeout and resets it. So the reader keeps one
deadline for the whole phase and shrinks the socket timeout to what remains
of it before every ``recv``.
"""

from __future__ import annotations

import io
import math
import socket
import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

#: The phases a connection's reads go through (see the module docstring).
Phase = Literal["idle", "header", "body"]

DEFAULT_IDLE_TIMEOUT = 30.0
DEFAULT_HEADER_TIMEOUT = 10.0
DEFAULT_BODY_TIMEOUT = 30.0
DEFAULT_WRITE_TIMEOUT = 30.0
DEFAULT_MAX_CONNECTIONS = 128
DEFAULT_MAX_CONNECTIONS_PER_CLIENT = 64

#: Connections accepted past ``max_connections`` for health checks only: each
#: must ask for ``GET /health`` within :data:`RESERVED_SECONDS` of connecting;
#: anything else is answered ``503`` at once. So a server whose connections are
#: all held (idle clients, a flood) still tells its load balancer it is alive.
RESERVED_CONNECTIONS = 8
RESERVED_SECONDS = 1.0


class ConnectionLimits(BaseModel):
    """How long each phase of a request may take, and how many connections may be open.

    Why these defaults: the idle bound is longer than the keep-alive expiry of
    common clients (httpx, which the ``openai`` and ``anthropic`` packages
    use, drops idle connections after 5 s), so a client rarely sends into a
    connection the server is closing. Headers are a few hundred bytes: 10 s
    is generous on any link. The body bound lets the largest body (8 MiB)
    arrive at under 300 KB/s. A streaming client that has not taken one
    event for 30 s is not reading. 128 connections cover the engine's rows
    and its queue with room for health checks; each may hold one request
    body (at most 8 MiB) while it waits. One client address may hold at most
    ``max_connections_per_client`` of them (half, by default), so one client
    cannot take them all; behind a reverse proxy, every client is the
    proxy's address, and the bound should be raised to ``max_connections``.
    """

    model_config = ConfigDict(frozen=True)

    idle_timeout: float = DEFAULT_IDLE_TIMEOUT
    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    body_timeout: float = DEFAULT_BODY_TIMEOUT
    write_timeout: float = DEFAULT_WRITE_TIMEOUT
    max_connections: int = Field(default=DEFAULT_MAX_CONNECTIONS, strict=True, ge=1)
    max_connections_per_client: int = Field(
        default=DEFAULT_MAX_CONNECTIONS_PER_CLIENT, strict=True, ge=1
    )

    @field_validator("idle_timeout", "header_timeout", "body_timeout", "write_timeout")
    @classmethod
    def _positive_seconds(cls, value: float) -> float:
        if not math.isfinite(value) or value <= 0:
            raise ValueError("a timeout must be a finite number of seconds > 0")
        return value


class PhaseTimeout(TimeoutError):
    """A request phase ran past its deadline; ``phase`` says which, ``seconds`` its bound."""

    def __init__(self, phase: Phase, seconds: float) -> None:
        super().__init__(f"the {phase} phase took longer than {seconds:g} s")
        self.phase = phase
        self.seconds = seconds


class WriteTimeout(TimeoutError):
    """The client did not take an answer's bytes within the write deadline."""


class DeadlineReader(io.RawIOBase):
    """The socket's reading side, each read bounded by the deadline of the current phase.

    :meth:`expect` starts a phase; every ``recv`` then waits at most what is
    left of it and raises :class:`PhaseTimeout` once it is gone. Wrapped in
    an ``io.BufferedReader`` it is the handler's ``rfile``.
    """

    def __init__(self, sock: socket.socket) -> None:
        super().__init__()
        self._sock = sock
        self._phase: Phase | None = None
        self._seconds = 0.0
        self._deadline: float | None = None

    def expect(self, phase: Phase, seconds: float) -> None:
        """Bound the reads from now on: all of them together may take ``seconds``."""
        self._phase = phase
        self._seconds = seconds
        self._deadline = time.monotonic() + seconds

    @property
    def phase(self) -> Phase | None:
        return self._phase

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[override]
        if self._deadline is not None:
            assert self._phase is not None
            left = self._deadline - time.monotonic()
            if left <= 0:
                raise PhaseTimeout(self._phase, self._seconds)
            self._sock.settimeout(left)
        try:
            return self._sock.recv_into(buffer)
        except TimeoutError:
            assert self._phase is not None
            raise PhaseTimeout(self._phase, self._seconds) from None


class DeadlineWriter(io.RawIOBase):
    """The socket's writing side: each write completes within ``seconds`` or ends the connection.

    ``sendall`` under a socket timeout bounds the whole call (Python >= 3.5),
    not each chunk. After one timeout every later write fails at once, so
    reporting the failure never waits a second time.
    """

    def __init__(self, sock: socket.socket, seconds: float) -> None:
        super().__init__()
        self._sock = sock
        self._seconds = seconds
        self.failed = False

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:  # type: ignore[override]
        if self.failed:
            raise WriteTimeout("an earlier write to this client timed out")
        self._sock.settimeout(self._seconds)
        try:
            self._sock.sendall(data)
        except TimeoutError:
            self.failed = True
            raise WriteTimeout(
                f"the client took none of the answer for {self._seconds:g} s"
            ) from None
        return len(data)


def refuse_connection(sock: socket.socket, payload: bytes) -> None:
    """Send a short canned answer without blocking, then close (the connection limit's 503).

    Runs on the accepting thread, so it must never wait on the client: the
    answer goes into the socket's send buffer or is dropped.
    """
    try:
        sock.setblocking(False)
        sock.send(payload)
    except OSError:
        pass
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    sock.close()
