"""Half-precision KV storage through every door, for every cache kind.

For a full-attention model with a rotating window (Llama with sliding
layers), recurrent state (Qwen3-Next) and KV-shared layers beside rotating
windows (Gemma 4): the Python API's greedy answer with ``kv_dtype="float16"``
is what ``loom generate --kv-dtype float16``, ``loom chat --kv-dtype
float16``, and a server over the same model (the openai client, plain and
streamed, and the anthropic client) give, and the caches the engine builds
hold float16 keys.
"""

from __future__ import annotations

import io
from collections.abc import Iterator

import anthropic
import mlx.core as mx
import openai
import pytest

import mlx_loom
from mlx_loom.cli.main import main
from mlx_loom.serve import make_server
from mlx_loom.testing.checkpoints import write_checkpoint

N = 6
PROMPT = "the model reads a token"
TURN = "hello there"
KINDS = {
    "llama-sliding": (
        "llama",
        {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 6},
    ),
    "qwen3_next": ("qwen3_next", {}),
    "gemma4_text": ("gemma4_text", {}),
}


@pytest.fixture(scope="module", params=sorted(KINDS))
def half(request, tmp_path_factory):
    model_type, overrides = KINDS[request.param]
    claim = mlx_loom.default_host().registry.model_types[model_type]
    config = {**claim.tiny_config, **overrides}
    path = tmp_path_factory.mktemp(request.param) / "ckpt"
    write_checkpoint(path, config, claim.checkpoint_tensors(config))
    model, tokenizer = mlx_loom.load(path, kv_dtype="float16")
    raw = mlx_loom.generate(model, tokenizer, PROMPT, max_tokens=N)
    turn = tokenizer.encode_chat([{"role": "user", "content": TURN}], add_generation_prompt=True)
    chat = mlx_loom.generate(model, tokenizer, turn, max_tokens=N)
    return path, model, tokenizer, raw, chat


@pytest.fixture(scope="module")
def server(half) -> Iterator[str]:
    _, model, tokenizer, *_ = half
    served = make_server(model, tokenizer, host="127.0.0.1", port=0, model_id="m")
    served.start_in_background()
    try:
        yield served.url
    finally:
        served.stop()


def _plain(text: str) -> str:
    return "".join(text.replace("<think>", "").replace("</think>", "").split())


def test_the_engines_caches_hold_float16_keys(half):
    _, model, *_ = half
    caches = model.make_cache()
    model(mx.array([[5, 6, 7]]), cache=caches)
    stored = [c.keys.dtype for c in caches if getattr(c, "keys", None) is not None]
    assert stored and all(d == mx.float16 for d in stored)


def test_loom_generate_with_half_kv_prints_the_apis_answer(half, capsys):
    path, _, _, raw, _ = half
    args = ["generate", PROMPT, "--model", str(path), "--no-chat-template"]
    assert main([*args, "--max-tokens", str(N), "--kv-dtype", "float16"]) == 0
    assert capsys.readouterr().out.startswith(raw)


def test_loom_chat_with_half_kv_prints_the_apis_answer(half, monkeypatch, capsys):
    path, *_, chat = half
    monkeypatch.setattr("sys.stdin", io.StringIO(TURN + "\n"))
    args = ["chat", "--model", str(path), "--max-tokens", str(N), "--kv-dtype", "float16"]
    assert main(args) == 0
    assert _plain(chat) in _plain(capsys.readouterr().out)


def test_the_clients_get_the_apis_answers_over_half_kv(half, server):
    *_, raw, chat = half
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0)
    done = client.completions.create(model="m", prompt=PROMPT, max_tokens=N, temperature=0)
    assert done.choices[0].text and raw.startswith(done.choices[0].text)
    messages = [{"role": "user", "content": TURN}]
    reply = client.chat.completions.create(
        model="m", messages=messages, max_tokens=N, temperature=0
    ).choices[0].message
    answer = (getattr(reply, "reasoning_content", None) or "") + (reply.content or "")
    streamed = "".join(
        (getattr(c.choices[0].delta, "reasoning_content", None) or "")
        + (c.choices[0].delta.content or "")
        for c in client.chat.completions.create(
            model="m", messages=messages, max_tokens=N, temperature=0, stream=True
        )
        if c.choices
    )
    assert _plain(answer) and _plain(answer) == _plain(streamed)
    assert _plain(answer) in _plain(chat)
    message = anthropic.Anthropic(base_url=server, api_key="x", max_retries=0).messages.create(
        model="m", max_tokens=N, messages=messages, extra_body={"temperature": 0}
    )
    text = "".join(
        getattr(b, "thinking", None) or getattr(b, "text", None) or "" for b in message.content
    )
    assert _plain(text) in _plain(chat) or message.stop_reason == "tool_use"
