"""Connections a remote client controls: health checks, per-client bounds, bodies, half-closes.

Before: 128 idle connections made every client get 503 — ``/health``
included — for as long as they were renewed; one address could hold every
connection; a ``GET`` or ``OPTIONS`` with a body had the body parsed as a
second, pipelined request (a proxy in front sees one request where the
server saw two); a client that half-closed after sending its request (the
FIN read as "client gone") got no answer.
"""

from __future__ import annotations

import json
import re
import socket
import time

import pytest

import mlx_loom
from mlx_loom.serve.connection import RESERVED_CONNECTIONS

from ..server.conftest import serve
from .test_server_connections import SLACK, hold, json_answer, read_to_close, wait_until_released

DEADLINE = 0.5
MAX_CONNECTIONS = 6
PER_CLIENT = 4


@pytest.fixture(scope="module")
def server(family_dirs):
    model, tokenizer = mlx_loom.load(family_dirs["llama"])
    yield from serve(
        model,
        tokenizer,
        idle_timeout=DEADLINE,
        header_timeout=DEADLINE,
        body_timeout=DEADLINE,
        write_timeout=DEADLINE,
        max_connections=MAX_CONNECTIONS,
        max_connections_per_client=PER_CLIENT,
    )


def connect(client, source: str | None = None) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(DEADLINE + SLACK + 5)
    if source is not None:
        sock.bind((source, 0))
    sock.connect(("127.0.0.1", client.port))
    return sock


def request(method: str, path: str, body: bytes = b"", headers: str = "") -> bytes:
    length = f"Content-Length: {len(body)}\r\n" if body or method == "POST" else ""
    return f"{method} {path} HTTP/1.1\r\nHost: x\r\n{headers}{length}\r\n".encode() + body


def answers(raw: bytes) -> list[bytes]:
    """The status lines in everything a connection received (an answer follows a body)."""
    return re.findall(rb"HTTP/1\.1 \d{3} [^\r\n]*", raw)


def hold_from(client, sources: list[str]) -> list[socket.socket]:
    held = [connect(client, source) for source in sources]
    deadline = time.monotonic() + SLACK
    while client.server.open_connections < len(sources):
        assert time.monotonic() < deadline, "the held connections were not accepted"
        time.sleep(0.01)
    return held


def other_addresses(count: int) -> list[str]:
    """Loopback addresses besides 127.0.0.1 (Linux routes all of 127/8 to the host)."""
    sources = [f"127.0.0.{i}" for i in range(2, 2 + count)]
    probe = socket.socket()
    try:
        probe.bind((sources[0], 0))
    except OSError:
        pytest.skip("this system has one loopback address")
    finally:
        probe.close()
    return sources


def test_health_is_answered_when_every_connection_is_held(server):
    wait_until_released(server, DEADLINE + SLACK)
    # Held from several addresses, so the per-client bound does not answer first.
    held = hold_from(server, other_addresses(MAX_CONNECTIONS))
    try:
        sock = connect(server)
        started = time.monotonic()
        sock.sendall(request("GET", "/health"))
        status, body = json_answer(read_to_close(sock))
        assert status == 200 and body["status"] == "ok", body
        assert time.monotonic() - started < DEADLINE
        # So is the monitoring scrape.
        sock = connect(server)
        sock.sendall(request("GET", "/metrics"))
        raw = read_to_close(sock)
        assert answers(raw) == [b"HTTP/1.1 200 OK"], raw[:200]
        assert b"loom_open_connections" in raw
        # Any other request on a reserved connection is answered 503 at once.
        sock = connect(server)
        started = time.monotonic()
        sock.sendall(request("GET", "/v1/models"))
        status, body = json_answer(read_to_close(sock))
        assert status == 503 and body["error"]["code"] == "too_many_connections"
        assert time.monotonic() - started < DEADLINE
    finally:
        for sock in held:
            sock.close()
    wait_until_released(server, DEADLINE + SLACK)


