"""--kv-bits, --kv-group-size and --quantized-kv-start quantize every request's KV cache."""

from __future__ import annotations

import pytest

import mlx_loom
from mlx_loom.cli.main import main
from mlx_loom.errors import RequestError
from mlx_loom.generation import stream_generate

from .conftest import serve

PROMPT = "the model reads a token"
KV = {"kv_bits": 8, "kv_group_size": 32, "quantized_kv_start": 4}


@pytest.fixture(scope="module")
def quantized(checkpoint):
    model, tokenizer = mlx_loom.load(checkpoint)
    yield from serve(model, tokenizer, **KV)


def test_completions_equal_the_engine_with_the_same_kv_quantization(quantized, oracle):
    model, tokenizer = oracle
    body = {"prompt": PROMPT, "max_tokens": 12, "logprobs": 0}
    got = quantized.post("/v1/completions", body).json["choices"][0]
    want = list(stream_generate(model, tokenizer, PROMPT, max_tokens=12, **KV))
    plain = list(stream_generate(model, tokenizer, PROMPT, max_tokens=12))
    assert got["text"] == "".join(r.text for r in want)
    assert got["logprobs"]["token_logprobs"] == [r.logprob for r in want]
    # The quantization is really applied: unquantized log-probabilities differ.
    assert got["logprobs"]["token_logprobs"] != [r.logprob for r in plain]


def test_a_follow_up_reusing_the_quantized_cache_is_still_exact(quantized, oracle):
    model, tokenizer = oracle
    first = quantized.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 6}).json
    longer = PROMPT + first["choices"][0]["text"] + " and"
    reply = quantized.post("/v1/completions", {"prompt": longer, "max_tokens": 8}).json
    assert reply["choices"][0]["text"] == mlx_loom.generate(
        model, tokenizer, longer, max_tokens=8, **KV
    )


def test_an_unsupported_width_fails_at_start(checkpoint):
    model, tokenizer = mlx_loom.load(checkpoint)
    with pytest.raises(RequestError, match="kv_bits=7"):
        next(serve(model, tokenizer, kv_bits=7))


def test_loom_serve_refuses_a_bad_kv_flag_before_loading(checkpoint, capsys):
    with pytest.raises(SystemExit) as info:
        main(["serve", "--model", str(checkpoint), "--port", "0", "--kv-group-size", "48"])
    assert info.value.code == 2
    assert "--kv-group-size" in capsys.readouterr().err


def test_loom_serve_picks_a_kv_group_size_that_divides_the_heads(checkpoint, monkeypatch):
    from mlx_loom.cli import serve_cmd
    from mlx_loom.serve import ServerStartError

    seen = {}
    real_make_server = serve_cmd.make_server

    def fake_make_server(**options):
        server = real_make_server(**options)  # the model is loaded, its kv settings chosen
        seen.update(server.app.kv)
        server.stop()
        raise ServerStartError("stop here", fix="none")

    monkeypatch.setattr(serve_cmd, "make_server", fake_make_server)
    assert main(["serve", "--model", str(checkpoint), "--port", "0", "--kv-bits", "8"]) == 1
    assert (seen["kv_bits"], seen["kv_group_size"]) == (8, 32)  # the heads are 32 wide


@pytest.mark.parametrize(
    ("flags", "shown"),
    [
        ([], "loom: draft: none; KV cache: plain"),
        (
            ["--kv-bits", "8", "--draft", "ngram", "--num-draft-tokens", "4"],
            "loom: draft: ngram (prompt lookup), 4 tokens a step; "
            "KV cache: affine 8-bit, group 32, from token 0",
        ),
        (
            ["--kv-codec", "turboquant", "--quantized-kv-start", "16"],
            "loom: draft: none; KV cache: turboquant 4-bit, from token 16",
        ),
        (["--kv-dtype", "bfloat16"], "loom: draft: none; KV cache: plain, stored in bfloat16"),
    ],
)
def test_loom_serves_banner_names_the_draft_and_kv_cache_in_force(
    checkpoint, monkeypatch, capsys, flags, shown
):
    from mlx_loom.serve.server import LoomServer

    def stop_at_once(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(LoomServer, "serve_forever", stop_at_once)
    assert main(["serve", "--model", str(checkpoint), "--port", "0", *flags]) == 0
    assert shown in capsys.readouterr().err
