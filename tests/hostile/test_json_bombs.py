"""Hostile JSON in every file and body the engine parses: a typed error naming the place.

Before bounded parsing, 100,000 levels of nesting gave ``RecursionError`` and
a 5,000-digit integer gave a bare ``ValueError`` — in ``config.json``, the
safetensors header, the prompt-cache header and the server's request body.
"""

from __future__ import annotations

import io
import json
import struct
from contextlib import redirect_stderr

import mlx.core as mx
import pytest

import mlx_loom
from mlx_loom.cli.main import main
from mlx_loom.errors import (
    CacheError,
    ConfigError,
    SafetensorsHeaderError,
    TokenizerError,
    WeightsError,
)
from mlx_loom.generation import PromptCache

from ..server.conftest import Client, serve
from .conftest import FAMILIES, variant

DEEP = "[" * 100_000 + "]" * 100_000
BIG_INT = "9" * 5000


def deep_in(obj_text: str) -> str:
    """A JSON object that carries the bomb under key "x", after the real fields."""
    return obj_text.rstrip().removesuffix("}") + f', "x": {DEEP}}}'


def big_in(obj_text: str) -> str:
    return obj_text.rstrip().removesuffix("}") + f', "x": {BIG_INT}}}'


def config_text(path) -> str:
    return (path / "config.json").read_text()


BOMBS = {"deep": (deep_in, "deeper than the limit"), "big_int": (big_in, "5000 digits")}


@pytest.fixture(params=FAMILIES)
def family(request, family_dirs):
    return request.param, family_dirs[request.param]


# --- config.json, through every door that reads it -----------------------------------


@pytest.mark.parametrize("bomb", sorted(BOMBS))
def test_config_json_bombs_are_config_errors_from_the_api(family, bomb, tmp_path):
    _, src = family
    make, needle = BOMBS[bomb]
    path = variant(src, tmp_path / "m", files={"config.json": make(config_text(src))})
    with pytest.raises(ConfigError, match=needle) as info:
        mlx_loom.load(path)
    assert "config.json" in info.value.message and info.value.fix


@pytest.mark.parametrize("command", ["generate", "chat", "explain", "serve"])
@pytest.mark.parametrize("bomb", sorted(BOMBS))
def test_config_json_bombs_exit_1_with_the_message_from_the_cli(family, bomb, command, tmp_path):
    _, src = family
    make, needle = BOMBS[bomb]
    path = variant(src, tmp_path / "m", files={"config.json": make(config_text(src))})
    argv = {
        "generate": ["generate", "--model", str(path), "-m", "1"],
        "chat": ["chat", "--model", str(path)],
        "explain": ["explain", str(path)],
        "serve": ["serve", "--model", str(path), "--port", "0"],
    }[command]
    err = io.StringIO()
    with redirect_stderr(err):
        code = main(argv)
    assert code == 1
    assert needle in err.getvalue() and "fix:" in err.getvalue()


def test_an_oversized_config_json_is_refused_before_it_is_read(family_dirs, tmp_path):
    src = family_dirs["llama"]
    padding = " " * (17 * 1024 * 1024)
    path = variant(src, tmp_path / "m", files={"config.json": config_text(src) + padding})
    with pytest.raises(ConfigError, match="limit for this file"):
        mlx_loom.load(path)


# --- tokenizer files --------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["tokenizer_config.json", "generation_config.json", "special_tokens_map.json"]
)
@pytest.mark.parametrize("bomb", sorted(BOMBS))
def test_tokenizer_json_bombs_are_tokenizer_errors(family, name, bomb, tmp_path):
    _, src = family
    make, needle = BOMBS[bomb]
    original = (src / name).read_text() if (src / name).exists() else "{}"
    path = variant(src, tmp_path / "m", files={name: make(original)})
    with pytest.raises(TokenizerError, match=needle) as info:
        mlx_loom.load(path)
    assert name in info.value.message


