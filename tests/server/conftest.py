"""A served tiny checkpoint and a small HTTP client for the server tests.

Each test module gets its own server (module-scoped fixture) on 127.0.0.1 with
an ephemeral port, serving from a background thread of the test process; it
is stopped when the module's tests are done.
"""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import mlx_loom
from mlx_loom.serve import LoomServer, make_server
from mlx_loom.testing.checkpoints import write_checkpoint
from mlx_loom_minicpm5.plugin import TINY_CONFIG, checkpoint_tensors

MODEL_ID = "tiny-served"
#: A longer context than TINY_CONFIG's, so a generation can run long enough
#: to be interrupted, and the "prompt too long" case is a long token list.
CONTEXT = 4096
TIMEOUT = 30.0


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    cfg = {**TINY_CONFIG, "max_position_embeddings": CONTEXT}
    path = tmp_path_factory.mktemp("served") / "tiny"
    return write_checkpoint(path, cfg, checkpoint_tensors(cfg))


@pytest.fixture(scope="module")
def oracle(checkpoint):
    """A separately loaded copy of the model, for comparing with ``mlx_loom.generate``."""
    return mlx_loom.load(checkpoint)


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    text: str

    @property
    def json(self) -> Any:
        return json.loads(self.text)

    @property
    def error(self) -> dict[str, Any]:
        return self.json["error"]

    def events(self) -> list[Any]:
        """The ``data:`` payloads of a Server-Sent Events body; ``"[DONE]"`` stays a string."""
        out: list[Any] = []
        for block in self.text.split("\n\n"):
            if block.startswith("data: "):
                data = block.removeprefix("data: ")
                out.append(data if data == "[DONE]" else json.loads(data))
        return out


class Client:
    """Just enough HTTP for the tests: one connection per request, loopback only."""

    def __init__(self, server: LoomServer) -> None:
        self.server = server
        self.host, self.port = "127.0.0.1", server.port

    def connect(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=TIMEOUT)

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        raw: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> Reply:
        conn = self.connect()
        try:
            data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
            hdrs = {"Content-Type": "application/json", **(headers or {})}
            conn.request(method, path, body=data, headers=hdrs)
            resp = conn.getresponse()
            return Reply(resp.status, dict(resp.getheaders()), resp.read().decode())
        finally:
            conn.close()

    def get(self, path: str) -> Reply:
        return self.request("GET", path)

    def post(self, path: str, body: Any) -> Reply:
        return self.request("POST", path, body)

    def wait_idle(self, seconds: float = 15.0) -> None:
        """Wait (bounded) until the generation worker has nothing running or queued."""
        deadline = time.monotonic() + seconds
        worker = self.server.app.worker
        while worker.busy or worker.queued:
            assert time.monotonic() < deadline, "the generation worker did not go idle"
            time.sleep(0.02)


def serve(model, tokenizer, **options) -> Iterator[Client]:
    server = make_server(model, tokenizer, host="127.0.0.1", port=0, **options)
    server.start_in_background()
    try:
        yield Client(server)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def client(checkpoint) -> Iterator[Client]:
    model, tokenizer = mlx_loom.load(checkpoint)
    yield from serve(model, tokenizer, model_id=MODEL_ID)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    """Record each phase's report on the test item, so fixtures can tell a failed test
    (the chat-page tests keep a screenshot of one)."""
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report
