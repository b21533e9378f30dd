"""``--adapter-path`` through every door, for every family: ``loom generate``,
``loom chat`` and ``loom serve`` answer exactly what the Python API answers
with the same adapter (and not what the base model answers)."""

from __future__ import annotations

import http.client
import io
import json
import threading

import pytest

import mlx_loom
from mlx_loom.cli import serve_cmd
from mlx_loom.cli.main import main

from . import adapterkit as kit

FAMILIES = [*kit.FAMILIES, "qwen3_5_text"]
TOKENS = 10


@pytest.fixture(scope="module", params=FAMILIES)
def adapted(request, base, tmp_path_factory):
    """``(base checkpoint, adapter, adapted model, tokenizer, base model)`` for one family."""
    path = base(request.param)
    if request.param == "qwen3_5_text":  # mlx-lm has no such model type to train with:
        trained_on = base("qwen3_5")  # same weights under the wrapper's names
    else:
        trained_on = path
    adapter = kit.write_adapter(trained_on, tmp_path_factory.mktemp("door") / "adapter")
    model, tokenizer = mlx_loom.load(path, adapter_path=adapter)
    plain, _ = mlx_loom.load(path)
    return path, adapter, model, tokenizer, plain


def _api(model, tokenizer, prompt) -> str:
    return mlx_loom.generate(model, tokenizer, prompt, max_tokens=TOKENS)


def test_loom_generate_applies_the_adapter(adapted, capsys):
    path, adapter, model, tokenizer, plain = adapted
    args = ["generate", "--model", str(path), "--adapter-path", str(adapter)]
    code = main([*args, "-p", "the cat", "--no-chat-template", "-m", str(TOKENS)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out == _api(model, tokenizer, "the cat") + "\n"
    assert out != _api(plain, tokenizer, "the cat") + "\n"


def test_loom_chat_applies_the_adapter(adapted, capsys, monkeypatch):
    path, adapter, model, tokenizer, _ = adapted
    monkeypatch.setattr("sys.stdin", io.StringIO("hello there\n"))
    args = ["chat", "--model", str(path), "--adapter-path", str(adapter), "-m", str(TOKENS)]
    code = main(args)
    out, err = capsys.readouterr()
    assert code == 0, err
    ids = tokenizer.encode_chat([{"role": "user", "content": "hello there"}])
    assert out == _api(model, tokenizer, ids) + "\n"


def test_loom_serve_applies_the_adapter(adapted, monkeypatch):
    path, adapter, model, tokenizer, _ = adapted
    started: list = []
    real = serve_cmd.make_server

    def capture(*args, **kwargs):
        server = real(*args, **kwargs)
        started.append(server)
        return server

    monkeypatch.setattr(serve_cmd, "make_server", capture)
    args = ["serve", "--model", str(path), "--adapter-path", str(adapter), "--port", "0"]
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
        conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
        body = {"prompt": "the cat", "max_tokens": TOKENS, "temperature": 0}
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "x/json"})
        reply = json.loads(conn.getresponse().read())
        conn.close()
    finally:
        server.shutdown()
        thread.join(30)
    assert codes == [0]
    assert reply["choices"][0]["text"] == _api(model, tokenizer, "the cat")