def test_a_deep_tokenizer_json_is_a_tokenizer_error(family, tmp_path):
    _, src = family
    data = json.loads((src / "tokenizer.json").read_text())
    text = json.dumps(data)[:-1] + f', "x": {DEEP}}}'
    path = variant(src, tmp_path / "m", files={"tokenizer.json": text})
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        mlx_loom.load(path)


# --- safetensors header and index ---------------------------------------------------------


def safetensors_with_header(header_text: str) -> bytes:
    raw = header_text.encode()
    return struct.pack("<Q", len(raw)) + raw


@pytest.mark.parametrize(
    ("header", "needle"),
    [
        ('{"__metadata__": ' + DEEP + "}", "deeper than the limit"),
        ('{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, ' + BIG_INT + "]}}", "digits"),
    ],
)
def test_safetensors_header_bombs_are_header_errors(family, header, needle, tmp_path):
    _, src = family
    files = {"model.safetensors": safetensors_with_header(header)}
    path = variant(src, tmp_path / "m", files=files)
    with pytest.raises(SafetensorsHeaderError, match=needle) as info:
        mlx_loom.load(path)
    assert "model.safetensors" in info.value.message


@pytest.mark.parametrize("bomb", sorted(BOMBS))
def test_index_json_bombs_are_weights_errors(family, bomb, tmp_path):
    _, src = family
    make, needle = BOMBS[bomb]
    index = json.dumps({"metadata": {}, "weight_map": {}})
    path = variant(src, tmp_path / "m", files={"model.safetensors.index.json": make(index)})
    with pytest.raises(WeightsError, match=needle):
        mlx_loom.load(path)


# --- prompt-cache header ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("doc", "needle"), [(DEEP, "deeper than the limit"), ('{"v": ' + BIG_INT + "}", "digits")]
)
def test_prompt_cache_header_bombs_are_cache_errors(family_dirs, doc, needle, tmp_path):
    model, _ = mlx_loom.load(family_dirs["qwen3_next"])
    path = tmp_path / "cache.safetensors"
    mx.save_safetensors(str(path), {}, {"mlx_loom.prompt_cache": doc})
    with pytest.raises(CacheError, match=needle):
        PromptCache.load(path, model)


# --- the server's request body ------------------------------------------------------------------


@pytest.fixture(scope="module", params=FAMILIES)
def served(request, tmp_path_factory):
    claim = mlx_loom.default_host().registry.model_types[request.param]
    from mlx_loom.testing.checkpoints import write_checkpoint

    path = write_checkpoint(
        tmp_path_factory.mktemp("served") / request.param,
        claim.tiny_config,
        claim.checkpoint_tensors(claim.tiny_config),
    )
    model, tok = mlx_loom.load(path)
    yield from serve(model, tok)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ('{"messages": ' + DEEP + "}", "deeper than the limit"),
        ('{"messages": [], "max_tokens": ' + BIG_INT + "}", "5000 digits"),
        ('{"messages": [' + ",".join(["{}"] * 600_000) + "]}", "arrays/objects"),
    ],
)
@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"])
def test_body_bombs_are_400_invalid_json_and_the_server_keeps_serving(
    served: Client, endpoint, body, needle
):
    reply = served.request("POST", endpoint, raw=body.encode())
    assert reply.status == 400, reply.text
    assert reply.error["code"] == "invalid_json" and needle in reply.error["message"]
    assert reply.error["fix"]
    assert served.get("/health").status == 200


# --- installation metadata ---------------------------------------------------------------


@pytest.mark.parametrize("text", [DEEP, '{"url": ' + BIG_INT + "}", "[1, 2]", "not json"])
def test_unreadable_install_metadata_falls_back_to_the_index_command(monkeypatch, text):
    from mlx_loom.host import _advice as advice

    class Distribution:
        def read_text(self, name: str) -> str:
            return text

    monkeypatch.setattr(advice.metadata, "distribution", lambda name: Distribution())
    assert advice.install_command("minicpm5", "mlx-loom-minicpm5") == (
        "pip install mlx-loom-minicpm5"
    )
