"""Per-request adapters in ``loom serve``, for every family.

Adapters registered at start-up (``--adapter NAME=PATH``) are picked per
request — by the model id ``<model>:<name>`` or the ``adapter`` field (or
mlx-lm's ``adapters``) — and concurrent requests with different adapters, and
none, decode in one batch, each answering exactly what the model loaded with
only its adapter answers.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
from typing import Any

import pytest

import mlx_loom
from mlx_loom.adapters import AdapterSet
from mlx_loom.cli import serve_cmd
from mlx_loom.cli.main import main
from mlx_loom.serve import make_server

from . import adapterkit as kit
from .test_rows import _pair

MODEL_ID = "tiny"


@pytest.fixture(scope="module", params=kit.FAMILIES)
def served(request, base, tmp_path_factory):
    """``(base path, {name: adapter path}, tokenizer, server)`` with two adapters registered."""
    path, adapters = _pair(base, tmp_path_factory.mktemp("served"), request.param)
    model, tokenizer = mlx_loom.load(path)
    AdapterSet(model, adapters)
    server = make_server(model, tokenizer, host="127.0.0.1", port=0, model_id=MODEL_ID)
    server.start_in_background()
    yield path, adapters, tokenizer, server
    server.stop()


def _post(server, route: str, body: dict[str, Any]) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    try:
        conn.request("POST", route, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def _get(server, route: str) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.request("GET", route)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def _no_eos(tokenizer) -> dict[str, float]:
    return {str(t): -100 for t in sorted(tokenizer.eos_token_ids)}


def _solo(path, adapter, tokenizer, prompt: str, max_tokens: int) -> str:
    model = mlx_loom.load(path, adapter_path=adapter)[0]
    bias = {t: -100.0 for t in tokenizer.eos_token_ids}
    return mlx_loom.generate(model, tokenizer, prompt, max_tokens=max_tokens, logit_bias=bias)


def _stream_text(server, body: dict[str, Any], started: threading.Event | None) -> str:
    data = json.dumps({**body, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=120) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
            if started is not None and b"data: " in raw:
                started.set()
    head, _, events = raw.decode().partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 200"), head
    text = []
    for block in events.split("\n\n"):
        payload = block.removeprefix("data: ")
        if block.startswith("data: ") and payload != "[DONE]":
            text.append(json.loads(payload)["choices"][0]["text"])
    return "".join(text)


#: (how the request picks, the adapter it should get, prompt, max_tokens); the first runs longest
PICKS = [
    ({"model": f"{MODEL_ID}:lora"}, "lora", "the model reads a token", 40),
    ({"model": MODEL_ID}, None, "hello world", 12),
    ({"adapter": "dora"}, "dora", "a b c d e f g", 12),
    ({"model": f"{MODEL_ID}:dora", "adapter": "dora"}, "dora", "hello world", 10),
]


def test_concurrent_requests_with_different_adapters_share_a_batch_and_equal_their_solo_runs(
    served,
):
    path, adapters, tokenizer, server = served
    bias = _no_eos(tokenizer)
    bodies = [{**pick, "prompt": p, "max_tokens": n, "logit_bias": bias} for pick, _, p, n in PICKS]
    got: list[str | None] = [None] * len(PICKS)
    started = threading.Event()

    def run(i: int) -> None:
        got[i] = _stream_text(server, bodies[i], started if i == 0 else None)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PICKS))]
    threads[0].start()
    assert started.wait(60), "the first stream never started"
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join(120)
    assert server.app.worker.stats().engine.peak_decoding >= 2, "the requests did not overlap"
    expected = [_solo(path, adapters.get(a), tokenizer, p, n) for _, a, p, n in PICKS]
    assert got == expected
    assert got[1] != _solo(path, adapters["lora"], tokenizer, PICKS[1][2], PICKS[1][3])


def test_the_model_list_names_each_adapter(served):
    *_, server = served
    status, body = _get(server, "/v1/models")
    assert status == 200
    assert [card["id"] for card in body["data"]] == [
        MODEL_ID,
        f"{MODEL_ID}:lora",
        f"{MODEL_ID}:dora",
    ]
    status, card = _get(server, f"/v1/models/{MODEL_ID}:dora")
    assert (status, card["id"]) == (200, f"{MODEL_ID}:dora")


def test_a_reply_names_the_model_id_with_its_adapter(served):
    *_, server = served
    status, reply = _post(
        server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "adapter": "lora"}
    )
    assert (status, reply["model"]) == (200, f"{MODEL_ID}:lora")


def test_mlx_lms_adapters_field_picks_a_registered_adapter_by_path(served):
    path, adapters, tokenizer, server = served
    body = {"prompt": "hello world", "max_tokens": 6, "logit_bias": _no_eos(tokenizer)}
    status, reply = _post(server, "/v1/completions", {**body, "adapters": str(adapters["dora"])})
    assert status == 200, reply
    assert reply["choices"][0]["text"] == _solo(path, adapters["dora"], tokenizer, "hello world", 6)


@pytest.mark.parametrize(
    "pick, param",
    [
        ({"model": f"{MODEL_ID}:sql"}, "model"),
        ({"adapter": "sql"}, "adapter"),
        ({"adapters": "/nowhere/adapters"}, "adapters"),
    ],
)
def test_an_adapter_that_is_not_served_is_a_404_naming_the_served_ones(served, pick, param):
    *_, server = served
    status, reply = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, **pick})
    assert status == 404
    assert reply["error"]["param"] == param
    assert "served: lora, dora" in reply["error"]["message"]


def test_a_request_picking_two_different_adapters_is_a_400(served):
    *_, server = served
    body = {"prompt": "hi", "max_tokens": 2, "model": f"{MODEL_ID}:lora", "adapter": "dora"}
    status, reply = _post(server, "/v1/completions", body)
    assert status == 400
    assert "picks different adapters" in reply["error"]["message"]


def test_a_chat_request_picks_its_adapter_by_model_id(served):
    path, adapters, tokenizer, server = served
    messages = [{"role": "user", "content": "hello there"}]
    body = {"messages": messages, "max_tokens": 6, "logit_bias": _no_eos(tokenizer)}
    status, reply = _post(server, "/v1/chat/completions", {**body, "model": f"{MODEL_ID}:lora"})
    assert status == 200, reply
    ids = tokenizer.encode_chat(messages)
    model = mlx_loom.load(path, adapter_path=adapters["lora"])[0]
    bias = {t: -100.0 for t in tokenizer.eos_token_ids}
    want = mlx_loom.generate(model, tokenizer, ids, max_tokens=6, logit_bias=bias)
    assert reply["choices"][0]["message"]["content"] == want


def test_a_server_without_adapters_refuses_an_adapter_field(base):
    model, tokenizer = mlx_loom.load(base("llama"))
    server = make_server(model, tokenizer, host="127.0.0.1", port=0, model_id=MODEL_ID)
    server.start_in_background()
    try:
        status, reply = _post(server, "/v1/completions", {"prompt": "hi", "adapter": "lora"})
    finally:
        server.stop()
    assert status == 400
    assert reply["error"]["param"] == "adapter"
    assert "--adapter NAME=PATH" in reply["error"]["fix"]


def test_loom_serve_registers_repeated_adapter_flags(base, tmp_path, monkeypatch):
    path, adapters = _pair(base, tmp_path, "qwen3_5")
    started: list = []
    real = serve_cmd.make_server

    def capture(*args, **kwargs):
        server = real(*args, **kwargs)
        started.append(server)
        return server

    monkeypatch.setattr(serve_cmd, "make_server", capture)
    args = ["serve", "--model", str(path), "--port", "0"]
    for name, where in adapters.items():
        args += ["--adapter", f"{name}={where}"]
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(main(args)), daemon=True)
    thread.start()
    for _ in range(600):
        if started:
            break
        thread.join(0.05)
    assert started, "loom serve did not start"
    server = started[0]
    try:
        tokenizer = server.app.tokenizer
        body = {"prompt": "the cat", "max_tokens": 6, "logit_bias": _no_eos(tokenizer)}
        status, reply = _post(server, "/v1/completions", {**body, "model": f"{path}:dora"})
    finally:
        server.shutdown()
        thread.join(30)
    assert codes == [0]
    assert status == 200, reply
    assert reply["choices"][0]["text"] == _solo(path, adapters["dora"], tokenizer, "the cat", 6)


@pytest.mark.parametrize("spec", ["lora", "=./a", "a:b=./a"])
def test_loom_serve_refuses_a_malformed_adapter_flag_before_loading(spec, capsys):
    code = main(["serve", "--model", "/nowhere/model", "--adapter", spec, "--port", "0"])
    err = capsys.readouterr().err
    assert code != 0
    assert "--adapter" in err or "not usable" in err
    assert "/nowhere/model" not in err  # it never got as far as loading


def test_loom_serve_refuses_adapter_flags_beside_an_adapter_path(base, tmp_path, capsys):
    path, adapters = _pair(base, tmp_path, "llama")
    args = ["serve", "--model", str(path), "--adapter-path", str(adapters["lora"])]
    code = main([*args, "--adapter", f"dora={adapters['dora']}", "--port", "0"])
    err = capsys.readouterr().err
    assert code != 0
    assert "already runs an adapter" in err


# --- a server-wide draft beside adapters --------------------------------------------


@pytest.fixture(scope="module")
def drafting(base, tmp_path_factory):
    """A llama server that speculates by default (prompt lookup), with adapters registered."""
    from mlx_loom.engine import Speculation

    path, adapters = _pair(base, tmp_path_factory.mktemp("drafting"), "llama")
    model, tokenizer = mlx_loom.load(path)
    AdapterSet(model, adapters)
    server = make_server(
        model, tokenizer, host="127.0.0.1", port=0, model_id=MODEL_ID, speculation=Speculation()
    )
    server.start_in_background()
    yield path, adapters, tokenizer, server
    server.stop()


def test_adapter_requests_decode_without_the_servers_default_draft(drafting):
    # Before, every adapter request was a 400 unless it sent "draft": "none".
    path, adapters, tokenizer, server = drafting
    body = {"prompt": "hello world", "max_tokens": 10, "logit_bias": _no_eos(tokenizer)}
    status, reply = _post(server, "/v1/completions", {**body, "model": f"{MODEL_ID}:lora"})
    assert status == 200, reply
    want = _solo(path, adapters["lora"], tokenizer, "hello world", 10)
    assert reply["choices"][0]["text"] == want
    status, reply = _post(server, "/v1/completions", {**body, "model": MODEL_ID})
    assert status == 200, reply  # the base model still speculates
    assert reply["choices"][0]["text"] == _solo(path, None, tokenizer, "hello world", 10)


@pytest.mark.parametrize(
    ("extra", "param"),
    [({"draft": "ngram"}, "draft"), ({"num_draft_tokens": 4}, "num_draft_tokens")],
)
def test_an_adapter_request_asking_to_draft_is_a_400_naming_the_http_field(drafting, extra, param):
    *_, server = drafting
    body = {"prompt": "hi", "max_tokens": 2, "model": f"{MODEL_ID}:lora", **extra}
    status, reply = _post(server, "/v1/completions", body)
    assert status == 400
    error = reply["error"]
    assert error["param"] == param
    assert f'drop "{param}"' in error["message"] and "draft_model" not in error["message"]
