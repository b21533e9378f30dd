"""Every model type an installed plugin claims, through every door, gives the same answer.

Driven by the registry rather than a list, so a family added to the
repository (or installed beside it) is covered the day it is registered. For
each model type's own tiny checkpoint (``ModelType.tiny_config``), greedy
decoding of one raw prompt and one chat turn is computed once through the
Python API; ``loom generate``, ``loom chat``, the OpenAI-compatible server
(completions and chat completions, through the real ``openai`` client) and
the Anthropic endpoint must each give exactly that text.
"""

from __future__ import annotations

import io
from collections.abc import Iterator

import anthropic
import openai
import pytest

import mlx_loom
from mlx_loom.cli.main import main
from mlx_loom.serve import make_server
from mlx_loom.testing.checkpoints import write_checkpoint

MODEL_TYPES = sorted(
    name
    for name, claim in mlx_loom.default_host().registry.model_types.items()
    if claim.tiny_config is not None and claim.checkpoint_tensors is not None
)
PROMPT = "the model reads a token"
TURN = "hello there"
N = 6


@pytest.fixture(scope="module", params=MODEL_TYPES)
def tiny(request, tmp_path_factory):
    claim = mlx_loom.default_host().registry.model_types[request.param]
    path = tmp_path_factory.mktemp(request.param) / "ckpt"
    write_checkpoint(path, claim.tiny_config, claim.checkpoint_tensors(claim.tiny_config))
    model, tokenizer = mlx_loom.load(path)
    # EOS is suppressed so every door decodes the full N tokens.
    eos = {t: -100.0 for t in sorted(tokenizer.eos_token_ids)}
    raw = mlx_loom.generate(model, tokenizer, PROMPT, max_tokens=N, logit_bias=eos)
    turn = tokenizer.encode_chat([{"role": "user", "content": TURN}], add_generation_prompt=True)
    chat = mlx_loom.generate(model, tokenizer, turn, max_tokens=N, logit_bias=eos)
    # The CLI has no logit-bias flag: its doors are compared with unbiased greedy runs.
    plain_raw = mlx_loom.generate(model, tokenizer, PROMPT, max_tokens=N)
    plain_chat = mlx_loom.generate(model, tokenizer, turn, max_tokens=N)
    return path, model, tokenizer, raw, chat, plain_raw, plain_chat


@pytest.fixture(scope="module")
def server(tiny) -> Iterator[str]:
    _, model, tokenizer, *_ = tiny
    served = make_server(model, tokenizer, host="127.0.0.1", port=0, model_id="m")
    served.start_in_background()
    try:
        yield served.url
    finally:
        served.stop()


def _bias(tokenizer) -> dict[str, int]:
    return {str(t): -100 for t in sorted(tokenizer.eos_token_ids)}


def test_the_api_answers(tiny):
    _, _, _, raw, chat, *_ = tiny
    assert raw and chat


def test_loom_generate_prints_the_apis_answer(tiny, capsys):
    path, *_, plain_raw, _ = tiny
    args = ["generate", PROMPT, "--model", str(path), "--no-chat-template", "--max-tokens", str(N)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.startswith(plain_raw)


def test_loom_chat_prints_the_apis_chat_answer(tiny, monkeypatch, capsys):
    path, *_, plain_chat = tiny
    monkeypatch.setattr("sys.stdin", io.StringIO(TURN + "\n"))
    assert main(["chat", "--model", str(path), "--max-tokens", str(N)]) == 0
    out = capsys.readouterr().out
    for line in filter(None, (s.strip() for s in plain_chat.split("\n"))):
        assert line.replace("<think>", "").replace("</think>", "").strip() in out


def test_the_openai_client_gets_the_apis_answers(tiny, server):
    _, _, tokenizer, raw, chat, *_ = tiny
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0)
    bias = _bias(tokenizer)
    done = client.completions.create(
        model="m", prompt=PROMPT, max_tokens=N, temperature=0, logit_bias=bias
    )
    assert done.choices[0].text == raw
    message = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": TURN}],
        max_tokens=N,
        temperature=0,
        logit_bias=bias,
    ).choices[0].message
    answer = (getattr(message, "reasoning_content", None) or "") + (message.content or "")
    assert answer.replace("<think>", "").replace("</think>", "").strip() in chat.replace(
        "<think>", ""
    ).replace("</think>", "")


def test_the_anthropic_client_gets_the_apis_chat_answer(tiny, server):
    *_, plain_chat = tiny
    client = anthropic.Anthropic(base_url=server, api_key="x", max_retries=0)
    reply = client.messages.create(
        model="m",
        max_tokens=N,
        messages=[{"role": "user", "content": TURN}],
        extra_body={"temperature": 0},
    )
    text = "".join(
        getattr(b, "thinking", None) or getattr(b, "text", None) or "" for b in reply.content
    )
    assert reply.usage.output_tokens >= 1
    strip = lambda s: "".join(s.replace("<think>", "").replace("</think>", "").split())  # noqa: E731
    assert strip(text) == strip(plain_chat) or reply.stop_reason == "tool_use"
