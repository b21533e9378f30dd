"""The server answers the engine validator's errors: its message, its field, its code.

``make_request`` checks what a request asks of the model (the prompt's ids
and length, stop strings, sampling values, speculation); the server does not
check those again, it maps the typed error to its 400 and names the field
as the client sent it.
"""

from __future__ import annotations

import pytest

import mlx_loom
from mlx_loom.engine import Speculation, make_request
from mlx_loom.errors import RequestError

from .conftest import CONTEXT

CHAT = [{"role": "user", "content": "hello"}]


def _engine_error(checkpoint, prompt, **options) -> RequestError:
    model, tokenizer = mlx_loom.load(checkpoint)
    with pytest.raises(RequestError) as info:
        make_request(model, tokenizer, prompt, **options)
    return info.value


def test_a_prompt_past_the_context_is_the_engines_answer_word_for_word(client, checkpoint):
    expected = _engine_error(checkpoint, [5] * CONTEXT)
    reply = client.post("/v1/completions", {"prompt": [5] * CONTEXT, "max_tokens": 1})
    error = reply.error
    assert reply.status == 400 and error["param"] == "prompt"
    assert error["code"] == "context_length_exceeded"
    assert error["message"].startswith(expected.message) and error["fix"] == expected.fix


def test_a_draft_count_out_of_range_is_the_engines_answer(client, checkpoint):
    expected = _engine_error(checkpoint, [5, 6], speculation=Speculation(None, 0))
    body = {"prompt": "hi", "max_tokens": 2, "draft": "ngram", "num_draft_tokens": 0}
    reply = client.post("/v1/completions", body)
    assert reply.status == 400 and reply.error["param"] == "num_draft_tokens"
    assert reply.error["message"].startswith(expected.message)


def test_a_chat_past_the_context_names_the_messages(client):
    # The engine names its prompt; a chat's prompt is rendered from "messages".
    long = [{"role": "user", "content": "hello " * (2 * CONTEXT)}]
    reply = client.post("/v1/chat/completions", {"messages": long, "max_tokens": 1})
    assert reply.status == 400 and reply.error["param"] == "messages"
    assert reply.error["code"] == "context_length_exceeded"
