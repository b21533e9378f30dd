"""The HTTP server: ``ThreadingHTTPServer`` routing to a :class:`ServeApp`.

Each connection gets a handler thread; handler threads parse, validate and
write, and hand generation to the app's single worker thread (see
``worker.py``). So ``/health`` and ``/v1/models`` answer at once while a
generation runs, and a request waiting for its turn costs no MLX work.

Every answer the server gives to a bad request is JSON in the OpenAI error
shape; no input makes a handler raise past :meth:`Handler._dispatch`.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import queue
import select
import socket
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from ..engine import EngineSettings, Speculation
from ..errors import EngineBusy, LoomError
from .app import ServeApp
from .errors import NOT_FOUND, SERVER_ERROR, HttpError, ServerStartError, from_loom_error
from .worker import END, Job, Piece

log = logging.getLogger("mlx_loom.serve")

#: Largest request body accepted; a chat history this big is far beyond any
#: context window, and reading unbounded bodies would let one client exhaust memory.
MAX_BODY_BYTES = 8 * 1024 * 1024

#: How often a handler waiting for tokens checks that its client is still there.
POLL_SECONDS = 0.05

#: Seconds a client told the queue is full should wait before retrying.
RETRY_AFTER_SECONDS = 1

ROUTES: dict[str, tuple[str, ...]] = {
    "/health": ("GET",),
    "/v1/models": ("GET",),
    "/v1/completions": ("POST",),
    "/v1/chat/completions": ("POST",),
}


class ClientGone(Exception):
    """The client closed its connection; stop working for it."""


class Handler(BaseHTTPRequestHandler):
    """One HTTP request. ``self.server`` is the :class:`LoomServer`."""

    server: LoomServer
    protocol_version = "HTTP/1.1"
    server_version = "mlx-loom"
    sys_version = ""

    # --- plumbing ---------------------------------------------------------------

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

    @property
    def app(self) -> ServeApp:
        return self.server.app

    def _dispatch(self, method: str) -> None:
        self._started = False  # have the status line and headers been sent?
        self._body_read = method != "POST"
        try:
            path = urlsplit(self.path).path
            path = path.rstrip("/") or "/"
            route = self._route(method, path)
            route()
        except HttpError as err:
            self._send_error(err)
        except ClientGone:
            self.close_connection = True
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError):
            self.close_connection = True
        except LoomError as err:
            self._send_error(from_loom_error(err))
        except Exception as err:  # the server must outlive any one request
            log.exception("request %s %s failed", method, self.path)
            self._send_error(
                HttpError(500, f"Internal error: {type(err).__name__}: {err}", type=SERVER_ERROR)
            )

    def _route(self, method: str, path: str) -> Callable[[], None]:
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
        if method not in allowed:
            raise HttpError(
                405,
                f"{path} does not accept {method}; it accepts {', '.join(allowed)}.",
                fix=f"send a {' or '.join(allowed)} request",
                code="method_not_allowed",
                headers={"Allow": ", ".join(allowed)},
            )
        if path == "/health":
            return self._health
        if path == "/v1/models":
            return lambda: self._send_json(200, self.app.models())
        if path.startswith("/v1/models/"):
            model_id = path.removeprefix("/v1/models/")
            return lambda: self._send_json(200, self.app.model_card(model_id))
        return lambda: self._complete(chat=path == "/v1/chat/completions")

    # --- responses ----------------------------------------------------------------

    def _send_json(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode("utf-8")
        if not self._body_read:
            # A body we did not read would be taken for the next request.
            self.close_connection = True
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self._started = True
        self.wfile.write(data)
        self.wfile.flush()

    def _send_error(self, err: HttpError) -> None:
        if err.status >= 500:
            log.error("%s %s -> %d: %s", self.command, self.path, err.status, err.message)
        try:
            if self._started:
                # Headers are out (a stream): report the error in-band, then stop.
                self._sse(err.body())
                self.close_connection = True
            else:
                self._send_json(err.status, err.body(), err.headers)
        except OSError:
            self.close_connection = True

    def _health(self) -> None:
        status, body = self.app.health()
        self._send_json(status, body)

    # --- request bodies -------------------------------------------------------------

    def _read_json(self) -> Any:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            raise HttpError(
                411,
                "Chunked request bodies are not supported.",
                fix="send the body with a Content-Length header",
                code="length_required",
            )
        raw_length = self.headers.get("Content-Length")
        if raw_length is None:
            raise HttpError(
                411,
                "The request has no Content-Length header.",
                fix="send the JSON body with a Content-Length header",
                code="length_required",
            )
        try:
            length = int(raw_length)
            if length < 0:
                raise ValueError
        except ValueError:
            raise HttpError(
                400,
                f"Content-Length {raw_length!r} is not a byte count.",
                fix="send a valid Content-Length header",
                code="invalid_body",
            ) from None
        if length > MAX_BODY_BYTES:
            raise HttpError(
                413,
                f"The request body is {length} bytes; the limit is {MAX_BODY_BYTES} bytes.",
                fix="send a shorter request",
                code="body_too_large",
            )
        data = self.rfile.read(length)
        if len(data) < length:
            raise ClientGone
        self._body_read = True
        try:
            return json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise HttpError(
                400,
                f"The request body is not valid JSON: {exc}.",
                fix="send a UTF-8 JSON object, with Content-Type: application/json",
                code="invalid_json",
            ) from None

    # --- completions ------------------------------------------------------------------

    def _client_gone(self) -> bool:
        """True when the peer has closed its end (readable with nothing to read)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            if not readable:
                return False
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _events(self, job: Job) -> Iterator[Piece]:
        """The job's pieces as the worker produces them; raises its error, if any."""
        waited = 0
        while True:
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
            # Between back-to-back tokens the queue is never empty: look anyway.
            if waited % 16 == 0 and self._client_gone():
                raise ClientGone
            yield event

    def _sse(self, payload: Any) -> None:
        data = payload if isinstance(payload, str) else json.dumps(payload)
        self.wfile.write(f"data: {data}\n\n".encode())
        self.wfile.flush()

    def _complete(self, *, chat: bool) -> None:
        body = self._read_json()
        prep = self.app.prepare(body, chat=chat)
        job = prep.job
        try:
            self.app.worker.submit(job)
        except EngineBusy as err:
            raise HttpError(
                503,
                err.message,
                fix=err.fix,
                type=SERVER_ERROR,
                code="queue_full",
                headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            ) from None
        try:
            events = self._events(job)
            if not prep.stream:
                prep.pieces.extend(events)
                if not prep.pieces:
                    raise ClientGone  # cancelled before it produced anything
                self._send_json(200, self.app.response(prep))
                return
            # Wait for the first token before committing to 200: a failure up to
            # and through the prefill is still answered with an error status.
            first = next(events, None)
            if first is None:
                raise ClientGone
            self.close_connection = True  # the stream ends when the connection does
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            self._started = True
            for chunk in self.app.first_chunks(prep):
                self._sse(chunk)
            for piece in _chain(first, events):
                for chunk in self.app.chunks(prep, piece):
                    self._sse(chunk)
            self._sse("[DONE]")
        finally:
            job.cancel()  # a no-op once the job is done; stops it if we left early


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


