"""The HTTP server: ``ThreadingHTTPServer`` routing to a :class:`ServeApp`.

Each connection gets a handler thread, and no handler thread does heavy
work: it reads the request under the deadlines of
:mod:`~mlx_loom.serve.connection`, hands the body to the preparation pool
(:mod:`~mlx_loom.serve.prepare`: JSON, validation, chat template,
tokenizer), hands the prepared jobs to the model's engine thread (see
``worker.py``), which batches concurrent requests, and writes what comes
back. So ``/health`` and ``/v1/models`` answer at once while prompts are
tokenized and generations run, a request waiting for a row costs no MLX
work, and at most ``max_connections`` connections (threads) exist at once.

Every answer the server gives to a bad request is JSON in the OpenAI error
shape — including the ones ``http.server`` itself would have answered in
HTML (a malformed request line, an over-long header) — and no input makes a
handler raise past :meth:`Handler._dispatch`.
"""

from __future__ import annotations

import dataclasses
import hmac
import io
import ipaddress
import json
import logging
import queue
import re
import select
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TypeVar
from urllib.parse import urlsplit

from pydantic import ValidationError

from ..bounded_json import REQUEST_JSON, parse_json
from ..engine import EngineSettings, EngineStats, ServiceStats
from ..engine.pool import Lease, ModelPool, checkpoint_bytes, statuses_json
from ..errors import EngineBusy, EngineStopped, LoomError, ModelUnavailable, RequestError
from . import anthropic, page, responses, utility, wire
from .app import Prepared, ServeApp, server_engine_settings
from .connection import (
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_HEADER_TIMEOUT,
    DEFAULT_IDLE_TIMEOUT,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_CONNECTIONS_PER_CLIENT,
    DEFAULT_WRITE_TIMEOUT,
    RESERVED_CONNECTIONS,
    RESERVED_SECONDS,
    ConnectionLimits,
    DeadlineReader,
    DeadlineWriter,
    PhaseTimeout,
    WriteTimeout,
    refuse_connection,
)
from .errors import (
    AUTHENTICATION,
    NOT_FOUND,
    SERVER_ERROR,
    HttpError,
    ServerStartError,
    from_loom_error,
    overloaded,
)
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .metrics import UNMATCHED, ServerMetrics, Timing
from .models import ServedModel, ServedModels
from .prepare import DEFAULT_THREADS as DEFAULT_TOKENIZER_THREADS
from .prepare import LARGE_BODY_BYTES, ClientGone, PoolClosed, PreparePool
from .worker import END, Job, Piece

log = logging.getLogger("mlx_loom.serve")

_T = TypeVar("_T")

#: Largest request body accepted; a chat history this big is far beyond any
#: context window, and reading unbounded bodies would let one client exhaust memory.
MAX_BODY_BYTES = 8 * 1024 * 1024

#: How often a handler waiting for tokens checks that its client is still there.
POLL_SECONDS = 0.05

#: How long requests in flight may run on after SIGTERM before their answers
#: are ended (``--shutdown-grace``). ``docker stop`` and systemd wait 10 s
#: before they kill; this ends every stream cleanly inside that.
DEFAULT_SHUTDOWN_GRACE = 5.0

#: After the grace, how long handlers get to write the end of their answers.
_END_SECONDS = 2.0

ROUTES: dict[str, tuple[str, ...]] = {
    "/": ("GET",),
    "/health": ("GET",),
    "/v1/models": ("GET",),
    "/v1/completions": ("POST",),
    "/v1/chat/completions": ("POST",),
    "/v1/messages": ("POST",),
    "/v1/messages/count_tokens": ("POST",),
    "/tokenize": ("POST",),
    "/detokenize": ("POST",),
    "/metrics": ("GET",),
    "/v1/responses": ("POST",),
}

#: Paths in the Anthropic error shape.
ANTHROPIC_PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})

#: What a connection accepted past the limit may ask for: the load balancer's
#: health check and the monitoring scrape, which must answer under full load.
RESERVED_PATHS = frozenset({"/health", "/metrics"})

#: mlx_lm.server also answers these paths without the ``/v1`` prefix.
ALIASES = {
    "/chat/completions": "/v1/chat/completions",
    "/completions": "/v1/completions",
    "/responses": "/v1/responses",
}

#: Paths anyone may read even when the server has an API key: the chat page
#: (it asks for the key itself) and the health check (load balancers).
PUBLIC_PATHS = frozenset({"/", "/health"})

#: How long a browser may cache a CORS preflight answer.
PREFLIGHT_MAX_AGE = "600"


#: The socket send buffer of each connection: hundreds of streamed tokens, and
#: small enough that 128 stalled clients hold a few tens of MB of kernel memory.
SEND_BUFFER_BYTES = 128 * 1024

#: Refused connections are logged at most this often (with how many there were).
REFUSAL_LOG_SECONDS = 10.0

#: A ``Content-Length`` value: decimal digits only.
_DIGITS = re.compile(r"[0-9]+")

#: The longest request line, as ``http.server`` bounds it.
MAX_REQUEST_LINE = 65536

#: An interim answer every HTTP/1.1 client skips (RFC 9110 15.2). Sent once, to a
#: client that closed its sending side while it waits for a whole answer: a
#: client that only half-closed ignores it, one that is gone answers it with a
#: reset, which the next look at the socket sees.
_PROBE = b"HTTP/1.1 100 Continue\r\n\r\n"

#: ``code`` for the errors ``http.server`` detects itself, by status.
_PROTOCOL_CODES = {
    400: "bad_request",
    408: "request_timeout",
    414: "request_line_too_long",
    431: "headers_too_large",
    501: "method_not_implemented",
    505: "http_version_not_supported",
}


