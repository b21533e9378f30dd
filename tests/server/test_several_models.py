"""Several models behind one server, through the real ``openai`` client.

Two families (a Llama and a Gemma 4) served together with room for one
model at a time answer every request — in any order, and concurrently —
exactly as a server of each model alone answers it, while the server swaps
them in and out; the Anthropic, Responses and utility endpoints route by
``model`` the same way; a model that cannot load answers its own error and
the others serve on.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

import mlx_loom
from mlx_loom.serve import make_server
from mlx_loom.serve.models import ServedModel
from mlx_loom.testing.checkpoints import write_checkpoint

from .conftest import Client, serve

FAMILIES = {"chat": "llama", "coder": "gemma4_text"}
MESSAGES = [{"role": "user", "content": "write a short poem"}]
PROMPT = "the model reads a token"


def _checkpoint(root: Path, model_type: str) -> Path:
    claim = mlx_loom.default_host().registry.model_types[model_type]
    return write_checkpoint(
        root / model_type, claim.tiny_config, claim.checkpoint_tensors(claim.tiny_config)
    )


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("several")
    out = {name: _checkpoint(root, family) for name, family in FAMILIES.items()}
    # a family no plugin claims, and weights that are not safetensors
    missing = root / "missing"
    missing.mkdir()
    (missing / "config.json").write_text(json.dumps({"model_type": "no_such_family"}))
    corrupt = root / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text((out["chat"] / "config.json").read_text())
    (corrupt / "model.safetensors").write_bytes(b"\xff" * 64)
    return {**out, "missing": missing, "corrupt": corrupt}


def ask(client: openai.OpenAI, model: str, kind: str) -> str:
    """One greedy answer: a chat (plain or streamed) or a completion with log-probabilities."""
    if kind == "completion":
        got = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1
        ).choices[0]
        return got.text + repr(got.logprobs.token_logprobs)
    if kind == "text":
        return client.completions.create(
            model=model, prompt=PROMPT, max_tokens=6, temperature=0
        ).choices[0].text
    kwargs = dict(model=model, messages=MESSAGES, max_tokens=8, temperature=0)
    if kind == "stream":
        chunks = client.chat.completions.create(stream=True, **kwargs)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return client.chat.completions.create(**kwargs).choices[0].message.content or ""


def openai_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)


KINDS = ("chat", "stream", "completion", "text")


@pytest.fixture(scope="module")
def alone(paths) -> dict[tuple[str, str], str]:
    """What a server of each model alone answers."""
    out = {}
    for name in FAMILIES:
        model, tokenizer = mlx_loom.load(paths[name])
        for client in serve(model, tokenizer, model_id=name):
            for kind in KINDS:
                out[name, kind] = ask(openai_client(client.server), name, kind)
    return out


@pytest.fixture(scope="module")
def swapping(paths) -> Iterator[Client]:
    """Both families and two broken checkpoints, with room for one loaded model."""
    names = (*FAMILIES, "missing", "corrupt")
    models = [ServedModel.from_ref(name, paths[name]) for name in names]
    server = make_server(models=models, max_loaded_models=1, port=0)
    server.start_in_background()
    try:
        yield Client(server)
    finally:
        server.stop()


def test_two_families_answer_as_alone_in_any_order_while_swapped(swapping, alone):
    client = openai_client(swapping.server)
    listed = {m.id: m.model_extra["loaded"] for m in client.models.list().data}
    assert listed == {"chat": True, "coder": False, "missing": False, "corrupt": False}
    order = [
        ("coder", "chat"),
        ("chat", "completion"),
        ("chat", "stream"),
        ("coder", "completion"),
        ("coder", "stream"),
        ("chat", "chat"),
    ]
    for name, kind in order:
        assert ask(client, name, kind) == alone[name, kind], (name, kind)
    models = {m["id"]: m for m in swapping.get("/health").json["models"]}
    assert models["chat"]["state"] == "loaded" and models["coder"]["state"] == "unloaded"
    assert models["coder"]["weight_bytes"] > 0 and models["coder"]["last_used"] is not None


def test_concurrent_requests_for_both_models_get_their_own_answers(swapping, alone):
    client = openai_client(swapping.server)
    loads = sum(m.loads for m in swapping.server.pool.status())
    # Tokens, not log-probabilities: a row batched with others may differ from
    # one alone in the last bits of its log-probabilities (as on one model).
    jobs = [(name, kind) for name in FAMILIES for kind in ("chat", "stream", "text")] * 2
    got: dict[int, str] = {}

    def run(i: int) -> None:
        got[i] = ask(client, *jobs[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert {i: got.get(i) for i in range(len(jobs))} == {
        i: alone[job] for i, job in enumerate(jobs)
    }
    assert sum(m.loads for m in swapping.server.pool.status()) > loads  # it swapped under load


def test_other_endpoints_route_by_model(swapping, paths):
    for name in FAMILIES:
        model, tokenizer = mlx_loom.load(paths[name])
        ids = tokenizer.encode(PROMPT)
        tokenized = swapping.post("/tokenize", {"model": name, "prompt": PROMPT}).json
        assert tokenized["tokens"] == ids
        text = swapping.post("/detokenize", {"model": name, "tokens": ids}).json["prompt"]
        assert text == tokenizer.decode(ids)
        body = {"model": name, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        reply = swapping.post("/v1/messages", body)
        assert reply.status == 200 and reply.json["model"] == name
        counted = swapping.post("/v1/messages/count_tokens", body).json
        assert counted["input_tokens"] > 0
        body = {"model": name, "input": "hi", "max_output_tokens": 4}
        reply = swapping.post("/v1/responses", body)
        assert reply.status == 200 and reply.json["model"] == name


def test_a_model_not_served_is_404_naming_the_served_ones(swapping):
    client = openai_client(swapping.server)
    with pytest.raises(openai.NotFoundError) as err:
        ask(client, "/etc/other-model", "chat")
    message = err.value.body["message"]
    assert all(repr(name) in message for name in (*FAMILIES, "missing", "corrupt"))
    body = {"model": "nope", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
    reply = swapping.post("/v1/messages", body)
    assert reply.status == 404 and reply.json["error"]["type"] == "not_found_error"
    assert swapping.get("/v1/models/nope").status == 404


@pytest.mark.parametrize("broken", ["missing", "corrupt"])
def test_a_model_that_cannot_load_gets_its_own_error_and_the_others_serve(swapping, alone, broken):
    client = openai_client(swapping.server)
    for _ in range(2):
        with pytest.raises(openai.InternalServerError) as err:
            ask(client, broken, "chat")
        assert err.value.status_code == 503
        assert err.value.body["code"] == "model_unavailable"
        assert f"{broken!r} failed to load" in err.value.body["message"]
    assert ask(client, "coder", "chat") == alone["coder", "chat"]
    models = {m["id"]: m for m in swapping.get("/health").json["models"]}
    assert models[broken]["state"] == "failed" and models[broken]["error"]


def test_loom_serve_serves_each_model_flag_under_its_id(paths, monkeypatch, capsys):
    from mlx_loom.cli import serve_cmd
    from mlx_loom.cli.main import main
    from mlx_loom.serve import ServerStartError

    seen: dict = {}

    def fake_make_server(**options):
        seen.update(options)
        raise ServerStartError("stop here", fix="none")

    monkeypatch.setattr(serve_cmd, "make_server", fake_make_server)
    args = ["serve", "--model", str(paths["chat"]), "--model", f"coder={paths['coder']}"]
    args += ["--max-loaded-models", "1", "--max-memory", "2GB", "--keep-alive", "5m"]
    args += ["--adapter", "coder:sql=./sql", "--port", "0"]
    assert main(args) == 1
    assert [m.id for m in seen["models"]] == [str(paths["chat"]), "coder"]
    assert [dict(m.adapters) for m in seen["models"]] == [{}, {"sql": "./sql"}]
    assert (seen["max_loaded_models"], seen["max_memory"], seen["keep_alive"]) == (1, 2e9, 300)
    assert main([*args[:5], "--draft-model", str(paths["chat"])]) == 2  # one drafter, two models
    assert "--draft-model applies to one model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    shown = capsys.readouterr().out
    assert all(f in shown for f in ("--max-loaded-models", "--max-memory", "--keep-alive"))
