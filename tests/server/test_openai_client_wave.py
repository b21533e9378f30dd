"""This wave's server features through the real ``openai`` client, for every family.

Speculation chosen per request (``extra_body={"draft": ...}``) and a server-wide
KV codec, plain and streamed: what an OpenAI client receives equals what the
Python API generates for the same request.
"""

from __future__ import annotations

import openai
import pytest

import mlx_loom
from mlx_loom.engine import Speculation
from mlx_loom.generation import stream_generate
from mlx_loom.testing.checkpoints import write_checkpoint

from .conftest import serve

FAMILIES = ["llama", "qwen3_next", "gemma4_text"]
MESSAGES = [{"role": "user", "content": "tell me more"}]
PROMPT = "the model reads a token"
KV = {"kv_codec": "turboquant", "kv_bits": 3, "quantized_kv_start": 2}


@pytest.fixture(scope="module", params=FAMILIES)
def loaded(request, tmp_path_factory):
    claim = mlx_loom.default_host().registry.model_types[request.param]
    path = tmp_path_factory.mktemp(request.param) / "ckpt"
    write_checkpoint(path, claim.tiny_config, claim.checkpoint_tensors(claim.tiny_config))
    return mlx_loom.load(path)


def openai_client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.server.url}/v1", api_key="x", max_retries=0)


def chat(client: openai.OpenAI, *, stream: bool, **extra) -> str:
    kwargs = dict(model="m", messages=MESSAGES, max_tokens=10, temperature=0, extra_body=extra)
    if not stream:
        return client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = client.chat.completions.create(stream=True, **kwargs)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_speculation_per_request_gives_the_plain_answer_plain_and_streamed(loaded):
    model, tokenizer = loaded
    for served in serve(model, tokenizer, model_id="m", speculation=Speculation(model, 3)):
        client = openai_client(served)
        plain = chat(client, stream=False, draft="none")
        assert plain
        for draft in ("model", "ngram"):
            assert chat(client, stream=False, draft=draft) == plain
            assert chat(client, stream=True, draft=draft) == plain
        with pytest.raises(openai.BadRequestError):  # the field reaches the server
            chat(client, stream=False, draft="no-such-drafter")


def test_a_server_wide_kv_codec_answers_as_the_api_plain_and_streamed(loaded):
    model, tokenizer = loaded
    steps = list(stream_generate(model, tokenizer, PROMPT, max_tokens=8, **KV))
    plain = list(stream_generate(model, tokenizer, PROMPT, max_tokens=8))
    want = "".join(r.text for r in steps)
    for served in serve(model, tokenizer, model_id="m", **KV):
        client = openai_client(served)
        got = client.completions.create(
            model="m", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=0
        ).choices[0]
        assert got.text == want
        assert got.logprobs.token_logprobs == [r.logprob for r in steps]
        assert got.logprobs.token_logprobs != [r.logprob for r in plain]
        chunks = client.completions.create(
            model="m", prompt=PROMPT, max_tokens=8, temperature=0, stream=True
        )
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want