class Handler(BaseHTTPRequestHandler):
    """One HTTP request. ``self.server`` is the :class:`LoomServer`."""

    server: LoomServer
    protocol_version = "HTTP/1.1"
    server_version = "mlx-loom"
    sys_version = ""

    # --- the connection: deadlines, and protocol errors as JSON ---------------------

    def setup(self) -> None:
        """Both sides of the socket under the server's deadlines (see ``connection.py``)."""
        self.connection = self.request
        try:
            # Streams write one small event per token: send each at once.
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # Bound what the kernel buffers for a client that stops reading
            # (Linux starts loopback sockets near 4 MB): the write deadline
            # then notices it after SEND_BUFFER_BYTES of events, not megabytes.
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        except OSError:
            pass
        self._reader = DeadlineReader(self.connection)
        self.rfile = self._buffered = io.BufferedReader(self._reader)
        self._writer = DeadlineWriter(self.connection, self.server.limits.write_timeout)
        self.wfile = self._writer  # type: ignore[assignment]  # http.server only writes, flushes
        #: Accepted past the connection limit: it may only ask for ``GET /health`` or ``/metrics``.
        self._health_only = self.server.is_reserved(self.request)
        self._probed = False

    def handle_one_request(self) -> None:
        """One request: wait (idle bound) for its first byte, read its headers (header bound),
        then dispatch; the body is read under its own bound by the endpoint.

        ``http.server``'s version waits on the socket with no deadline at all.
        """
        limits = self.server.limits
        idle, header = limits.idle_timeout, limits.header_timeout
        if self._health_only:
            idle = header = min(header, RESERVED_SECONDS)
        self._started = False  # have the status line and headers been sent?
        self._probed = False
        self._body_read = True
        self._anthropic = False  # answer errors in the Anthropic shape (/v1/messages)
        self._expects_continue = False
        self.command, self.path, self.requestline = "", "", ""
        self.request_version = self.default_request_version
        self.headers = self.MessageClass()
        self._reader.expect("idle", idle)
        try:
            if not self._buffered.peek(1):  # the client closed the connection
                self.close_connection = True
                return
        except OSError:  # PhaseTimeout included: an idle connection just closes
            self.close_connection = True
            if self._health_only:  # it was told nothing yet: say why it is closed
                self._refuse_reserved()
            return
        self._reader.expect("header", header)
        try:
            self.raw_requestline = self.rfile.readline(MAX_REQUEST_LINE + 1)
            if len(self.raw_requestline) > MAX_REQUEST_LINE:
                self.send_error(HTTPStatus.REQUEST_URI_TOO_LONG)
                return
            if not self.parse_request():
                return  # answered already
        except PhaseTimeout as err:
            self._protocol_error(
                408,
                f"The request line and headers did not arrive within {err.seconds:g} s.",
                fix="send the whole request head at once (the server's --header-timeout bounds it)",
            )
            return
        except OSError:
            self.close_connection = True
            return
        method = getattr(self, "do_" + self.command, None)
        if method is None:
            self.send_error(HTTPStatus.NOT_IMPLEMENTED, f"Unsupported method ({self.command!r})")
            return
        method()

    def parse_request(self) -> bool:
        """``http.server``'s parsing, except that an HTTP/0.9 request line is answered.

        A two-word line (``GET /``) is HTTP/0.9, which has no headers;
        ``http.server`` accepts it and then waits for headers that never
        come. It is answered 505 (with an HTTP/1.1 status line, which every
        client of this server reads) and the connection is closed.
        """
        words = str(self.raw_requestline, "iso-8859-1").split()
        if len(words) == 2:
            self.command, self.path = words
            self._protocol_error(
                505,
                f"The request line {' '.join(words)!r} has no HTTP version (HTTP/0.9), "
                "which this server does not speak.",
                fix="send an HTTP/1.1 request line, e.g. 'GET /health HTTP/1.1'",
            )
            return False
        return super().parse_request()

    def handle_expect_100(self) -> bool:
        """Defer ``100 Continue`` until the body's length is known to be acceptable.

        ``http.server`` sends it as soon as it sees the header, inviting a
        client to upload a body that is then refused (413) unread.
        """
        self._expects_continue = True
        return True

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """``http.server``'s own protocol errors (bad request line, long headers ...) as JSON."""
        status = int(code)
        try:
            phrase = HTTPStatus(status).phrase
        except ValueError:
            phrase = "Error"
        text = message or phrase
        if explain and explain != message:
            text = f"{text}: {explain}"
        fixes = {
            400: "send an HTTP/1.1 request: 'METHOD /path HTTP/1.1', headers, a blank line",
            414: f"send a request line shorter than {MAX_REQUEST_LINE} bytes",
            431: "send at most 100 headers, each shorter than 64 KiB",
            501: "use GET, POST or OPTIONS",
            505: "send the request as HTTP/1.1",
        }
        self._protocol_error(status, text.rstrip(".") + ".", fix=fixes.get(status))

    def _protocol_error(self, status: int, message: str, *, fix: str | None) -> None:
        """Answer a request that could not be read as one, and close the connection."""
        if self.request_version in ("", "HTTP/0.9"):
            self.request_version = "HTTP/1.0"  # so that a status line is written
        self.close_connection = True
        self._body_read = False
        # Each of these is the client's doing, whatever its status (501, 505).
        self._send_error(HttpError(status, message, fix=fix, code=_PROTOCOL_CODES.get(status)))

    # --- plumbing ---------------------------------------------------------------

    def version_string(self) -> str:
        return self.server_version  # http.server appends " " + sys_version, empty here

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (stdlib's name)
        log.info("%s %s", self.address_string(), format % args)

    def do_GET(self) -> None:  # noqa: N802 (stdlib's naming)
        self._dispatch("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch("POST")

    def do_PUT(self) -> None:  # noqa: N802
        self._dispatch("PUT")

    def do_PATCH(self) -> None:  # noqa: N802
        self._dispatch("PATCH")

    def do_DELETE(self) -> None:  # noqa: N802
        self._dispatch("DELETE")

    def do_OPTIONS(self) -> None:  # noqa: N802
        self._dispatch("OPTIONS")

    @property
    def app(self) -> ServeApp:
        """The app of the model this request uses (leased in :meth:`_prepare`)."""
        return self._app if self._app is not None else self.server.app

    def _dispatch(self, method: str) -> None:
        # A body is read only by the endpoints that take one; any answer sent
        # while it is unread closes the connection, so a body (on any method,
        # GET and OPTIONS included) is never read as a pipelined next request.
        self._body_read = not self._has_body()
        self.server.request_started()
        self._arrived = time.monotonic()
        self._status: int | None = None
        self._app: ServeApp | None = None
        self._leases: list[Lease[ServeApp]] = []
        path = ""
        try:
            path = _request_path(self.path)
            path = ALIASES.get(path, path)
            self._anthropic = path in ANTHROPIC_PATHS
            if self._health_only:
                self._check_reserved(method, path)
            if self.server.draining:
                self.close_connection = True
                if path != "/health":
                    raise _stopping()
            if method == "OPTIONS":
                self._preflight(path)
                return
            self._check_api_key(path)
            route = self._route(method, path)
            route()
        except HttpError as err:
            self._send_error(err)
        except ClientGone:
            self.close_connection = True
        except WriteTimeout as err:
            log.info("%s %s: %s; closing the connection", method, self.path, err)
            self.close_connection = True
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError):
            self.close_connection = True
        except PoolClosed:
            self._send_error(_stopping())
        except LoomError as err:
            self._send_error(from_loom_error(err))
        except Exception as err:  # the server must outlive any one request
            log.exception("request %s %s failed", method, self.path)
            self._send_error(
                HttpError(500, f"Internal error: {type(err).__name__}: {err}", type=SERVER_ERROR)
            )
        finally:
            for lease in self._leases:
                lease.release()  # the model may be unloaded from now
            self._leases, self._app = [], None  # a kept-alive connection holds no model
            self.server.request_ended()
            if self._status is not None:
                self.server.metrics.request(_endpoint_label(path), self._status)

    def send_response(self, code: int, message: str | None = None) -> None:
        """``http.server``'s status line, with the status kept for the request counter."""
        if code >= 200:  # not the interim 100 Continue
            self._status = int(code)
        super().send_response(code, message)

    def _has_body(self) -> bool:
        """Whether the request announces a body (a length other than 0, or a transfer coding)."""
        if self.headers.get("Transfer-Encoding") is not None:
            return True
        return any(v.strip() != "0" for v in self.headers.get_all("Content-Length") or ())

    def _check_reserved(self, method: str, path: str) -> None:
        """A connection accepted past the limit answers one ``GET /health`` or ``/metrics``."""
        self.close_connection = True
        if method == "GET" and path in RESERVED_PATHS:
            return
        raise overloaded(
            f"The server is serving its limit of {self.server.limits.max_connections} "
            "connections; past it, only GET /health and GET /metrics are answered.",
            fix="retry shortly; the operator can raise loom serve --max-connections",
            code="too_many_connections",
        )

    def _refuse_reserved(self) -> None:
        try:
            self.wfile.write(self.server.turn_away)
        except OSError:
            pass

    def _methods_for(self, path: str) -> tuple[str, ...]:
        allowed = ROUTES.get(path)
        if allowed is None and path.startswith("/v1/models/"):
            allowed = ("GET",)
        if allowed is None:
            raise HttpError(
                404,
                f"There is no endpoint {path!r}.",
                fix="use one of: " + ", ".join(f"{m} {p}" for p, ms in ROUTES.items() for m in ms),
                type=NOT_FOUND,
                code="not_found",
            )
        return allowed

    def _route(self, method: str, path: str) -> Callable[[], None]:
        allowed = self._methods_for(path)
        if method not in allowed:
            raise HttpError(
                405,
                f"{path} does not accept {method}; it accepts {', '.join(allowed)}.",
                fix=f"send a {' or '.join(allowed)} request",
                code="method_not_allowed",
                headers={"Allow": ", ".join(allowed)},
            )
        if path == "/":
            return lambda: self._send_bytes(200, page.html(), "text/html; charset=utf-8")
        if path == "/health":
            return self._health
        if path == "/v1/models":
            return lambda: self._send_json(200, self.server.models.cards(self.server.created))
        if path.startswith("/v1/models/"):
            model_id = path.removeprefix("/v1/models/")
            created = self.server.created
            return lambda: self._send_json(200, self.server.models.card(model_id, created))
        if path == "/v1/messages":
            return self._messages
        if path == "/metrics":
            return lambda: self._send_bytes(200, self.server.metrics.render(), METRICS_CONTENT_TYPE)
        if path == "/tokenize":
            return lambda: self._utility(utility.tokenize)
        if path == "/detokenize":
            return lambda: self._utility(utility.detokenize)
        if path == "/v1/messages/count_tokens":
            return lambda: self._utility(utility.count_tokens)
        if path == "/v1/responses":
            return self._responses
        return lambda: self._complete(chat=path == "/v1/chat/completions")

    # --- CORS and authentication ----------------------------------------------------

    def _cors_headers(self) -> dict[str, str]:
        """``Access-Control-Allow-Origin`` for an allowed ``Origin``; nothing otherwise.

        Without the header a browser keeps the answer from the page that asked,
        which is the point: only origins given with ``--allowed-origins`` may
        drive the model from a web page. (``Vary: Origin`` keeps caches honest.)
        """
        origin = self.headers.get("Origin")
        allowed = self.server.allowed_origins
        if origin is None or not allowed:
            return {}
        if "*" in allowed:
            return {"Access-Control-Allow-Origin": "*"}
        if origin in allowed:
            return {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
        return {}

    def _preflight(self, path: str) -> None:
        """Answer a CORS preflight (``OPTIONS``): which methods and headers may follow."""
        allowed = self._methods_for(path)
        cors = self._cors_headers()
        if self.headers.get("Origin") is not None and not cors:
            raise HttpError(
                403,
                f"Origin {self.headers.get('Origin')!r} may not call this server "
                f"(allowed origins: {', '.join(self.server.allowed_origins) or 'none'}).",
                fix="start loom serve with --allowed-origins naming this origin (or '*')",
                type="permission_error",
                code="origin_not_allowed",
            )
        requested = self.headers.get("Access-Control-Request-Headers")
        headers = {
            **cors,
            "Allow": ", ".join((*allowed, "OPTIONS")),
            "Access-Control-Allow-Methods": ", ".join((*allowed, "OPTIONS")),
            "Access-Control-Allow-Headers": requested or "Authorization, Content-Type",
            "Access-Control-Max-Age": PREFLIGHT_MAX_AGE,
        }
        self._send_bytes(204, b"", None, headers)

    def _check_api_key(self, path: str) -> None:
        """With ``--api-key``, every path but the page and ``/health`` needs the key.

        The key is accepted as ``Authorization: Bearer KEY`` (OpenAI clients)
        or ``x-api-key: KEY`` (Anthropic clients), compared in constant time.
        """
        key = self.server.api_key
        if key is None or path in PUBLIC_PATHS:
            return
        sent = self.headers.get("x-api-key")
        auth = self.headers.get("Authorization", "")
        if sent is None and auth[:7].lower() == "bearer ":
            sent = auth[7:].strip()
        if sent is not None and hmac.compare_digest(sent.encode(), key.encode()):
            return
        raise HttpError(
            401,
            "This server needs an API key, and the request "
            + ("sent a different one." if sent is not None else "sent none."),
            fix="send the key given to loom serve --api-key as 'Authorization: Bearer KEY'",
            type=AUTHENTICATION,
            code="invalid_api_key",
            headers={"WWW-Authenticate": 'Bearer realm="mlx-loom"'},
        )

    # --- responses ----------------------------------------------------------------

    def _send_json(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
        self._send_bytes(status, wire.dumps(body).encode("utf-8"), "application/json", headers)

    def _send_bytes(
        self,
        status: int,
        data: bytes,
        content_type: str | None,
        headers: dict[str, str] | None = None,
    ) -> None:
        if not self._body_read:
            # A body we did not read would be taken for the next request.
            self.close_connection = True
        self.send_response(status)
        if content_type is not None:
            self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for name, value in {**self._cors_headers(), **(headers or {})}.items():
            self.send_header(name, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self._started = True
        self.wfile.write(data)
        self.wfile.flush()

    def _start_stream(self) -> None:
        """Send the headers of a Server-Sent Events answer; the stream ends with the connection."""
        self.close_connection = True
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        for name, value in self._cors_headers().items():
            self.send_header(name, value)
        self.end_headers()
        self._started = True

    def _send_error(self, err: HttpError) -> None:
        if err.type == SERVER_ERROR:
            log.error("%s %s -> %d: %s", self.command, self.path, err.status, err.message)
        body = err.anthropic_body() if self._anthropic else err.body()
        try:
            if self._started:
                # Headers are out (a stream): report the error in-band, then stop.
                if self._anthropic:
                    self._sse(body, event="error")
                else:
                    self._sse(body)
                    if err.code == "server_stopping":
                        self._sse("[DONE]")  # a stream the server ends still ends properly
                self.close_connection = True
            else:
                self._send_json(err.status, body, err.headers)
        except OSError:
            self.close_connection = True

    def _health(self) -> None:
        server = self.server
        status, body = server.health()
        if server.draining:  # a load balancer stops sending requests here
            status, body["status"] = 503, "stopping"
        body["connections"] = {
            "open": server.open_connections,
            "max": server.limits.max_connections,
        }
        body["preparing"] = server.prepare_pool.running
        body["waiting_to_prepare"] = server.prepare_pool.waiting
        self._send_json(status, body)

    # --- request bodies -------------------------------------------------------------

    def _read_body(self) -> bytes:
        """The request body's bytes: its length checked first, then read under the body bound."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            raise HttpError(
                411,
                "Chunked request bodies are not supported.",
                fix="send the body with a Content-Length header",
                code="length_required",
            )
        lengths = set(self.headers.get_all("Content-Length") or ())
        raw_length = lengths.pop().strip() if len(lengths) == 1 else None
        if lengths:
            raise HttpError(
                400,
                "The request has Content-Length headers that disagree.",
                fix="send one Content-Length header",
                code="invalid_body",
            )
        if raw_length is None:
            raise HttpError(
                411,
                "The request has no Content-Length header.",
                fix="send the JSON body with a Content-Length header",
                code="length_required",
            )
        if not _DIGITS.fullmatch(raw_length):  # int() would also take "+5", "1_0", " 5 "
            raise HttpError(
                400,
                f"Content-Length {raw_length[:40]!r} is not a byte count.",
                fix="send a valid Content-Length header",
                code="invalid_body",
            )
        # More digits than the limit has is past it (and int() refuses 4,300).
        length = int(raw_length) if len(raw_length) <= len(str(MAX_BODY_BYTES)) else None
        if length is None or length > MAX_BODY_BYTES:
            raise HttpError(
                413,
                f"The request body is {raw_length[:40]} bytes; the limit is "
                f"{MAX_BODY_BYTES} bytes.",
                fix="send a shorter request",
                code="body_too_large",
            )
        if self._expects_continue:
            self.send_response_only(HTTPStatus.CONTINUE)
            self.end_headers()
        seconds = self.server.limits.body_timeout
        self._reader.expect("body", seconds)
        try:
            data = self.rfile.read(length)
        except PhaseTimeout:
            raise HttpError(
                408,
                f"The request body ({length} bytes) did not arrive within {seconds:g} s.",
                fix="send the whole body promptly (the server's --body-timeout bounds it)",
                code="request_timeout",
            ) from None
        if len(data) < length:
            raise ClientGone
        self._body_read = True
        return data

    def _prepare(self, make: Callable[[ServeApp, Any], _T]) -> _T:
        """Read the body on this thread; parse and prepare it (``make``) on the preparation pool,
        for the model the body names (leased until the request ends).

        Everything whose cost grows with the body — JSON, validation, the
        chat template, the tokenizer — runs there, never here. A server of
        several models parses first, then waits here (not on the preparation
        pool) for the named model to be loaded.
        """
        raw = self._read_body()
        run = self.server.prepare_pool.run
        large = len(raw) >= LARGE_BODY_BYTES
        models = self.server.models
        if models.single:
            app = self._use(models.default_id)
            return run(lambda: make(app, parse_body(raw)), large=large, gone=self._client_gone)
        body = run(lambda: parse_body(raw), large=large, gone=self._client_gone)
        asked = body.get("model") if isinstance(body, dict) else None
        app = self._use(models.route(asked))
        return run(lambda: make(app, body), large=large, gone=self._client_gone)

    def _use(self, model_id: str) -> ServeApp:
        """A lease on a served model: loaded first if it is not, waiting while it loads."""
        try:
            lease = self.server.pool.acquire(model_id, check=self._check_waiting)
        except EngineBusy as err:
            raise overloaded(err.message, fix=err.fix or "", code="queue_full") from None
        except EngineStopped:
            raise _stopping() from None
        except ModelUnavailable as err:
            raise HttpError(
                503, err.message, fix=err.fix, type=SERVER_ERROR, code="model_unavailable"
            ) from None
        self._leases.append(lease)
        self._app = lease.resident
        return lease.resident

    def _check_waiting(self) -> None:
        """While a model loads: stop waiting for a client that left, or a server that stops."""
        if self.server.stopping:
            raise _stopping()
        if self._client_gone():
            raise ClientGone

    def _utility(self, answer: Callable[[ServeApp, Any], dict[str, Any]]) -> None:
        """A utility endpoint (see ``utility.py``): its answer prepared off this thread."""
        self._send_json(200, self._prepare(answer))

    # --- completions ------------------------------------------------------------------

    def _client_gone(self) -> bool:
        """True when the peer is gone: its connection reset, or closed with no way to ask.

        A client that has closed its sending side (end of file) may still be
        reading: ``shutdown(SHUT_WR)`` after a request is legal, and such a
        client gets its answer. Only writing tells the two apart: a stream's
        own events do; before any answer, one interim ``100 Continue`` (which
        HTTP/1.1 clients skip) is sent, and a client that is gone answers it
        with a reset, seen here at the next look.
        """
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            if not readable:
                return False
            if self.connection.recv(1, socket.MSG_PEEK) != b"":
                return False
            if self._started or self._probed:
                # After the end of file, a reset shows only as the socket's error.
                return self.connection.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) != 0
        except (OSError, ValueError):
            return True
        if self.request_version != "HTTP/1.1":
            return True  # no interim answers before HTTP/1.1: take the end of file as gone
        self._probed = True
        try:
            self.connection.send(_PROBE, socket.MSG_DONTWAIT)
        except OSError:
            return True
        return False

    def _events(self, job: Job) -> Iterator[Piece]:
        """The job's pieces as the worker produces them; raises its error, if any."""
        waited = 0
        timing = Timing(self._arrived)
        while True:
            if self.server.stopping:
                raise _stopping()
            try:
                event = job.events.get(timeout=POLL_SECONDS)
            except queue.Empty:
                if self._client_gone():
                    raise ClientGone from None
                if not self.app.worker.alive:
                    raise HttpError(
                        503,
                        "The generation engine has stopped.",
                        type=SERVER_ERROR,
                        fix="restart the server",
                    ) from None
                continue
            if event is END:
                return
            if isinstance(event, BaseException):
                raise event
            waited += 1
            self.server.metrics.piece(timing, event)
            # Between back-to-back tokens the queue is never empty: look anyway.
            if waited % 16 == 0 and self._client_gone():
                raise ClientGone
            yield event

    def _sse(self, payload: Any, *, event: str | None = None) -> None:
        data = payload if isinstance(payload, str) else wire.dumps(payload)
        head = f"event: {event}\n" if event is not None else ""
        self.wfile.write(f"{head}data: {data}\n\n".encode())
        self.wfile.flush()

    def _submit(self, jobs: list[Job]) -> None:
        """Queue every job of a request, or none: a full queue is ``503`` with ``Retry-After``.

        A request with ``n`` choices is several jobs; when the queue fills
        part-way, the ones already queued are cancelled so no row generates
        for an answer that is never sent.
        """
        try:
            for job in jobs:
                self.app.worker.submit(job)
        except EngineBusy as err:
            for job in jobs:
                job.cancel()
            raise overloaded(err.message, fix=err.fix or "", code="queue_full") from None

    def _complete(self, *, chat: bool) -> None:
        prep = self._prepare(lambda app, body: app.prepare(body, chat=chat))
        self._submit(prep.jobs)
        try:
            if not prep.stream:
                for choice in prep.choices:
                    for piece in self._events(choice.job):
                        self.app.absorb(prep, choice, piece)
                        if choice.done:
                            break
                    if not choice.pieces:
                        raise ClientGone  # cancelled before it produced anything
                    choice.job.cancel()  # a no-op unless it was cut short
                self._send_json(200, self.app.response(prep))
                return
            # Wait for the first token before committing to 200: a failure up to
            # and through the prefill is still answered with an error status.
            events = self._events(prep.choices[0].job)
            first = next(events, None)
            if first is None:
                raise ClientGone
            self._start_stream()
            for choice in prep.choices:
                if choice.index:
                    events = self._events(choice.job)
                for chunk in self.app.first_chunks(prep, choice):
                    self._sse(chunk)
                pieces = _chain(first, events) if choice.index == 0 else events
                for piece in pieces:
                    for chunk in self.app.chunks(prep, choice, piece):
                        self._sse(chunk)
                    if choice.done:
                        break
                choice.job.cancel()
            for chunk in self.app.last_chunks(prep):
                self._sse(chunk)
            self._sse("[DONE]")
        finally:
            for job in prep.jobs:
                job.cancel()  # a no-op once a job is done; stops it if we left early

    def _messages(self) -> None:
        """``POST /v1/messages``: one Anthropic message, whole or as Anthropic's event stream."""
        prep = self._prepare(self._prepare_message)
        shaper = anthropic.MessageShaper(prep.model)
        choice = prep.choices[0]
        self._submit([choice.job])
        try:
            events = self._events(choice.job)
            if not prep.stream:
                for piece in events:
                    shaper.deltas(self.app.absorb(prep, choice, piece))
                    if choice.done:
                        break
                if not choice.pieces:
                    raise ClientGone
                last = choice.pieces[-1]
                message = shaper.message(
                    choice.finish_reason,
                    last.stop,
                    last.prompt_tokens,
                    last.cached_tokens,
                    last.generation_tokens,
                )
                self._send_json(200, message)
                return
            first = next(events, None)
            if first is None:
                raise ClientGone
            self._start_stream()
            for name, data in shaper.start(first.prompt_tokens, first.cached_tokens):
                self._sse(data, event=name)
            for piece in _chain(first, events):
                for name, data in shaper.deltas(self.app.absorb(prep, choice, piece)):
                    self._sse(data, event=name)
                if choice.done:
                    break
            last = choice.pieces[-1]
            for name, data in shaper.finish(
                choice.finish_reason, last.stop, last.generation_tokens
            ):
                self._sse(data, event=name)
        finally:
            choice.job.cancel()

    def _prepare_message(self, app: ServeApp, body: Any) -> Prepared:
        chat_body = anthropic.to_chat_body(body)
        try:
            return app.prepare(chat_body, chat=True)
        except HttpError as err:
            raise anthropic.renamed(err) from None

    def _responses(self) -> None:
        """``POST /v1/responses``: one Response, whole or as the Responses event stream."""
        asked: list[responses.ResponsesRequest] = []

        def make(app: ServeApp, body: Any) -> Prepared:
            request = responses.parse(body)
            asked.append(request)
            try:
                return app.prepare(responses.to_chat_body(request), chat=True)
            except HttpError as err:
                raise responses.renamed(err) from None

        prep = self._prepare(make)
        shaper = responses.ResponseShaper(asked[0], prep.model)
        choice = prep.choices[0]
        self._submit([choice.job])
        try:
            events = self._events(choice.job)
            if not prep.stream:
                for piece in events:
                    shaper.deltas(self.app.absorb(prep, choice, piece))
                    if choice.done:
                        break
                if not choice.pieces:
                    raise ClientGone
                last = choice.pieces[-1]
                self._send_json(
                    200,
                    shaper.response(
                        choice.finish_reason,
                        last.prompt_tokens,
                        last.cached_tokens,
                        last.generation_tokens,
                    ),
                )
                return
            first = next(events, None)
            if first is None:
                raise ClientGone
            self._start_stream()
            for name, data in shaper.start():
                self._sse(data, event=name)
            try:
                for piece in _chain(first, events):
                    for name, data in shaper.deltas(self.app.absorb(prep, choice, piece)):
                        self._sse(data, event=name)
                    if choice.done:
                        break
            except (HttpError, LoomError) as err:
                failure = err if isinstance(err, HttpError) else from_loom_error(err)
                for name, data in shaper.error(failure):
                    self._sse(data, event=name)
                return
            last = choice.pieces[-1]
            for name, data in shaper.finish(
                choice.finish_reason, last.prompt_tokens, last.cached_tokens, last.generation_tokens
            ):
                self._sse(data, event=name)
        finally:
            choice.job.cancel()


def parse_body(raw: bytes) -> Any:
    """The request body as JSON, under the request bounds; anything else is a 400."""
    fix = "send a UTF-8 JSON object, with Content-Type: application/json"
    try:
        return parse_json(
            raw, source="The request body", error=RequestError, fix=fix, limits=REQUEST_JSON
        )
    except RequestError as exc:
        raise HttpError(400, exc.message, fix=fix, code="invalid_json") from None


def _request_path(target: str) -> str:
    """The path of a request target (origin or absolute form), without trailing slashes.

    ``urlsplit`` raises ``ValueError`` for an absolute target with a broken
    host (``http://[::1``): that is the client's error, a 400.
    """
    try:
        path = urlsplit(target).path
    except ValueError as exc:
        raise HttpError(
            400,
            f"The request target {target[:100]!r} is not a valid URL: {exc}.",
            fix="send a path such as /v1/chat/completions",
            code="invalid_path",
        ) from None
    return path.rstrip("/") or "/"


def _endpoint_label(path: str) -> str:
    """The ``endpoint`` label of a request: a served path, or one word for every other."""
    if path in ROUTES:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{model}"
    return UNMATCHED


def _chain(first: Piece, rest: Iterator[Piece]) -> Iterator[Piece]:
    yield first
    yield from rest


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _stopping() -> HttpError:
    return HttpError(
        503,
        "The server is stopping.",
        fix="retry once it is back (or at another replica)",
        type=SERVER_ERROR,
        code="server_stopping",
        headers={"Retry-After": "1"},
    )


def _client_key(client_address: Any) -> str:
    """The address a connection comes from (its host, without the port)."""
    if isinstance(client_address, tuple) and client_address:
        return str(client_address[0])
    return str(client_address)


def _too_many_connections(limit: int, *, per_client: bool = False) -> bytes:
    """The whole answer (status line, headers, JSON body) for a connection over the limit."""
    if per_client:
        error = overloaded(
            f"This client address holds its limit of {limit} connections to the server.",
            fix="reuse or close connections; the operator can raise loom serve "
            "--max-connections-per-client",
            code="too_many_connections",
        )
    else:
        error = overloaded(
            f"The server is serving its limit of {limit} connections.",
            fix="retry shortly; the operator can raise loom serve --max-connections",
            code="too_many_connections",
        )
    body = json.dumps(error.body()).encode()
    headers = {
        "Content-Type": "application/json",
        "Content-Length": str(len(body)),
        **error.headers,
        "Connection": "close",
    }
    head = "HTTP/1.1 503 Service Unavailable\r\n"
    head += "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    return (head + "\r\n").encode() + body


def _summed(field: dataclasses.Field[Any], values: Iterable[int | None]) -> int | None:
    """The sum over engines; an optional figure no engine sets (a budget) stays unset."""
    present = [v for v in values if v is not None]
    if not present and field.default is None:
        return None
    return sum(present)


class LoomServer(ThreadingHTTPServer):
    """An HTTP server bound to ``(host, port)`` serving one :class:`ServeApp`.

    ``port=0`` binds an ephemeral port; read the chosen one from :attr:`port`.
    Handler threads are daemons: a hung client never blocks shutdown.
    ``limits`` bounds each request phase and the open connections (see
    ``connection.py``); ``tokenizer_threads`` sizes the pool that parses,
    renders and tokenizes requests (see ``prepare.py``).
    """

    daemon_threads = True
    #: The listen backlog. socketserver's default (5) overflows when a burst of
    #: clients connects at once, as they do to a batching server, and the
    #: kernel then resets some of those connections.
    request_queue_size = 128

    def __init__(
        self,
        models: ServedModels,
        host: str = "127.0.0.1",
        port: int = 8080,
        *,
        allowed_origins: Iterable[str] = (),
        api_key: str | None = None,
        limits: ConnectionLimits | None = None,
        tokenizer_threads: int = DEFAULT_TOKENIZER_THREADS,
    ) -> None:
        #: The served models: which one a request names, and their cards.
        self.models = models
        #: Which of them are resident (loads, unloads, leases).
        self.pool = models.pool
        self.created = int(time.time())
        #: Origins whose web pages may call the API (``"*"``: any); none by default.
        self.allowed_origins = tuple(allowed_origins)
        if api_key is not None and not api_key.strip():
            raise ServerStartError(
                "The API key is empty.", fix="pass a non-empty --api-key, or none at all"
            )
        if (
            isinstance(tokenizer_threads, bool)
            or not isinstance(tokenizer_threads, int)
            or tokenizer_threads < 1
        ):
            raise ServerStartError(
                f"tokenizer_threads={tokenizer_threads!r} is invalid; it must be an int >= 1.",
                fix="pass a small positive --tokenizer-threads, such as 2",
            )
        #: Requests must carry this key (``Authorization: Bearer``); ``None``: no key.
        self.api_key = api_key
        self.limits = limits or ConnectionLimits()
        self._open = 0
        self._reserved: set[int] = set()  # ids of the sockets accepted past the limit
        self._per_client: dict[str, int] = {}
        self._open_lock = threading.Lock()
        self._active = 0  # requests being handled
        self._draining = threading.Event()  # no new requests: answered 503
        self._stopping = threading.Event()  # the grace is over: answers in flight end now
        self.turn_away = _too_many_connections(self.limits.max_connections)
        self._turn_away_client = _too_many_connections(
            self.limits.max_connections_per_client, per_client=True
        )
        self._refused = 0
        self._refusals_logged_at = -REFUSAL_LOG_SECONDS
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._thread: threading.Thread | None = None
        try:
            super().__init__((host, port), Handler)
        except OSError as exc:
            raise ServerStartError(
                f"Cannot listen on {host}:{port}: {exc.strerror or exc}.",
                fix="choose another --port (or --port 0 for any free one), or stop the "
                "process using this one",
            ) from exc
        self.prepare_pool = PreparePool(tokenizer_threads)
        #: What ``GET /metrics`` reports (a registry of this server's own).
        self.metrics = ServerMetrics(self.stats, lambda: self.open_connections)
        self._check_bounds_compose()

    @property
    def app(self) -> ServeApp:
        """The default (first) model's app, loaded if it is not."""
        default = self.models.default_id
        return self.pool.resident(default) or self.pool.load(default)

    def stats(self) -> ServiceStats:
        """Every resident model's engine figures, summed (what ``/metrics`` reports)."""
        snapshots = [app.worker.stats() for app in self.pool.residents()]
        engine = EngineStats(
            **{  # type: ignore[arg-type]  # each field keeps its own type (see _summed)
                f.name: _summed(f, (getattr(s.engine, f.name) for s in snapshots))
                for f in dataclasses.fields(EngineStats)
            }
        )
        return ServiceStats(
            engine=engine,
            submitted=sum(s.submitted for s in snapshots),
            running=any(s.running for s in snapshots),
        )

    def health(self) -> tuple[int, dict[str, Any]]:
        """``(status, body)`` of ``GET /health``: the default model's figures at the top
        (as a single-model server has always answered), then each served model's state,
        bytes and last use under ``models``."""
        default = self.pool.resident(self.models.default_id)
        if default is not None:
            status, body = default.health()
        else:
            status, body = 200, {"status": "ok", "model": self.models.default_id}
        models = statuses_json(self.pool.status())
        for entry in models:
            app = self.pool.resident(str(entry["id"]))
            if app is not None and len(models) > 1:
                _, detail = app.health()
                entry.update(  # type: ignore[attr-defined]
                    {k: detail[k] for k in ("busy", "queued", "active_rows", "prompt_cache")}
                )
        body["models"] = models
        body["memory"] = {
            "bytes": self.pool.memory_in_use(),
            "max_bytes": self.pool.max_memory,
            "max_loaded_models": self.pool.max_loaded,
            "keep_alive_seconds": self.pool.keep_alive,
        }
        return status, body

    def _check_bounds_compose(self) -> None:
        """Warn when the connection limit makes the engine's queue bound unreachable.

        Every row and every waiting request holds a connection, so with fewer
        connections than rows plus queue the connection limit answers first.
        Both answer ``503`` with ``Retry-After``, so this is not an error; but
        the operator set a queue size that never applies.
        """
        app = self.pool.resident(self.models.default_id)
        if app is None:
            return
        settings = app.worker.service.settings
        if settings.max_queued is None:
            return
        held = settings.decode_concurrency + settings.max_queued
        if self.limits.max_connections <= held:
            log.warning(
                "--max-connections %d is not above --decode-concurrency %d + --queue-size %d: "
                "connections are refused before the queue fills (both answer 503)",
                self.limits.max_connections,
                settings.decode_concurrency,
                settings.max_queued,
            )

    # --- the connection limit ---------------------------------------------------

    @property
    def open_connections(self) -> int:
        """Connections being served now (each has its handler thread), reserved ones included."""
        return self._open + len(self._reserved)

    def is_reserved(self, request: Any) -> bool:
        """Whether ``request`` (a socket) was accepted past the limit, for health checks only."""
        return id(request) in self._reserved

    def process_request(self, request: Any, client_address: Any) -> None:
        """Start a handler thread, or, past the limits, answer 503 and close.

        A client address at ``max_connections_per_client`` is refused; past
        ``max_connections``, :data:`RESERVED_CONNECTIONS` more are accepted
        for health checks only. The refusal is written without blocking from
        the accepting thread, so a flood of connections costs no threads.
        """
        client = _client_key(client_address)
        refusal = None
        with self._open_lock:
            if self._per_client.get(client, 0) >= self.limits.max_connections_per_client:
                refusal = self._turn_away_client
            elif self._open < self.limits.max_connections:
                self._open += 1
            elif len(self._reserved) < RESERVED_CONNECTIONS:
                self._reserved.add(id(request))
            else:
                refusal = self.turn_away
            if refusal is None:
                self._per_client[client] = self._per_client.get(client, 0) + 1
        if refusal is not None:
            refuse_connection(request, refusal)
            self._log_refusal()
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._closed_one(request, client_address)  # its thread never started
            raise

    def _log_refusal(self) -> None:
        """One warning per burst of refused connections, not one per connection (a flood)."""
        self._refused += 1
        now = time.monotonic()
        if now - self._refusals_logged_at >= REFUSAL_LOG_SECONDS:
            log.warning(
                "refused %d connection(s): %d are open, the limit (--max-connections)",
                self._refused,
                self.limits.max_connections,
            )
            self._refused = 0
            self._refusals_logged_at = now

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._closed_one(request, client_address)

    def _closed_one(self, request: Any, client_address: Any) -> None:
        client = _client_key(client_address)
        with self._open_lock:
            if id(request) in self._reserved:
                self._reserved.discard(id(request))
            else:
                self._open -= 1
            left = self._per_client.get(client, 1) - 1
            if left > 0:
                self._per_client[client] = left
            else:
                self._per_client.pop(client, None)

    @property
    def host(self) -> str:
        return str(self.server_address[0])

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def loopback_only(self) -> bool:
        return _is_loopback(self.host)

    # --- requests in flight, and draining them -------------------------------------

    def request_started(self) -> None:
        with self._open_lock:
            self._active += 1

    def request_ended(self) -> None:
        with self._open_lock:
            self._active -= 1

    @property
    def active_requests(self) -> int:
        return self._active

    @property
    def draining(self) -> bool:
        """True once :meth:`drain` began: new requests are answered ``503 server_stopping``."""
        return self._draining.is_set()

    @property
    def stopping(self) -> bool:
        """True once the grace is over: answers in flight end with an error event."""
        return self._stopping.is_set()

    def drain(self, grace: float) -> bool:
        """Stop accepting, let requests in flight finish for ``grace`` seconds, end the rest.

        Call it once :meth:`serve_forever` has returned (or from another
        thread). Streams still running at the end of the grace get an error
        event (``server_stopping``) and, in the OpenAI shape, ``data: [DONE]``;
        a whole answer not yet sent is a ``503``. Then the engine stops.
        Returns whether every request finished within the grace.
        """
        self._draining.set()
        if self._thread is not None:
            self.shutdown()
            self._thread.join(10)
            self._thread = None
        self.server_close()  # new connections are refused by the system from here
        finished = self._wait_idle(grace)
        if not finished:
            self._stopping.set()
            self._wait_idle(_END_SECONDS)
        self.prepare_pool.close()
        self.pool.close()
        return finished

    def _wait_idle(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while self._active > 0:
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_SECONDS)
        return True

    def serve_until_signalled(self, grace: float = DEFAULT_SHUTDOWN_GRACE) -> None:
        """Serve on this (the main) thread until SIGTERM or SIGINT, then :meth:`drain`.

        On another thread no handler can be installed: it serves until
        :meth:`shutdown`, then drains with no grace.

        SIGTERM (``docker stop``, systemd) drains with ``grace`` seconds for
        requests in flight; SIGINT (Ctrl-C) ends them at once, cleanly. A
        second signal while draining is not waited on: the process ends then.
        """
        chosen: list[float] = []

        def on_signal(signum: int, frame: Any) -> None:
            if chosen:  # a second signal: the operator does not want to wait
                raise KeyboardInterrupt
            chosen.append(grace if signum == signal.SIGTERM else 0.0)
            log.warning(
                "%s: stopping; requests in flight get %g s to finish",
                signal.Signals(signum).name,
                chosen[0],
            )
            # shutdown() waits for serve_forever, which runs on this very thread.
            threading.Thread(target=self.shutdown, daemon=True).start()

        previous: dict[signal.Signals, Any] = {}
        if threading.current_thread() is threading.main_thread():  # only it may set handlers
            previous = {
                sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)
            }
        try:
            try:
                self.serve_forever()
            except KeyboardInterrupt:  # raised by other means than the handler: as SIGINT
                chosen.append(0.0)
            self.drain(chosen[0] if chosen else 0.0)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def start_in_background(self) -> threading.Thread:
        """Serve on a daemon thread (for embedding and tests); stop with :meth:`stop`."""
        self._thread = threading.Thread(target=self.serve_forever, name="loom-http", daemon=True)
        self._thread.start()
        return self._thread

    def stop(self) -> None:
        """Stop serving, close the socket, and stop the generation worker."""
        if self._thread is not None:
            self.shutdown()
            self._thread.join(10)
            self._thread = None
        self.server_close()
        self.prepare_pool.close()
        self.pool.close()


def make_server(
    model: Any = None,
    tokenizer: Any = None,
    *,
    models: Sequence[ServedModel] | None = None,
    max_loaded_models: int | None = None,
    max_memory: int | None = None,
    keep_alive: float | None = None,
    host: str = "127.0.0.1",
    port: int = 8080,
    model_id: str | None = None,
    max_tokens_limit: int | None = None,
    engine: EngineSettings | None = None,
    allowed_origins: Iterable[str] = (),
    api_key: str | None = None,
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
    header_timeout: float = DEFAULT_HEADER_TIMEOUT,
    body_timeout: float = DEFAULT_BODY_TIMEOUT,
    write_timeout: float = DEFAULT_WRITE_TIMEOUT,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    max_connections_per_client: int = DEFAULT_MAX_CONNECTIONS_PER_CLIENT,
    tokenizer_threads: int = DEFAULT_TOKENIZER_THREADS,
    **app_options: Any,
) -> LoomServer:
    """A server for a loaded ``(model, tokenizer)``, or for several ``models``; bound, not
    yet serving.

    ``models`` (:class:`~mlx_loom.serve.models.ServedModel`) are served behind
    one door, the first one loaded now (its errors fail start-up), the others
    on their first request; ``max_loaded_models``, ``max_memory`` (bytes) and
    ``keep_alive`` (seconds) bound which stay resident
    (:class:`~mlx_loom.engine.pool.ModelPool`). ``app_options`` are every
    model's unless its own ``options`` say otherwise.

    ``engine`` sets how requests are batched (default:
    :func:`~mlx_loom.serve.app.server_engine_settings`). The timeouts
    (seconds) and ``max_connections`` bound each connection (see
    :class:`~mlx_loom.serve.connection.ConnectionLimits`);
    ``tokenizer_threads`` sizes the pool that parses, renders and tokenizes
    requests. ``app_options`` are :class:`ServeApp`'s (``template_budget``,
    ``max_prompt_chars``, ``max_prompt_tokens``, ``tool_call_parser``,
    ``chat_template_args``, ``kv_bits``, ``speculation`` ...); the template
    budget defaults to the environment's
    (:meth:`~mlx_loom.text.TemplateBudget.from_env`). ``speculation`` is every
    request's speculative decoding unless a request's ``draft`` field asks
    otherwise (speculative rows batch with every other request).
    """
    try:
        limits = ConnectionLimits(
            idle_timeout=idle_timeout,
            header_timeout=header_timeout,
            body_timeout=body_timeout,
            write_timeout=write_timeout,
            max_connections=max_connections,
            max_connections_per_client=max_connections_per_client,
        )
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        name = str(first["loc"][0]) if first["loc"] else "limits"
        raise ServerStartError(
            f"{name}={first.get('input')!r} is invalid: {first['msg']}.",
            fix=f"pass --{name.replace('_', '-')} as a positive number",
        ) from None
    if max_tokens_limit is not None:
        app_options["max_tokens_limit"] = max_tokens_limit
    engine = engine or server_engine_settings()
    if models is None:
        if model is None or tokenizer is None:
            raise ServerStartError(
                "make_server needs a model and its tokenizer, or models.",
                fix="pass make_server(model, tokenizer) or make_server(models=[ServedModel(...)])",
            )
        loaded = (model, tokenizer)
        models = [
            ServedModel(
                model_id or model.model_dir.name,
                lambda: loaded,
                lambda: checkpoint_bytes(model.model_dir),
            )
        ]
    elif model is not None:
        raise ServerStartError(
            "make_server was given both a model and models.",
            fix="pass the model as one of models",
        )
    common = {"engine": engine, **app_options}
    try:
        pool = ModelPool(
            [m.pooled(common) for m in models],
            max_loaded=max_loaded_models,
            max_memory=max_memory,
            keep_alive=keep_alive,
            max_waiting=engine.max_queued,
        )
    except RequestError as err:
        raise ServerStartError(err.message, fix=err.fix) from None
    try:
        pool.load(pool.default_id)  # the first model's errors fail start-up
    except ModelUnavailable as err:
        pool.close()
        cause = err.cause
        if isinstance(cause, LoomError):
            raise cause from None  # as a single-model server has always raised it
        raise
    served = ServedModels(models, pool)
    try:
        return LoomServer(
            served,
            host,
            port,
            allowed_origins=allowed_origins,
            api_key=api_key,
            limits=limits,
            tokenizer_threads=tokenizer_threads,
        )
    except BaseException:
        pool.close()
        raise
