"""Concurrent requests are batched, the server stays responsive, and disconnects free rows."""

from __future__ import annotations

import json
import socket
import threading
import time

import mlx_loom

PROMPT = "the model reads a token"
#: Long enough that it is still running when the client acts (the tiny model
#: decodes a few hundred tokens per second on a CPU).
LONG = 2000


def long_stream_body(client) -> bytes:
    eos = next(iter(client.server.app.tokenizer.eos_token_ids))
    # Suppress EOS so the generation runs all LONG tokens unless interrupted.
    return json.dumps(
        {"prompt": PROMPT, "max_tokens": LONG, "stream": True, "logit_bias": {str(eos): -100}}
    ).encode()


def open_stream(client) -> socket.socket:
    """Start a long streamed completion; return once its first chunk has arrived."""
    body = long_stream_body(client)
    sock = socket.create_connection(("127.0.0.1", client.port), timeout=10)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    received = b""
    while b"data: " not in received:
        chunk = sock.recv(4096)
        assert chunk, "the server closed the stream before the first chunk"
        received += chunk
    assert received.startswith(b"HTTP/1.1 200")
    return sock


def engine_stats(client):
    return client.server.app.worker.stats().engine


def test_a_client_that_disconnects_mid_stream_frees_its_row(client):
    client.wait_idle()
    before = engine_stats(client)
    sock = open_stream(client)
    sock.close()
    client.wait_idle()
    after = engine_stats(client)
    assert after.cancelled == before.cancelled + 1
    assert after.active == 0
    assert 0 < after.generated_tokens - before.generated_tokens < LONG


def test_health_answers_while_a_generation_runs(client):
    client.wait_idle()
    sock = open_stream(client)
    try:
        started = time.monotonic()
        reply = client.get("/health")
        elapsed = time.monotonic() - started
        assert reply.status == 200 and reply.json["busy"] is True
        assert reply.json["active_rows"] == 1 and reply.json["queued"] == 0
        assert elapsed < 2.0
    finally:
        sock.close()
        client.wait_idle()


def test_concurrent_requests_each_get_their_solo_result(client, oracle):
    model, tokenizer = oracle
    expected = mlx_loom.generate(model, tokenizer, PROMPT, max_tokens=24)
    replies: list = [None] * 3

    def ask(i: int) -> None:
        replies[i] = client.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 24})

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(r is not None and r.status == 200 for r in replies)
    assert [r.json["choices"][0]["text"] for r in replies] == [expected] * 3


def test_a_request_queued_behind_a_disconnected_one_still_completes(client):
    client.wait_idle()
    sock = open_stream(client)
    result: list = []
    waiter = threading.Thread(
        target=lambda: result.append(
            client.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
        )
    )
    waiter.start()
    sock.close()
    waiter.join(30)
    assert result and result[0].status == 200
    assert result[0].json["usage"]["completion_tokens"] == 4


def test_stopping_the_server_stops_its_engine(checkpoint):
    from .conftest import serve

    model, tokenizer = mlx_loom.load(checkpoint)
    gen = serve(model, tokenizer)
    other = next(gen)
    worker = other.server.app.worker
    assert other.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2}).status == 200
    gen.close()  # runs server.stop()
    assert not worker.alive


def test_a_client_that_disconnects_while_waiting_for_a_whole_answer_stops_it(client):
    client.wait_idle()
    worker = client.server.app.worker
    before = engine_stats(client)
    body = json.loads(long_stream_body(client))
    body["stream"] = False
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", client.port), timeout=10)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
        + f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    deadline = time.monotonic() + 10
    while not worker.busy:
        assert time.monotonic() < deadline, "the generation never started"
        time.sleep(0.005)
    sock.close()
    client.wait_idle()
    after = engine_stats(client)
    assert after.cancelled == before.cancelled + 1
    assert after.generated_tokens - before.generated_tokens < LONG
