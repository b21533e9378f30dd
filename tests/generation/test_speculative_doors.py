"""Speculative decoding through every door, for every family: the same text as without it.

``loom generate`` and ``loom chat`` take ``--draft-model`` / ``--draft ngram``
/ ``--num-draft-tokens``; ``loom serve`` takes them as every request's
default, and a request's ``draft`` field picks another drafter (or none) for
itself; speculative and plain requests share the server's batches.
"""

from __future__ import annotations

import io
import threading

import pytest

import mlx_loom
from mlx_loom.cli.main import main
from mlx_loom.engine import Speculation
from mlx_loom.testing.checkpoints import write_checkpoint

from ..server.conftest import serve

FAMILIES = ["llama", "qwen3_next", "gemma4_text", "gpt_oss"]


@pytest.fixture(scope="module", params=FAMILIES)
def family_checkpoint(request, tmp_path_factory):
    claim = mlx_loom.default_host().registry.model_types[request.param]
    path = tmp_path_factory.mktemp(request.param) / "ckpt"
    return write_checkpoint(path, claim.tiny_config, claim.checkpoint_tensors(claim.tiny_config))


def generate_cli(capsys, checkpoint, *extra):
    code = main(["generate", "--model", str(checkpoint), "-p", "hello there", "-m", "12", *extra])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


@pytest.mark.parametrize(
    "flags", [["--draft", "ngram"], ["--draft-model", "SELF", "--num-draft-tokens", "2"]]
)
def test_loom_generate_speculates_to_the_same_text(family_checkpoint, capsys, flags):
    flags = [str(family_checkpoint) if f == "SELF" else f for f in flags]
    assert generate_cli(capsys, family_checkpoint, *flags) == generate_cli(
        capsys, family_checkpoint
    )


def test_loom_generate_refuses_both_drafters(family_checkpoint, capsys):
    code = main(
        ["generate", "--model", str(family_checkpoint), "-p", "hi", "--draft", "ngram"]
        + ["--draft-model", str(family_checkpoint)]
    )
    assert code != 0
    assert "--draft and --draft-model were both given" in capsys.readouterr().err


def chat_cli(capsys, monkeypatch, checkpoint, *extra):
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\nand then?\n"))
    code = main(["chat", "--model", str(checkpoint), "-m", "8", *extra])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def test_loom_chat_speculates_to_the_same_replies(family_checkpoint, capsys, monkeypatch):
    """Two turns: the second reuses the conversation's prompt cache, speculating."""
    plain = chat_cli(capsys, monkeypatch, family_checkpoint)
    self_draft = ["--draft-model", str(family_checkpoint)]
    drafted = chat_cli(capsys, monkeypatch, family_checkpoint, *self_draft)
    ngram = chat_cli(capsys, monkeypatch, family_checkpoint, "--draft", "ngram")
    assert drafted == plain == ngram


def chat_body(draft=None, **extra):
    body = {"messages": [{"role": "user", "content": "tell me more"}], "max_tokens": 10}
    if draft is not None:
        body["draft"] = draft
    return {**body, **extra}


def reply(client, body):
    r = client.post("/v1/chat/completions", body)
    assert r.status == 200, r.json
    return r.json["choices"][0]["message"]["content"]


def test_loom_serve_speculates_per_request_and_batches_with_plain_requests(family_checkpoint):
    model, tok = mlx_loom.load(family_checkpoint)
    gen = serve(model, tok, model_id="m", speculation=Speculation(model, 3))
    client = next(gen)
    try:
        plain = reply(client, chat_body("none"))
        assert reply(client, chat_body()) == plain  # the server's draft model
        assert reply(client, chat_body("ngram", num_draft_tokens=2)) == plain
        # Concurrent speculative and plain requests decode in the same engine.
        results: dict[str, str] = {}
        threads = [
            threading.Thread(target=lambda d=d: results.__setitem__(d, reply(client, chat_body(d))))
            for d in ("none", "model", "ngram")
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert results == {"none": plain, "model": plain, "ngram": plain}
    finally:
        gen.close()


def test_loom_serve_refuses_a_draft_it_cannot_honour(family_checkpoint):
    model, tok = mlx_loom.load(family_checkpoint)
    gen = serve(model, tok, model_id="m")
    client = next(gen)
    try:
        for body, param in [
            (chat_body("model"), "draft"),
            (chat_body("medusa"), "draft"),
            (chat_body(num_draft_tokens=2), "num_draft_tokens"),
            (chat_body("ngram", num_draft_tokens=0), "num_draft_tokens"),
        ]:
            r = client.post("/v1/chat/completions", body)
            assert r.status == 400 and r.error["param"] == param, r.json
    finally:
        gen.close()
