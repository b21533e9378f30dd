"""loom serve --kv-codec: every request it serves stores its KV cache in the codec, per family."""

from __future__ import annotations

import pytest

import mlx_loom
from mlx_loom.cli.main import main
from mlx_loom.errors import RequestError
from mlx_loom.generation import stream_generate
from mlx_loom.testing.checkpoints import write_checkpoint

from .conftest import serve

PROMPT = "the model reads a token"
KV = {"kv_codec": "turboquant", "kv_bits": 3, "quantized_kv_start": 2}
FAMILIES = ["llama", "qwen3_next", "gemma4_text"]


@pytest.fixture(scope="module", params=FAMILIES)
def family_checkpoint(request, tmp_path_factory):
    claim = mlx_loom.default_host().registry.model_types[request.param]
    path = tmp_path_factory.mktemp(request.param) / "ckpt"
    return write_checkpoint(path, claim.tiny_config, claim.checkpoint_tensors(claim.tiny_config))


@pytest.fixture(scope="module")
def served(family_checkpoint):
    model, tokenizer = mlx_loom.load(family_checkpoint)
    for client in serve(model, tokenizer, **KV):
        yield client, model, tokenizer


def test_completions_equal_the_api_with_the_same_codec(served):
    client, model, tokenizer = served
    body = {"prompt": PROMPT, "max_tokens": 8, "logprobs": 0}
    got = client.post("/v1/completions", body).json["choices"][0]
    want = list(stream_generate(model, tokenizer, PROMPT, max_tokens=8, **KV))
    plain = list(stream_generate(model, tokenizer, PROMPT, max_tokens=8))
    assert got["text"] == "".join(r.text for r in want)
    assert got["logprobs"]["token_logprobs"] == [r.logprob for r in want]
    assert got["logprobs"]["token_logprobs"] != [r.logprob for r in plain]


def test_chat_completions_answer_with_the_codec(served):
    client, _, _ = served
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 5}
    reply = client.post("/v1/chat/completions", body)
    assert reply.status == 200, reply.json
    assert reply.json["choices"][0]["message"]["role"] == "assistant"


def test_an_unknown_codec_fails_at_start(family_checkpoint):
    model, tokenizer = mlx_loom.load(family_checkpoint)
    with pytest.raises(RequestError, match="not a KV cache codec"):
        next(serve(model, tokenizer, kv_codec="zstd"))


def test_loom_serve_passes_the_codec_flags_on(family_checkpoint, monkeypatch):
    from mlx_loom.cli import serve_cmd
    from mlx_loom.serve import ServerStartError

    seen = {}

    def fake_make_server(**options):
        seen.update(options)
        raise ServerStartError("stop here", fix="none")

    monkeypatch.setattr(serve_cmd, "make_server", fake_make_server)
    args = ["serve", "--model", str(family_checkpoint), "--port", "0"]
    assert main([*args, "--kv-codec", "turboquant", "--kv-bits", "4"]) == 1
    assert (seen["kv_codec"], seen["kv_bits"]) == ("turboquant", 4)