class LoomServer(ThreadingHTTPServer):
    """An HTTP server bound to ``(host, port)`` serving one :class:`ServeApp`.

    ``port=0`` binds an ephemeral port; read the chosen one from :attr:`port`.
    Handler threads are daemons: a hung client never blocks shutdown.
    """

    daemon_threads = True
    #: The listen backlog. socketserver's default (5) overflows when a burst of
    #: clients connects at once, as they do to a batching server, and the
    #: kernel then resets some of those connections.
    request_queue_size = 128

    def __init__(self, app: ServeApp, host: str = "127.0.0.1", port: int = 8080) -> None:
        self.app = app
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
        self.app.close()


def make_server(
    model: Any,
    tokenizer: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 8080,
    model_id: str | None = None,
    max_tokens_limit: int | None = None,
    engine: EngineSettings | None = None,
    speculation: Speculation | None = None,
) -> LoomServer:
    """A server for a loaded ``(model, tokenizer)``, bound but not yet serving.

    ``engine`` sets how requests are batched (default:
    :func:`~mlx_loom.serve.app.server_engine_settings`); ``speculation`` is
    every request's speculative decoding unless a request's ``draft`` field
    asks otherwise (speculative rows batch with every other request).
    """
    options = {} if max_tokens_limit is None else {"max_tokens_limit": max_tokens_limit}
    app = ServeApp(
        model, tokenizer, model_id=model_id, engine=engine, speculation=speculation, **options
    )
    try:
        return LoomServer(app, host, port)
    except BaseException:
        app.close()
        raise
