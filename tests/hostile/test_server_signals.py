"""Signals: SIGTERM drains the server, SIGTERM and SIGINT end every stream cleanly, exit 0.

Before: SIGTERM (what ``docker stop`` and systemd send) killed ``loom serve``
at once, and both SIGTERM and SIGINT cut streams in flight with no error
event and no ``data: [DONE]`` — a client could not tell a cut stream from a
network failure.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import mlx_loom
from mlx_loom.testing.checkpoints import write_checkpoint

#: Bounds the whole of each case: start-up, the stream, the drain.
CASE_SECONDS = 60


@pytest.fixture(scope="module")
def long_checkpoint(tmp_path_factory) -> Path:
    """The tiny Llama with a 4096-token context, so a stream can outlast a short grace."""
    claim = mlx_loom.default_host().registry.model_types["llama"]
    config = {**claim.tiny_config, "max_position_embeddings": 4096}
    return write_checkpoint(
        tmp_path_factory.mktemp("sig") / "llama", config, claim.checkpoint_tensors(config)
    )


class Served:
    """``loom serve`` in a child process, on a free port."""

    def __init__(self, checkpoint: Path, *flags: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlx_loom.cli.main", "serve", "--model", str(checkpoint)]
            + ["--port", "0", *flags],
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stderr is not None
        line = self.proc.stderr.readline()
        match = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
        assert match, line
        self.port = int(match.group(1))

    def stream(self, path: str, body: dict) -> socket.socket:
        """Open a stream and return once its first event has arrived."""
        data = json.dumps({**body, "stream": True}).encode()
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=CASE_SECONDS)
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        first = b""
        while b"data: " not in first:
            chunk = sock.recv(65536)
            assert chunk, first
            first += chunk
        self.received = first
        return sock

    def wait(self, seconds: float) -> int | None:
        try:
            return self.proc.wait(seconds)
        except subprocess.TimeoutExpired:
            return None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(5)
        assert self.proc.stderr is not None
        self.proc.stderr.close()


def rest_of(sock: socket.socket) -> bytes:
    out = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return out
        if not chunk:
            return out
        out += chunk


def events(raw: bytes) -> list[str]:
    return [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]


LONG = {"prompt": "once upon a time", "max_tokens": 4000}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stream_past_the_grace_ends_with_an_error_event_and_done(long_checkpoint, sig):
    served = Served(long_checkpoint, "--shutdown-grace", "0.2")
    try:
        sock = served.stream("/v1/completions", LONG)
        served.proc.send_signal(sig)
        raw = served.received + rest_of(sock)
        assert served.wait(CASE_SECONDS) == 0
        data = events(raw)
        assert data[-1] == "[DONE]", data[-3:]
        error = json.loads(data[-2])["error"]
        assert error["code"] == "server_stopping" and error["fix"]
        # The stream was cut, not finished: it did not run to max_tokens.
        assert all(json.loads(d)["choices"][0]["finish_reason"] is None for d in data[:-2])
    finally:
        served.close()


def test_sigterm_lets_a_stream_in_flight_finish_within_the_grace(long_checkpoint):
    served = Served(long_checkpoint, "--shutdown-grace", "30")
    try:
        sock = served.stream("/v1/completions", {"prompt": "hello", "max_tokens": 64})
        served.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        # Draining: the listening socket is closed, new connections are refused.
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", served.port), timeout=5).recv(1)
        raw = served.received + rest_of(sock)
        data = events(raw)
        assert data[-1] == "[DONE]"
        assert json.loads(data[-2])["choices"][0]["finish_reason"] == "length"
        assert served.wait(CASE_SECONDS) == 0
    finally:
        served.close()


def test_an_anthropic_stream_ends_with_its_error_event(long_checkpoint):
    served = Served(long_checkpoint, "--shutdown-grace", "0")
    try:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4000}
        sock = served.stream("/v1/messages", body)
        served.proc.send_signal(signal.SIGTERM)
        raw = (served.received + rest_of(sock)).decode()
        assert served.wait(CASE_SECONDS) == 0
        last = [line for line in raw.splitlines() if line.startswith("event: ")][-1]
        assert last == "event: error", raw[-300:]
        error = json.loads(raw.rstrip().splitlines()[-1].removeprefix("data: "))
        assert error["type"] == "error" and "stopping" in error["error"]["message"]
    finally:
        served.close()
