"""The HTTP server: ``ThreadingHTTPServer`` routing to a :class:`ServeApp`.

Each connection gets a handler thread; handler threads parse, validate and
write, and hand generation to the model's engine thread (see
``worker.py``), which batches concurrent requests. So ``/health`` and
``/v1/models`` answer at once while generations run, and a request waiting
for a row costs no MLX work.

Every answer the server gives to a bad request is JSON in the OpenAI error
shape; no input makes a handler raise past :meth:`Handler._dispatch`.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import queue
import select
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from ..bounded_json import REQUEST_JSON, parse_json
from ..engine import EngineSettings
from ..errors import EngineBusy, LoomError, RequestError
from . import anthropic, page
from .app import ServeApp
from .errors import (
    AUTHENTICATION,
    NOT_FOUND,
    SERVER_ERROR,
    HttpError,
    ServerStartError,
    from_loom_error,
)
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
    "/": ("GET",),
    "/health": ("GET",),
    "/v1/models": ("GET",),
    "/v1/completions": ("POST",),
    "/v1/chat/completions": ("POST",),
    "/v1/messages": ("POST",),
}

#: mlx_lm.server also answers these paths without the ``/v1`` prefix.
ALIASES = {"/chat/completions": "/v1/chat/completions", "/completions": "/v1/completions"}

#: Paths anyone may read even when the server has an API key: the chat page
#: (it asks for the key itself) and the health check (load balancers).
PUBLIC_PATHS = frozenset({"/", "/health"})

#: How long a browser may cache a CORS preflight answer.
PREFLIGHT_MAX_AGE = "600"


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

    def do_OPTIONS(self) -> None:  # noqa: N802
        self._dispatch("OPTIONS")

    @property
    def app(self) -> ServeApp:
        return self.server.app

    def _dispatch(self, method: str) -> None:
        self._started = False  # have the status line and headers been sent?
        self._body_read = method != "POST"
        self._anthropic = False  # answer errors in the Anthropic shape (/v1/messages)
        try:
            path = urlsplit(self.path).path
            path = path.rstrip("/") or "/"
            path = ALIASES.get(path, path)
            self._anthropic = path == "/v1/messages"
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
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError):
            self.close_connection = True
        except LoomError as err:
            self._send_error(from_loom_error(err))
        except Exception as err:  # the server must outlive any one request
            log.exception("request %s %s failed", method, self.path)
            self._send_error(
                HttpError(500, f"Internal error: {type(err).__name__}: {err}", type=SERVER_ERROR)
            )

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
            return lambda: self._send_json(200, self.app.models())
        if path.startswith("/v1/models/"):
            model_id = path.removeprefix("/v1/models/")
            return lambda: self._send_json(200, self.app.model_card(model_id))
        if path == "/v1/messages":
            return self._messages
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
        self._send_bytes(status, json.dumps(body).encode("utf-8"), "application/json", headers)

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
        if err.status >= 500:
            log.error("%s %s -> %d: %s", self.command, self.path, err.status, err.message)
        body = err.anthropic_body() if self._anthropic else err.body()
        try:
            if self._started:
                # Headers are out (a stream): report the error in-band, then stop.
                if self._anthropic:
                    self._sse(body, event="error")
                else:
                    self._sse(body)
                self.close_connection = True
            else:
                self._send_json(err.status, body, err.headers)
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
        fix = "send a UTF-8 JSON object, with Content-Type: application/json"
        try:
            return parse_json(
                data, source="The request body", error=RequestError, fix=fix, limits=REQUEST_JSON
            )
        except RequestError as exc:
            raise HttpError(400, exc.message, fix=fix, code="invalid_json") from None

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

    def _sse(self, payload: Any, *, event: str | None = None) -> None:
        data = payload if isinstance(payload, str) else json.dumps(payload)
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
            raise HttpError(
                503,
                err.message,
                fix=err.fix,
                type=SERVER_ERROR,
                code="queue_full",
                headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            ) from None

    def _complete(self, *, chat: bool) -> None:
        body = self._read_json()
        prep = self.app.prepare(body, chat=chat)
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
        chat_body = anthropic.to_chat_body(self._read_json())
        try:
            prep = self.app.prepare(chat_body, chat=True)
        except HttpError as err:
            raise anthropic.renamed(err) from None
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

    def __init__(
        self,
        app: ServeApp,
        host: str = "127.0.0.1",
        port: int = 8080,
        *,
        allowed_origins: Iterable[str] = (),
        api_key: str | None = None,
    ) -> None:
        self.app = app
        #: Origins whose web pages may call the API (``"*"``: any); none by default.
        self.allowed_origins = tuple(allowed_origins)
        if api_key is not None and not api_key.strip():
            raise ServerStartError(
                "The API key is empty.", fix="pass a non-empty --api-key, or none at all"
            )
        #: Requests must carry this key (``Authorization: Bearer``); ``None``: no key.
        self.api_key = api_key
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
    allowed_origins: Iterable[str] = (),
    api_key: str | None = None,
    **app_options: Any,
) -> LoomServer:
    """A server for a loaded ``(model, tokenizer)``, bound but not yet serving.

    ``engine`` sets how requests are batched (default:
    :func:`~mlx_loom.serve.app.server_engine_settings`). ``app_options`` are
    :class:`ServeApp`'s (``template_budget``, ``tool_call_parser``,
    ``chat_template_args``, ``kv_bits``, ``speculation`` ...); the template
    budget defaults to the environment's
    (:meth:`~mlx_loom.text.TemplateBudget.from_env`). ``speculation`` is every
    request's speculative decoding unless a request's ``draft`` field asks
    otherwise (speculative rows batch with every other request).
    """
    if max_tokens_limit is not None:
        app_options["max_tokens_limit"] = max_tokens_limit
    app = ServeApp(model, tokenizer, model_id=model_id, engine=engine, **app_options)
    try:
        return LoomServer(app, host, port, allowed_origins=allowed_origins, api_key=api_key)
    except BaseException:
        app.close()
        raise
