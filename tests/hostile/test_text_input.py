"""Text that is not valid Unicode: a typed error from every door, never a TypeError or a 500.

Python strings may hold lone UTF-16 surrogates (a JSON body escaping
``"\\ud800"``, or command-line bytes that are not UTF-8, which Python decodes
to ``\\udc80``-``\\udcff``); the tokenizer library raised ``TypeError`` on
them, which the server answered with 500.
"""

from __future__ import annotations

import io
from contextlib import redirect_stderr

import pytest

import mlx_loom
from mlx_loom.cli.main import main
from mlx_loom.errors import RequestError

from ..server.conftest import serve
from .conftest import FAMILIES


@pytest.fixture(scope="module", params=FAMILIES)
def loaded(request, family_dirs):
    return request.param, mlx_loom.load(family_dirs[request.param])


def test_the_api_refuses_a_prompt_with_a_lone_surrogate(loaded):
    _, (model, tok) = loaded
    with pytest.raises(RequestError, match="lone UTF-16 surrogate"):
        mlx_loom.generate(model, tok, "hi \ud800 there", max_tokens=2)
    with pytest.raises(RequestError, match="lone UTF-16 surrogate"):
        tok.encode_chat([{"role": "user", "content": "hi \udfff"}])


def test_the_cli_refuses_a_prompt_that_is_not_utf8(loaded):
    name, (model, _) = loaded
    err = io.StringIO()
    with redirect_stderr(err):
        # what Python makes of the command-line bytes b"hi \xff"
        code = main(["generate", "--model", str(model.model_dir), "-p", "hi \udcff", "-m", "1"])
    assert code == 1 and "lone UTF-16 surrogate" in err.getvalue(), name


@pytest.mark.parametrize(
    ("endpoint", "body"),
    [
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a \\ud800"}]}'),
        ("/v1/completions", '{"prompt": "a \\udfff b", "max_tokens": 2}'),
    ],
)
def test_the_server_answers_400_for_a_lone_surrogate(loaded, endpoint, body):
    _, (model, tok) = loaded
    for client in serve(model, tok):
        reply = client.request("POST", endpoint, raw=body.encode())
        assert reply.status == 400, reply.text
        assert reply.error["code"] == "invalid_json" and "surrogate" in reply.error["message"]
        assert client.get("/health").status == 200
