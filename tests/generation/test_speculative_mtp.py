"""Drafting with the model's own multi-token-prediction head through every door:
the Python API, ``loom generate``, ``loom chat`` and ``loom serve`` (the openai client).

The Qwen3-Next and Qwen3.5 plugins' tiny checkpoints, with the ``mtp.*`` head
their configs declare (random: its drafts are mostly rejected, which is what
tests the rollback); a family without such a head is refused.
"""

from __future__ import annotations

import io

import anthropic
import openai
import pytest

import mlx_loom
from mlx_loom.cli.main import main
from mlx_loom.engine import Speculation
from mlx_loom.errors import CapabilityRefused
from mlx_loom.testing.checkpoints import write_checkpoint

from ..server.conftest import serve
from .conftest import SPEC_PROMPT as PROMPT
from .conftest import make_llama

TEXT = "the model reads a token and the model reads a token"


def mtp_checkpoint(path, model_type):
    """The plugin's tiny checkpoint of ``model_type``, declaring (and shipping) one MTP layer."""
    claim = mlx_loom.default_host().registry.model_types[model_type]
    config = dict(claim.tiny_config)
    if "text_config" in config:
        config["text_config"] = {**config["text_config"], "mtp_num_hidden_layers": 1}
    else:
        config["num_nextn_predict_layers"] = 1
    return write_checkpoint(path, config, claim.checkpoint_tensors(config))


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5"])
def checkpoint(request, tmp_path_factory):
    return mtp_checkpoint(tmp_path_factory.mktemp("mtp"), request.param)


@pytest.fixture(scope="module")
def loaded(checkpoint):
    model, tokenizer = mlx_loom.load(checkpoint)
    yield model, tokenizer
    model.close_engine()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_llama(tmp_path_factory.mktemp("llama") / "ckpt")


def test_generate_with_draft_mtp_gives_the_plain_greedy_text(loaded):
    model, tokenizer = loaded
    before = model.engine.stats().engine.draft_tokens
    got = mlx_loom.generate(model, tokenizer, TEXT, max_tokens=12, draft="mtp", num_draft_tokens=3)
    assert got == mlx_loom.generate(model, tokenizer, TEXT, max_tokens=12)
    assert model.engine.stats().engine.draft_tokens > before


def test_batch_generate_with_draft_mtp_gives_each_prompts_plain_greedy_text(loaded):
    model, tokenizer = loaded
    prompts = [TEXT, "a token", "reads and reads and reads"]
    got = mlx_loom.batch_generate(model, tokenizer, prompts, max_tokens=10, draft="mtp")
    assert got.texts == mlx_loom.batch_generate(model, tokenizer, prompts, max_tokens=10).texts


def test_a_family_without_an_mtp_head_refuses_draft_mtp(llama):
    model, _ = mlx_loom.load(llama)
    try:
        with pytest.raises(CapabilityRefused, match="has no multi-token-prediction head"):
            list(mlx_loom.stream_generate(model, None, PROMPT, max_tokens=4, draft="mtp"))
    finally:
        model.close_engine()


# --- the command line -------------------------------------------------------------------


def cli(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_loom_generate_with_draft_mtp_gives_the_plain_text(checkpoint, capsys):
    base = ["generate", "--model", str(checkpoint), "-p", "hello there", "-m", "12"]
    code, drafted, err = cli(capsys, *base, "--draft", "mtp", "--num-draft-tokens", "2")
    assert code == 0, err
    assert (0, drafted) == cli(capsys, *base)[:2]


def test_loom_chat_with_draft_mtp_gives_the_plain_replies(checkpoint, capsys, monkeypatch):
    """Two turns: the second reuses the conversation's prompt cache (the head's context
    then starts after the reused prefix)."""

    def chat(*extra):
        monkeypatch.setattr("sys.stdin", io.StringIO("hello\nand then?\n"))
        code, out, err = cli(capsys, "chat", "--model", str(checkpoint), "-m", "8", *extra)
        assert code == 0, err
        return out

    assert chat("--draft", "mtp") == chat()


def test_loom_generate_refuses_draft_mtp_for_a_model_without_a_head(llama, capsys):
    code, _, err = cli(capsys, "generate", "--model", str(llama), "-p", "hi", "--draft", "mtp")
    assert code != 0
    assert "no multi-token-prediction head" in err and "ngram" in err


# --- the server ---------------------------------------------------------------------------


def test_loom_serve_drafts_with_mtp_per_request_and_by_default_for_both_clients(loaded):
    model, tokenizer = loaded
    kwargs = dict(model="m", messages=[{"role": "user", "content": "tell me more"}])
    kwargs.update(max_tokens=10, temperature=0)

    def ask(client, stream=False, **extra):
        if not stream:
            out = client.chat.completions.create(extra_body=extra, **kwargs)
            return out.choices[0].message.content
        chunks = client.chat.completions.create(stream=True, extra_body=extra, **kwargs)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    for served in serve(model, tokenizer, model_id="m", speculation=Speculation(None, 3, mtp=True)):
        client = openai.OpenAI(base_url=f"{served.server.url}/v1", api_key="x", max_retries=0)
        plain = ask(client, draft="none")
        assert plain
        assert ask(client) == ask(client, stream=True) == plain  # the server's default: mtp
        assert ask(client, draft="mtp", num_draft_tokens=1) == plain
        assert ask(client, draft="ngram") == plain
        # The anthropic client's requests get the server's default drafter.
        messages = anthropic.Anthropic(base_url=served.server.url, api_key="x", max_retries=0)
        before = model.engine.stats().engine.draft_tokens
        message = messages.messages.create(
            model="m", max_tokens=10, messages=kwargs["messages"], extra_body={"temperature": 0}
        )
        assert message.content[0].text == plain
        assert model.engine.stats().engine.draft_tokens > before


def test_loom_serve_refuses_mtp_for_a_model_without_a_head(llama):
    model, tokenizer = mlx_loom.load(llama)
    try:
        with pytest.raises(CapabilityRefused, match="--draft mtp"):
            next(serve(model, tokenizer, speculation=Speculation(None, 3, mtp=True)))
        for served in serve(model, tokenizer, model_id="m"):
            client = openai.OpenAI(base_url=f"{served.server.url}/v1", api_key="x", max_retries=0)
            with pytest.raises(openai.UnprocessableEntityError, match="multi-token-prediction"):
                client.chat.completions.create(
                    model="m",
                    messages=[{"role": "user", "content": "hi"}],
                    max_tokens=4,
                    extra_body={"draft": "mtp"},
                )
    finally:
        model.close_engine()


def test_loom_convert_keeps_the_head_quantized_and_it_still_drafts_the_plain_text(
    checkpoint, tmp_path, capsys
):
    q4 = tmp_path / "q4"
    code, _, err = cli(capsys, "convert", "--hf-path", str(checkpoint), "--mlx-path", str(q4), "-q")
    assert code == 0, err
    model, tokenizer = mlx_loom.load(q4)
    try:
        assert model.mtp_refusal() is None
        assert hasattr(model.module.mtp.fc, "scales")  # quantized with the rest
        plain = mlx_loom.generate(model, tokenizer, TEXT, max_tokens=10)
        assert mlx_loom.generate(model, tokenizer, TEXT, max_tokens=10, draft="mtp") == plain
    finally:
        model.close_engine()
