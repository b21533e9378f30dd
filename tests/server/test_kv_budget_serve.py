"""``loom serve --max-kv-bytes``: a request whose KV caches do not fit beside the running
ones waits in the queue, one that could never fit is a 503 with Retry-After, and
``/health`` shows the bytes reserved and the budget."""

from __future__ import annotations

import threading
import time

import mlx_loom
from mlx_loom.cli.main import build_parser
from mlx_loom.cli.serve_cmd import engine_settings
from mlx_loom.engine import EngineSettings
from mlx_loom.engine.kv_budget import KVBudget

from .conftest import serve
from .test_batching import body, open_stream

#: The running stream and its reservation: 2,000 tokens at most (one probe granule: 2,048).
LONG = ("the model reads a token", 2000)


def test_kv_budget_queues_what_does_not_fit_and_refuses_what_never_could(checkpoint):
    model, tokenizer = mlx_loom.load(checkpoint)
    long_cost = KVBudget(model, 1).probe(2048, None, 2048)
    small_cost = KVBudget(model, 1).probe(256, None, 2048)
    budget = long_cost + small_cost // 2  # the long stream, and not even a short one beside it
    gen = serve(model, tokenizer, engine=EngineSettings(max_kv_bytes=budget, max_queued=4))
    client = next(gen)
    try:
        health = client.get("/health").json
        assert health["kv_bytes"] == {"reserved": 0, "max": budget}
        running = open_stream(client, body(tokenizer, *LONG, True))
        try:
            assert client.get("/health").json["kv_bytes"]["reserved"] == long_cost
            # Alone it would fit; beside the running stream it waits for its bytes.
            replies = []
            waiter = threading.Thread(
                target=lambda: replies.append(
                    client.post("/v1/completions", {"prompt": "hi", "max_tokens": 3})
                )
            )
            waiter.start()
            deadline = time.monotonic() + 10
            while client.get("/health").json["queued"] < 1:
                assert time.monotonic() < deadline, "the small request never queued"
                time.sleep(0.01)
            health = client.get("/health").json
            assert health["active_rows"] == 1 and health["kv_bytes"]["reserved"] == long_cost
            # More than the whole budget: refused at once, whatever runs.
            big = client.post("/v1/completions", {"prompt": "hi", "max_tokens": 3000})
            assert big.status == 503 and big.headers.get("Retry-After") == "1"
            assert big.error["code"] == "kv_budget" and "max_kv_bytes" in big.error["message"]
        finally:
            running.close()  # the long stream goes: the waiting request gets its bytes
        waiter.join(60)
        assert replies and replies[0].status == 200, replies
        deadline = time.monotonic() + 10
        while client.get("/health").json["kv_bytes"]["reserved"]:
            assert time.monotonic() < deadline, "a reservation was never given back"
            time.sleep(0.01)
    finally:
        gen.close()


def test_the_max_kv_bytes_flag_sets_the_engine_budget():
    args = build_parser().parse_args(["serve", "--model", "m", "--max-kv-bytes", "2MB"])
    assert engine_settings(args).max_kv_bytes == 2_000_000
    args = build_parser().parse_args(["serve", "--model", "m"])
    assert engine_settings(args).max_kv_bytes is None
