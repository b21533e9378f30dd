"""Clients that hold connections: each is bounded in time, and none holds a thread for long.

Before the deadlines and the connection limit, each of these held a handler
thread forever: 1,000 idle half-open connections held 1,010 threads; an
HTTP/0.9 request line (``GET /``) was never answered; a client trickling its
headers (slowloris), sending half a body, or never reading its stream kept
its thread (and, for the stream, its generation) as long as it liked.

Every case uses a real socket against a server with short deadlines (half a
second each) and asserts the answer, the time it took, and that the server
let go of the connection.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

import mlx_loom
from mlx_loom.testing.checkpoints import write_checkpoint

from ..server.conftest import serve

DEADLINE = 0.5  # every phase's bound in these servers, seconds
MAX_CONNECTIONS = 8
#: Slack for a shared, loaded machine: an answer due at the deadline may come this much later.
SLACK = 4.0
#: The unread stream's length: far more tokens than the socket buffers hold.
MAX_TOKENS = 4000


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory):
    """The tiny Llama with a 4096-token context, so one generation can run for seconds."""
    claim = mlx_loom.default_host().registry.model_types["llama"]
    config = {**claim.tiny_config, "max_position_embeddings": 4096}
    path = write_checkpoint(
        tmp_path_factory.mktemp("long") / "llama", config, claim.checkpoint_tensors(config)
    )
    return mlx_loom.load(path)


LIMITS = dict(
    idle_timeout=DEADLINE,
    header_timeout=DEADLINE,
    body_timeout=DEADLINE,
    write_timeout=DEADLINE,
    max_connections=MAX_CONNECTIONS,
)


@pytest.fixture(scope="module")
def bounded(long_context_model):
    model, tokenizer = long_context_model
    yield from serve(model, tokenizer, max_tokens_limit=4000, **LIMITS)


def connect(client, *, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(DEADLINE + SLACK + 5)
    sock.connect(("127.0.0.1", client.port))
    return sock


def read_to_close(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    out = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return out
        if not chunk:
            return out
        out += chunk


def json_answer(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    assert b"Content-Type: application/json" in head, head
    return status, json.loads(body)


def wait_until_released(client, seconds: float) -> None:
    """Wait (bounded) until the server holds no connection but the ones asking about it."""
    deadline = time.monotonic() + seconds
    while client.server.open_connections > 0:
        assert time.monotonic() < deadline, (
            f"{client.server.open_connections} connections still open after {seconds} s"
        )
        time.sleep(0.02)


@pytest.mark.parametrize("line", [b"GET /\r\n", b"GET /health\r\n", b"POST /v1/completions\r\n"])
def test_an_http_09_request_line_is_answered_505_and_closed(bounded, line):
    sock = connect(bounded)
    started = time.monotonic()
    sock.sendall(line)
    raw = read_to_close(sock)
    elapsed = time.monotonic() - started
    status, body = json_answer(raw)
    assert raw.startswith(b"HTTP/1.1 505 ")
    assert status == 505 and body["error"]["code"] == "http_version_not_supported"
    assert "HTTP/0.9" in body["error"]["message"] and body["error"]["fix"]
    # Answered at once, not when the header deadline ran out.
    assert elapsed < DEADLINE, elapsed


@pytest.mark.parametrize(
    ("head", "status", "code"),
    [
        (b"GET\r\n\r\n", 400, "bad_request"),
        (b"GET / HTTP/1.1 extra\r\n\r\n", 400, "bad_request"),
        (b"GET / HTTP/9.9\r\n\r\n", 505, "http_version_not_supported"),
        (b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n", 414, "request_line_too_long"),
        (b"GET / HTTP/1.1\r\nX: " + b"a" * 70000 + b"\r\n\r\n", 431, "headers_too_large"),
        (
            b"GET / HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(101)) + b"\r\n",
            431,
            "headers_too_large",
        ),
        (b"BREW /pot HTTP/1.1\r\nHost: x\r\n\r\n", 501, "method_not_implemented"),
        (b"GET http://[::1/health HTTP/1.1\r\nConnection: close\r\n\r\n", 400, "invalid_path"),
        (b"OPTIONS http://[ HTTP/1.1\r\nConnection: close\r\n\r\n", 400, "invalid_path"),
    ],
    ids=[
        *("no-path", "four-words", "http-9.9", "long-line", "long-header", "101-headers"),
        *("brew", "broken-host", "broken-host-preflight"),
    ],
)
def test_a_request_that_cannot_be_read_gets_a_json_error_and_a_close(bounded, head, status, code):
    sock = connect(bounded)
    started = time.monotonic()
    sock.sendall(head)
    raw = read_to_close(sock)
    got, body = json_answer(raw)
    assert (got, body["error"]["code"]) == (status, code), raw[:300]
    assert body["error"]["message"] and b"Connection: close" in raw
    assert time.monotonic() - started < DEADLINE  # at once, not at a deadline


@pytest.mark.parametrize(
    ("lengths", "status", "code"),
    [
        ([b"+2"], 400, "invalid_body"),
        ([b"1_0"], 400, "invalid_body"),
        ([b"-1"], 400, "invalid_body"),
        ([b"2", b"3"], 400, "invalid_body"),
        ([b"9" * 5000], 413, "body_too_large"),
    ],
    ids=["plus-sign", "underscore", "negative", "two-that-disagree", "5000-digits"],
)
def test_a_content_length_that_is_not_one_byte_count_is_refused(bounded, lengths, status, code):
    sock = connect(bounded)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
    head += b"".join(b"Content-Length: " + value + b"\r\n" for value in lengths)
    sock.sendall(head + b"\r\n{}")
    got, body = json_answer(read_to_close(sock))
    assert (got, body["error"]["code"]) == (status, code), body


def test_a_connection_that_sends_nothing_is_closed_at_the_idle_timeout(bounded):
    sock = connect(bounded)
    started = time.monotonic()
    assert read_to_close(sock) == b""
    elapsed = time.monotonic() - started
    assert DEADLINE * 0.8 <= elapsed < DEADLINE + SLACK, elapsed


def test_a_keep_alive_connection_is_closed_once_it_idles(bounded):
    sock = connect(bounded)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    raw = read_to_close(sock)  # the answer, then the close at the idle deadline
    assert raw.startswith(b"HTTP/1.1 200 ") and b'"status": "ok"' in raw


def test_headers_trickled_slower_than_the_header_timeout_get_a_408(bounded):
    sock = connect(bounded)
    # One byte every 50 ms: each recv succeeds long before a per-read timeout
    # would fire; only a deadline for the whole head stops it.
    head = b"GET /health HTTP/1.1\r\nX-Slow: " + b"a" * 400
    stop = threading.Event()

    def trickle() -> None:
        for byte in head:
            if stop.is_set():
                return
            try:
                sock.send(bytes([byte]))
            except OSError:
                return
            time.sleep(0.05)

    sender = threading.Thread(target=trickle, daemon=True)
    started = time.monotonic()
    sender.start()
    raw = read_to_close(sock)
    elapsed = time.monotonic() - started
    stop.set()
    status, body = json_answer(raw)
    assert status == 408 and body["error"]["code"] == "request_timeout"
    assert "headers did not arrive" in body["error"]["message"]
    assert elapsed < DEADLINE + SLACK, elapsed


def test_a_body_slower_than_the_body_timeout_gets_a_408(bounded):
    sock = connect(bounded)
    started = time.monotonic()
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 1000\r\n\r\n{"prompt": "'
    )
    raw = read_to_close(sock)
    elapsed = time.monotonic() - started
    status, body = json_answer(raw)
    assert status == 408 and "request body (1000 bytes)" in body["error"]["message"]
    assert DEADLINE * 0.8 <= elapsed < DEADLINE + SLACK, elapsed


def test_a_body_trickled_slower_than_the_body_timeout_gets_a_408(bounded):
    sock = connect(bounded)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000\r\n\r\n"
    )
    stop = threading.Event()

    def trickle() -> None:  # a byte every 50 ms: no single read waits long
        for _ in range(1000):
            if stop.is_set():
                return
            try:
                sock.send(b" ")
            except OSError:
                return
            time.sleep(0.05)

    sender = threading.Thread(target=trickle, daemon=True)
    started = time.monotonic()
    sender.start()
    raw = read_to_close(sock)
    elapsed = time.monotonic() - started
    stop.set()
    status, body = json_answer(raw)
    assert status == 408 and body["error"]["code"] == "request_timeout"
    assert DEADLINE * 0.8 <= elapsed < DEADLINE + SLACK, elapsed


def test_a_client_that_never_reads_its_stream_is_dropped_and_its_generation_stops(bounded):
    bounded.wait_idle()
    suppress_eos = {str(t): -100 for t in bounded.server.app.tokenizer.eos_token_ids}
    service = bounded.server.app.worker.service
    before = service.stats().engine
    body = json.dumps(
        {
            "prompt": "a stream nobody reads",
            "max_tokens": MAX_TOKENS,
            "stream": True,
            "logprobs": 20,  # ~1 KB per event: the socket buffers fill within a few hundred
            "logit_bias": suppress_eos,
        }
    ).encode()
    sock = connect(bounded, rcvbuf=4096)
    try:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        # Nothing is read from `sock`. The server's writes block once the
        # buffers are full; the write deadline then ends the connection, and
        # with it the generation. The bound below only keeps a broken server
        # from hanging the test: what is asserted is how the row ended.
        worker = bounded.server.app.worker
        deadline = time.monotonic() + SLACK
        while not worker.busy:  # its generation has started (after preparation)
            assert time.monotonic() < deadline, "the stream's generation never started"
            time.sleep(0.01)
        bounded.wait_idle(seconds=600)
        wait_until_released(bounded, SLACK)
    finally:
        sock.close()
    after = service.stats().engine
    # The row left the batch by cancellation, not by finishing its tokens...
    assert (after.cancelled - before.cancelled, after.completed - before.completed) == (1, 0)
    # ... and its generation stopped well short of max_tokens.
    assert after.generated_tokens - before.generated_tokens < MAX_TOKENS
    assert bounded.get("/health").json["busy"] is False


def hold(client, count: int) -> list[socket.socket]:
    """``count`` idle connections, once the server has accepted them all."""
    held = [connect(client) for _ in range(count)]
    deadline = time.monotonic() + SLACK
    while client.server.open_connections < count:
        assert time.monotonic() < deadline, "the held connections were not accepted"
        time.sleep(0.01)
    return held


def test_connections_past_the_limit_are_answered_503_at_once(bounded):
    from mlx_loom.serve.connection import RESERVED_CONNECTIONS

    wait_until_released(bounded, DEADLINE + SLACK)
    # The limit, then the connections reserved for health checks, all held.
    held = hold(bounded, MAX_CONNECTIONS + RESERVED_CONNECTIONS)
    try:
        extra = connect(bounded)
        started = time.monotonic()
        raw = read_to_close(extra)
        elapsed = time.monotonic() - started
        status, body = json_answer(raw)
        assert status == 503 and body["error"]["code"] == "too_many_connections"
        assert b"Retry-After: 1" in raw
        assert elapsed < DEADLINE, elapsed  # not after an idle deadline: at once
    finally:
        for sock in held:
            sock.close()
    wait_until_released(bounded, DEADLINE + SLACK)
    assert bounded.get("/health").status == 200


@pytest.fixture
def flooded(long_context_model):
    """A server whose held connections outlast the flood (a long idle deadline)."""
    model, tokenizer = long_context_model
    yield from serve(model, tokenizer, **{**LIMITS, "idle_timeout": 60.0})


def test_a_thousand_idle_connections_hold_at_most_the_limit_of_threads(flooded):
    from mlx_loom.serve.connection import RESERVED_CONNECTIONS

    before = threading.active_count()
    started = time.monotonic()
    socks = []
    peak = 0
    try:
        for _ in range(1000):
            socks.append(connect(flooded))
            peak = max(peak, threading.active_count())
        refused = held = 0
        for sock in socks:
            sock.settimeout(0.2)
            try:
                answer = read_to_close(sock)
            except TimeoutError:  # accepted, and waiting for its request
                held += 1
                continue
            status, body = json_answer(answer)
            refused += status == 503 and body["error"]["code"] == "too_many_connections"
        peak = max(peak, threading.active_count())
        elapsed = time.monotonic() - started
    finally:
        for sock in socks:
            sock.close()
    # The reserved connections are held until their health-check deadline, then refused.
    assert MAX_CONNECTIONS <= held <= MAX_CONNECTIONS + RESERVED_CONNECTIONS, held
    assert held + refused == 1000, (held, refused)
    assert peak <= before + MAX_CONNECTIONS + RESERVED_CONNECTIONS, (before, peak)
    assert elapsed < 30, elapsed
    # The held connections end when their clients close them.
    wait_until_released(flooded, SLACK)
    deadline = time.monotonic() + SLACK
    while threading.active_count() > before:
        assert time.monotonic() < deadline, threading.enumerate()
        time.sleep(0.02)
    assert flooded.get("/health").status == 200
