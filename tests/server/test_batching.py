"""``loom serve`` on the engine, for every family: concurrent streams overlap, and each
equals its solo run at temperature 0; a full queue is a 503 with Retry-After."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

import mlx_loom
from mlx_loom.engine import EngineSettings
from mlx_loom.testing.checkpoints import write_checkpoint

from .conftest import Client, serve

FAMILIES = ["llama", "qwen3_next", "qwen3_5", "gemma4_text", "gemma4"]
#: (prompt, max_tokens) of the streams run together; the first runs longest.
STREAMS = [("the model reads a token", 60), ("hello world", 16), ("a b c d e f g", 12)]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    claim = mlx_loom.default_host().registry.model_types[request.param]
    path = tmp_path_factory.mktemp(request.param) / "ckpt"
    write_checkpoint(path, claim.tiny_config, claim.checkpoint_tensors(claim.tiny_config))
    model, tokenizer = mlx_loom.load(path)
    return request.param, model, tokenizer


def body(tokenizer, prompt: str, max_tokens: int, stream: bool) -> dict:
    eos = sorted(tokenizer.eos_token_ids)
    # EOS is suppressed so each stream runs its full length and the streams overlap.
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": stream,
        "logit_bias": {str(t): -100 for t in eos},
    }


def solo(model, tokenizer, prompt: str, max_tokens: int) -> str:
    eos = sorted(tokenizer.eos_token_ids)
    return mlx_loom.generate(
        model, tokenizer, prompt, max_tokens=max_tokens, logit_bias={t: -100.0 for t in eos}
    )


def read_stream(client: Client, payload: dict, first: threading.Event | None = None) -> str:
    data = json.dumps(payload).encode()
    with socket.create_connection(("127.0.0.1", client.port), timeout=60) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
            if first is not None and b"data: " in raw:
                first.set()
    head, _, events = raw.decode().partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 200"), head
    text = []
    for block in events.split("\n\n"):
        data = block.removeprefix("data: ")
        if block.startswith("data: ") and data != "[DONE]":
            text.append(json.loads(data)["choices"][0]["text"])
    return "".join(text)


def test_concurrent_streams_overlap_and_each_equals_its_solo_run(family):
    name, model, tokenizer = family
    expected = [solo(model, tokenizer, p, n) for p, n in STREAMS]
    gen = serve(model, tokenizer, engine=EngineSettings(decode_concurrency=8, prompt_cache_size=4))
    client = next(gen)
    try:
        got: list[str | None] = [None] * len(STREAMS)
        started = threading.Event()

        def run(i: int) -> None:
            prompt, n = STREAMS[i]
            got[i] = read_stream(
                client, body(tokenizer, prompt, n, True), started if i == 0 else None
            )

        threads = [threading.Thread(target=run, args=(0,))]
        threads[0].start()
        assert started.wait(60), f"{name}: the first stream never started"
        threads += [threading.Thread(target=run, args=(i,)) for i in range(1, len(STREAMS))]
        for t in threads[1:]:
            t.start()
        for t in threads:
            t.join(120)
        assert got == expected, name
        assert client.server.app.worker.stats().engine.peak_decoding >= 2, (
            f"{name}: the streams did not overlap"
        )
    finally:
        gen.close()


def open_stream(client: Client, payload: dict) -> socket.socket:
    """Start a streamed completion; return its socket once the first chunk has arrived."""
    data = json.dumps(payload).encode()
    sock = socket.create_connection(("127.0.0.1", client.port), timeout=30)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    received = b""
    while b"data: " not in received:
        chunk = sock.recv(4096)
        assert chunk, "the server closed the stream before the first chunk"
        received += chunk
    return sock


@contextmanager
def busy_server(checkpoint, *, waiting: int) -> Iterator[Client]:
    """A server with one row (held by a long stream), a queue of one, ``waiting`` queued."""
    model, tokenizer = mlx_loom.load(checkpoint)
    settings = EngineSettings(decode_concurrency=1, prompt_concurrency=1, max_queued=1)
    gen = serve(model, tokenizer, engine=settings)
    client = next(gen)
    worker = client.server.app.worker
    running = open_stream(client, body(tokenizer, "the model reads a token", 3000, True))
    threads = [
        threading.Thread(
            target=lambda: client.post("/v1/completions", {"prompt": "hi", "max_tokens": 2})
        )
        for _ in range(waiting)
    ]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while worker.queued < waiting:
            assert time.monotonic() < deadline, "the waiting request never queued"
            time.sleep(0.01)
        yield client
    finally:
        running.close()  # frees the row: a waiting request runs and completes
        for t in threads:
            t.join(30)
        gen.close()


def test_a_full_queue_is_answered_503_with_retry_after(checkpoint):
    with busy_server(checkpoint, waiting=1) as client:
        # One request may wait for the running row; the one after it is refused.
        reply = client.post("/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert reply.status == 503
        assert reply.headers.get("Retry-After") == "1"
        assert (
            reply.error["code"] == "queue_full"
            and "waiting for a free row" in reply.error["message"]
        )
        health = client.get("/health").json
        assert health["queued"] == 1 and health["active_rows"] == 1


def test_a_full_queue_answers_the_messages_api_503_in_its_own_shape(checkpoint):
    with busy_server(checkpoint, waiting=1) as client:
        reply = client.post(
            "/v1/messages",
            {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
        )
        assert reply.status == 503
        assert reply.headers.get("Retry-After") == "1"
        assert reply.json["type"] == "error"
        assert reply.json["error"]["type"] == "overloaded_error"


def test_a_request_for_more_choices_than_the_queue_holds_queues_none_of_them(checkpoint):
    with busy_server(checkpoint, waiting=0) as client:
        # n=2 with room for one: the first choice was queued, the second refused.
        reply = client.post("/v1/completions", {"prompt": "hi", "max_tokens": 2, "n": 2})
        assert reply.status == 503 and reply.headers.get("Retry-After") == "1"
        worker = client.server.app.worker
        deadline = time.monotonic() + 10
        while worker.queued:  # the queued choice is cancelled, not left to run
            assert time.monotonic() < deadline, "the first choice stayed queued"
            time.sleep(0.01)
        assert client.get("/health").json["active_rows"] == 1


def test_health_reports_the_engine_settings(client):
    health = client.get("/health").json
    assert health["decode_concurrency"] == 32 and health["max_queued"] == 64
    assert set(health["prompt_cache"]) == {
        "entries",
        "bytes",
        "hits",
        "misses",
        "checkpoints",
        "checkpoint_bytes",
        "disk_bytes",
        "disk_files",
        "disk_hits",
    }
