"""The program every rank runs under ``mlx.launch`` for the two-rank tests.

``python ranks.py SPEC OUT``: SPEC is a JSON list of cases; each rank runs
every case in order (they are collective: the ranks must agree on the order)
and writes ``OUT/rank<r>.json`` mapping case ids to what it observed. The
tests (``test_two_ranks.py``) launch this once and assert on the results, so
one launch — one process start per rank — covers every family, both modes
and every door.

Case kinds:

* ``api`` — ``mlx_loom.load(..., parallel=mode)`` beside a single-process
  load: greedy tokens (one stream, and a batch of two), the logits' largest
  difference, sampling in lock-step, what each rank holds;
* ``generate`` / ``chat`` — ``loom generate|chat --parallel`` through the CLI's
  ``main()``; only rank 0 is given stdin;
* ``serve`` — ``loom serve --parallel``: rank 0 serves while a client thread
  sends the case's requests (one streamed and dropped after a few chunks,
  then a burst of concurrent ones), then interrupts it; the other ranks
  follow the requests.
"""

from __future__ import annotations

import contextlib
import http.client
import io
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import mlx.core as mx

import mlx_loom
from mlx_loom.cli.main import main

GROUP = mx.distributed.init()
RANK = GROUP.rank()


def greedy(model, tokenizer, prompt, max_tokens, **sampling) -> list[int]:
    return [
        r.token
        for r in mlx_loom.stream_generate(
            model, tokenizer, prompt, max_tokens=max_tokens, **sampling
        )
    ]


def run_api(case: dict[str, Any]) -> dict[str, Any]:
    ref, tokenizer = mlx_loom.load(case["model"])
    model, _ = mlx_loom.load(case["model"], parallel=case["mode"])
    prompt = case["prompt"]
    ref_logits = ref(mx.array([prompt]))
    logits = model(mx.array([prompt]))
    # A direct forward's collectives run when it is evaluated: before the engine's.
    mx.eval(logits, ref_logits)
    info = model.parallel
    steps = case["max_tokens"]
    rows = [prompt, prompt[2:6]]  # rows of different lengths: left padding
    batch = [r.tokens for r in mlx_loom.batch_generate(model, tokenizer, rows, max_tokens=3)]
    ref_batch = [r.tokens for r in mlx_loom.batch_generate(ref, tokenizer, rows, max_tokens=3)]
    sampled = greedy(model, tokenizer, prompt, steps, temperature=0.9, seed=7)
    ref_sampled = greedy(ref, tokenizer, prompt, steps, temperature=0.9, seed=7)
    return {
        "tokens": greedy(model, tokenizer, prompt, case["max_tokens"]),
        "ref_tokens": greedy(ref, tokenizer, prompt, case["max_tokens"]),
        "max_abs_diff": mx.abs(logits - ref_logits).max().item(),
        "logits_equal": bool(mx.array_equal(logits, ref_logits).item()),
        "batch": batch,
        "ref_batch": ref_batch,
        "sampled": sampled,
        "ref_sampled": ref_sampled,
        "unseeded": greedy(model, tokenizer, prompt, 3, temperature=1.0),
        "caches": len(model.make_cache()),
        "ref_caches": len(ref.make_cache()),
        "weight_bytes": info.weight_bytes,
        "ref_weight_bytes": sum(v.nbytes for _, v in _params(ref)),
        "sliced_bytes_read": info.sliced_bytes_read,
        "sliced_whole": list(info.sliced_whole),
        "layers": info.layers,
        "size": info.size,
        "repr": repr(model),
    }


def _params(model):
    from mlx.utils import tree_flatten

    return tree_flatten(model.module.parameters())


def run_cli(case: dict[str, Any]) -> dict[str, Any]:
    stdin = case.get("stdin", "") if RANK == 0 else ""
    out, err = io.StringIO(), io.StringIO()
    saved = sys.stdin
    sys.stdin = io.StringIO(stdin)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(case["argv"])
    finally:
        sys.stdin = saved
    return {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


def _wait_for_port(port: int, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on port {port}")


def _post(port: int, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def _drop_stream(port: int, body: dict[str, Any], chunks: int) -> int:
    """Read ``chunks`` streamed events, then hang up; returns how many arrived."""
    payload = json.dumps({**body, "stream": True}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    ).encode()
    seen = 0
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(head + payload)
        reader = sock.makefile("rb")
        while seen < chunks:
            line = reader.readline()
            if not line:
                break
            seen += line.startswith(b"data: ")
        reader.close()
        sock.shutdown(socket.SHUT_RDWR)
    return seen


def run_serve(case: dict[str, Any]) -> dict[str, Any]:
    port = case["port"]
    replies: dict[str, Any] = {}
    if RANK == 0:
        ref, tokenizer = mlx_loom.load(case["model"])
        replies["expected"] = [
            mlx_loom.generate(ref, tokenizer, p, max_tokens=case["max_tokens"])
            for p in case["prompts"]
        ]
        replies["expected_burst"] = [
            mlx_loom.generate(ref, tokenizer, p, max_tokens=m) for p, m in case["burst"]
        ]

        def client() -> None:
            try:
                _wait_for_port(port)
                body = {"max_tokens": case["max_tokens"], "temperature": 0}
                replies["before"] = [
                    _post(port, "/v1/completions", {**body, "prompt": p}) for p in case["prompts"]
                ]
                long = {"prompt": case["prompts"][0], "max_tokens": 400, "temperature": 0}
                replies["dropped_after"] = _drop_stream(port, long, 2)
                replies["after"] = [
                    _post(port, "/v1/completions", {**body, "prompt": p}) for p in case["prompts"]
                ]
                # Concurrent requests of different lengths: they share the engine's
                # batches, joining and leaving at different steps.
                with ThreadPoolExecutor(len(case["burst"])) as pool:
                    replies["burst"] = list(
                        pool.map(
                            lambda pm: _post(
                                port,
                                "/v1/completions",
                                {"prompt": pm[0], "max_tokens": pm[1], "temperature": 0},
                            ),
                            case["burst"],
                        )
                    )
            except Exception:  # reported in the results; the server still gets stopped
                replies["client_error"] = traceback.format_exc()
            finally:
                os.kill(os.getpid(), signal.SIGINT)

        threading.Thread(target=client, daemon=True).start()
    from mlx_loom.serve.worker import GenerationWorker

    close = GenerationWorker.close

    def record_then_close(worker, *args, **kwargs):
        replies["peak_decoding"] = worker.stats().engine.peak_decoding
        close(worker, *args, **kwargs)

    GenerationWorker.close = record_then_close
    try:
        result = run_cli(case)
    finally:
        GenerationWorker.close = close
    return {**result, **replies}


RUNNERS = {"api": run_api, "generate": run_cli, "chat": run_cli, "serve": run_serve}


def main_(spec_path: str, out_dir: str) -> None:
    cases = json.loads(Path(spec_path).read_text())
    results: dict[str, Any] = {}
    for case in cases:
        started = time.perf_counter()
        failed = False
        try:
            results[case["id"]] = RUNNERS[case["kind"]](case)
        except Exception:
            results[case["id"]] = {"error": traceback.format_exc()}
            failed = True
        results[case["id"]]["seconds"] = time.perf_counter() - started
        Path(out_dir, f"rank{RANK}.json").write_text(json.dumps(results, indent=1))
        if failed:
            # The other rank may now wait in a collective this one never joins:
            # exiting with an error makes mlx.launch stop it.
            sys.exit(1)


if __name__ == "__main__":
    main_(sys.argv[1], sys.argv[2])