def test_a_reserved_connection_that_asks_nothing_is_refused_at_its_short_deadline(server):
    wait_until_released(server, DEADLINE + SLACK)
    held = hold_from(server, other_addresses(MAX_CONNECTIONS))
    try:
        sock = connect(server)
        started = time.monotonic()
        status, body = json_answer(read_to_close(sock))
        assert status == 503 and body["error"]["code"] == "too_many_connections"
        assert time.monotonic() - started < DEADLINE + SLACK
    finally:
        for sock in held:
            sock.close()
    wait_until_released(server, DEADLINE + SLACK)


def test_one_address_holds_at_most_its_share_of_connections(server):
    wait_until_released(server, DEADLINE + SLACK)
    held = hold(server, PER_CLIENT)
    try:
        extra = connect(server)
        started = time.monotonic()
        status, body = json_answer(read_to_close(extra))
        assert status == 503 and body["error"]["code"] == "too_many_connections"
        assert "--max-connections-per-client" in body["error"]["fix"]
        assert time.monotonic() - started < DEADLINE  # at once
        # Another address is still served.
        (source,) = other_addresses(1)
        sock = connect(server, source)
        sock.sendall(request("GET", "/health"))
        assert json_answer(read_to_close(sock))[0] == 200
    finally:
        for sock in held:
            sock.close()
    wait_until_released(server, DEADLINE + SLACK)
    assert not server.server._per_client  # every address released


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [("GET", "/health", 200), ("OPTIONS", "/v1/models", 204), ("DELETE", "/v1/models", 405)],
)
@pytest.mark.parametrize("framing", ["length", "chunked"])
def test_a_body_on_any_method_is_never_read_as_a_second_request(
    server, method, path, status, framing
):
    smuggled = request("GET", "/v1/models")
    if framing == "length":
        raw = request(method, path, smuggled)
    else:
        chunk = f"{len(smuggled):x}\r\n".encode() + smuggled + b"\r\n0\r\n\r\n"
        raw = request(method, path, headers="Transfer-Encoding: chunked\r\n") + chunk
    sock = connect(server)
    sock.sendall(raw)
    received = read_to_close(sock)
    lines = answers(received)
    assert len(lines) == 1, received  # one request, one answer, then the connection closes
    assert lines[0].startswith(f"HTTP/1.1 {status} ".encode()), received
    assert b"Connection: close" in received
    assert b'"object": "list"' not in received  # the smuggled request was not answered


def test_a_get_with_an_empty_body_keeps_its_connection(server):
    sock = connect(server)
    sock.sendall(request("GET", "/health", headers="Content-Length: 0\r\n") * 2)
    sock.shutdown(socket.SHUT_WR)
    lines = answers(read_to_close(sock))
    assert lines == [b"HTTP/1.1 200 OK"] * 2


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_client_that_half_closes_after_its_request_gets_its_answer(server, path, stream):
    if path == "/v1/completions":
        body = {"prompt": "hello", "max_tokens": 6, "stream": stream}
    else:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stream": stream}
    sock = connect(server)
    sock.sendall(request("POST", path, json.dumps(body).encode()))
    sock.shutdown(socket.SHUT_WR)
    received = read_to_close(sock)
    final = [line for line in answers(received) if not line.startswith(b"HTTP/1.1 100 ")]
    assert final == [b"HTTP/1.1 200 OK"], received
    if stream:
        assert received.rstrip().endswith(b"data: [DONE]"), received[-200:]
    else:
        payload = received[received.index(b"{") :]
        assert json.loads(payload)["usage"]["completion_tokens"] == 6


def test_health_from_a_half_closed_client_is_answered(server):
    sock = connect(server)
    sock.sendall(request("GET", "/health"))
    sock.shutdown(socket.SHUT_WR)
    assert json_answer(read_to_close(sock))[0] == 200


def test_the_reserved_connections_are_bounded_too(server):
    wait_until_released(server, DEADLINE + SLACK)
    sources = other_addresses(MAX_CONNECTIONS + RESERVED_CONNECTIONS)
    held = hold_from(server, sources)
    try:
        extra = connect(server)
        started = time.monotonic()
        status, _ = json_answer(read_to_close(extra))
        assert status == 503 and time.monotonic() - started < DEADLINE
    finally:
        for sock in held:
            sock.close()
    wait_until_released(server, DEADLINE + SLACK)
