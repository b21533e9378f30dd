"""Soak ``loom serve``: 16 clients, mixed streamed, whole and cancelled requests, for minutes.

Run by hand (not a test)::

    .venv/bin/python benchmarks/soak.py                 # 5 minutes, 16 clients
    .venv/bin/python benchmarks/soak.py --seconds 60    # shorter

The server runs as a subprocess (``loom serve``, its defaults) on a tiny
random-weight Llama written to a temporary directory. Each client loops
over the three endpoints (``/v1/completions``, ``/v1/chat/completions``,
``/v1/messages``) and four kinds of request, in turn:

* **streamed**: read to the end (``data: [DONE]``, or Anthropic's
  ``message_stop``);
* **whole**: a non-streamed answer, parsed as strict JSON (no ``NaN``);
* **cancelled stream**: closed after its first event;
* **cancelled whole**: closed 50 ms after it is sent.

Every answer must be a 200 with strict JSON (or a ``503`` with
``Retry-After`` when the server is full); anything else — a 5xx, a body
that is not JSON, a stream without its end — is counted as a failure and
printed. Every 10 s the server's resident memory and thread count are
sampled from ``/proc`` (Linux). At the end the server gets SIGTERM and must
drain and exit 0. The report: requests per kind, statuses, failures, the
latency of whole answers, and memory at the start, peak and end.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

KINDS = ("streamed", "whole", "cancelled stream", "cancelled whole")
PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/messages")


def write_model(root: Path) -> Path:
    import mlx_loom
    from mlx_loom.testing.checkpoints import write_checkpoint

    claim = mlx_loom.default_host().registry.model_types["llama"]
    config = {**claim.tiny_config, "max_position_embeddings": 2048}
    return write_checkpoint(root / "llama", config, claim.checkpoint_tensors(config))


def body_for(path: str, rng: random.Random, stream: bool) -> dict:
    tokens = rng.randint(8, 64)
    words = " ".join(rng.choice(["the", "cat", "sat", "on", "a", "mat", "and"]) for _ in range(12))
    if path == "/v1/completions":
        body: dict = {"prompt": words, "max_tokens": tokens, "logprobs": rng.choice([None, 3])}
        if body["logprobs"] is None:
            del body["logprobs"]
    else:
        body = {"messages": [{"role": "user", "content": words}], "max_tokens": tokens}
    body["temperature"] = rng.choice([0.0, 0.7])
    body["stream"] = stream
    return body


def _strict(text: str) -> object:
    def refuse(name: str) -> None:
        raise ValueError(f"bare {name} in the body")

    return json.loads(text, parse_constant=refuse)


class Client(threading.Thread):
    def __init__(self, index: int, port: int, until: float, results: list) -> None:
        super().__init__(daemon=True)
        self.port, self.until, self.results = port, until, results
        self.rng = random.Random(index)
        self.turn = itertools.count(index)

    def run(self) -> None:
        while time.monotonic() < self.until:
            n = next(self.turn)
            kind, path = KINDS[n % len(KINDS)], PATHS[(n // len(KINDS)) % len(PATHS)]
            started = time.monotonic()
            try:
                status, problem = self.one(kind, path)
            except Exception as exc:  # a client-side failure is a finding too
                status, problem = 0, f"{type(exc).__name__}: {exc}"
            self.results.append((kind, path, status, problem, time.monotonic() - started))

    def one(self, kind: str, path: str) -> tuple[int, str | None]:
        stream = kind in ("streamed", "cancelled stream")
        data = json.dumps(body_for(path, self.rng, stream)).encode()
        if kind.startswith("cancelled"):
            sock = socket.create_connection(("127.0.0.1", self.port), timeout=60)
            sock.sendall(
                f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\n\r\n".encode()
                + data
            )
            if stream:
                sock.recv(65536)  # the status line and (usually) the first event
            else:
                time.sleep(0.05)
            sock.close()
            return 0, None
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        reply = conn.getresponse()
        text = reply.read().decode()
        conn.close()
        if reply.status == 503 and reply.getheader("Retry-After"):
            return 503, None
        if reply.status != 200:
            return reply.status, text[:200]
        if not stream:
            _strict(text)
            return 200, None
        lines = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        for line in lines:
            if line != "[DONE]":
                _strict(line)
        ended = lines and (lines[-1] == "[DONE]" or '"message_stop"' in lines[-1])
        return 200, None if ended else f"the stream did not end: {text[-200:]!r}"


def sample(pid: int) -> tuple[float, int]:
    """The server's resident memory (MB) and thread count."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        fields[name] = value.split()
    return int(fields["VmRSS"][0]) / 1024, int(fields["Threads"][0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--clients", type=int, default=16)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model = write_model(Path(tmp))
        proc = subprocess.Popen(
            [sys.executable, "-m", "mlx_loom.cli.main", "serve", "--model", str(model)]
            + ["--port", "0"],
            stderr=subprocess.PIPE,
            text=True,
        )
        assert proc.stderr is not None
        match = re.search(r"http://127\.0\.0\.1:(\d+)/v1", proc.stderr.readline())
        assert match, "the server did not start"
        port = int(match.group(1))
        memory = [sample(proc.pid)]
        results: list = []
        until = time.monotonic() + args.seconds
        clients = [Client(i, port, until, results) for i in range(args.clients)]
        for client in clients:
            client.start()
        while any(c.is_alive() for c in clients):
            time.sleep(min(10.0, max(0.1, until - time.monotonic())))
            memory.append(sample(proc.pid))
        for client in clients:
            client.join()
        time.sleep(1.0)  # cancelled requests wind down
        memory.append(sample(proc.pid))
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
        proc.stderr.close()

    kinds = Counter(kind for kind, *_ in results)
    statuses = Counter(status for _, _, status, _, _ in results if status)
    failures = [r for r in results if r[3] is not None]
    whole = sorted(seconds for kind, _, status, _, seconds in results if kind == "whole")
    print(f"{len(results)} requests in {args.seconds:g} s from {args.clients} clients")
    print("  by kind: " + ", ".join(f"{k} {kinds[k]}" for k in KINDS))
    shown = ", ".join(f"{status}: {n}" for status, n in sorted(statuses.items()))
    print(f"  statuses (answers read): {shown}")
    if whole:
        q = statistics.quantiles(whole, n=20) if len(whole) > 1 else [whole[0]] * 19
        print(f"  whole answers: median {statistics.median(whole):.2f} s, p95 {q[18]:.2f} s")
    rss = [m[0] for m in memory]
    print(
        f"  server memory: start {rss[0]:.0f} MB, peak {max(rss):.0f} MB, end {rss[-1]:.0f} MB; "
        f"threads at the end {memory[-1][1]} (start {memory[0][1]})"
    )
    print("  memory every 10 s (MB): " + " ".join(f"{m:.0f}" for m in rss))
    print(f"  SIGTERM: exit code {code}")
    print(f"  failures: {len(failures)}")
    for kind, path, status, problem, _ in failures[:10]:
        print(f"    {kind} {path}: {status} {problem}")
    return 1 if failures or code != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
