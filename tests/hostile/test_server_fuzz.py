"""Fuzzed request bodies: whatever a client sends, the answer is never a 5xx, and errors are JSON.

Before the request models were strict at every field, wrong types in the
right places reached the engine and came back as ``500``: lone surrogates,
deep JSON, huge integers, ``chat_template_kwargs`` keys such as ``self`` or
``special_tokens``. Here hypothesis builds bodies for each endpoint from a
valid one, replacing any of its fields (the request models' own field
names, and inside each message and tool) with hostile JSON values, adding
unknown keys, or sending a value that is not an object at all; each family
renders its own chat template. Every answer must be below 500; an error
must be a JSON body in the endpoint's error shape; a success must be the
endpoint's answer.

The examples are derandomized, so CI runs the same bodies each time (a
failure reproduces); ``max_tokens_limit`` is 2, so a body that happens to
be valid generates two tokens at most.
"""

from __future__ import annotations

import json
import string
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mlx_loom
from mlx_loom.serve import anthropic, responses, schemas

from ..server.conftest import Client, serve
from .conftest import FAMILIES

EXAMPLES = 40  # per endpoint and family: ~360 requests, a few seconds each family

#: Values a careless or hostile client puts where a field is expected.
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**64), max_value=2**64),
    st.sampled_from([0, -1, 2**31, 2**63, 10**30, 10**300]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["\ud800", "a\udfffb", "\x00", "<|im_start|>", "{{ 7 * 7 }}", "1e999"]),
)
_JSON = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
#: Nesting past the request parser's depth bound, as a list or an object.
_DEEP = st.sampled_from(
    [
        json.loads("[" * 200 + "]" * 200),
        json.loads('{"a":' * 200 + "1" + "}" * 200),
    ]
)
_HOSTILE = st.one_of(_JSON, _DEEP)

#: Keys the server sets itself, or that name the renderer's own arguments.
_TEMPLATE_KEYS = st.one_of(
    st.sampled_from(
        ["self", "special_tokens", "messages", "tools", "tokenize", "budget", "enable_thinking"]
    ),
    st.text(alphabet=string.ascii_letters + "_", min_size=1, max_size=10),
)


def _fields(model: type) -> list[str]:
    return sorted(model.model_fields)


REQUEST_FIELDS = {
    "/v1/completions": _fields(schemas.CompletionRequest),
    "/v1/chat/completions": _fields(schemas.ChatCompletionRequest),
    "/v1/messages": _fields(anthropic.MessagesRequest),
    "/v1/responses": _fields(responses.ResponsesRequest),
}
MESSAGE_FIELDS = {
    "/v1/chat/completions": _fields(schemas.ChatMessage) + ["tool_calls", "tool_call_id", "name"],
    "/v1/messages": _fields(anthropic.AnthropicMessage),
    "/v1/responses": ["type", "role", "content", "call_id", "name", "arguments", "output"],
}
#: Where each endpoint's conversation is.
TURNS = {"/v1/chat/completions": "messages", "/v1/messages": "messages", "/v1/responses": "input"}
TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
}
ANTHROPIC_TOOL = {"name": "get_weather", "input_schema": {"type": "object"}}

BASE = {
    "/v1/completions": {"prompt": "hello", "max_tokens": 2},
    "/v1/chat/completions": {
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 2,
        "tools": [TOOL],
    },
    "/v1/messages": {
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 2,
        "tools": [ANTHROPIC_TOOL],
    },
    "/v1/responses": {
        "input": [{"role": "user", "content": "hello"}],
        "max_output_tokens": 2,
        "tools": [{"type": "function", **TOOL["function"]}],
    },
}


@st.composite
def bodies(draw, endpoint: str) -> Any:
    """A request body for ``endpoint``: mostly a valid one with hostile parts."""
    if draw(st.integers(0, 9)) == 0:
        return draw(_HOSTILE)  # not even an object, most of the time
    body = json.loads(json.dumps(BASE[endpoint]))
    for name in draw(st.lists(st.sampled_from(REQUEST_FIELDS[endpoint]), max_size=3)):
        body[name] = draw(_HOSTILE)
    turns = body.get(TURNS.get(endpoint, ""))
    if endpoint in MESSAGE_FIELDS and isinstance(turns, list) and turns:
        message = turns[0]
        if isinstance(message, dict):
            for name in draw(st.lists(st.sampled_from(MESSAGE_FIELDS[endpoint]), max_size=2)):
                message[name] = draw(_HOSTILE)
    if endpoint == "/v1/chat/completions" and draw(st.booleans()):
        body["chat_template_kwargs"] = draw(
            st.dictionaries(_TEMPLATE_KEYS, _JSON, min_size=1, max_size=3)
        )
    if draw(st.integers(0, 4)) == 0:
        body[draw(st.text(max_size=10))] = draw(_JSON)  # an unknown key
    return body


def check_answer(client: Client, endpoint: str, body: Any) -> None:
    raw = json.dumps(body).encode()  # NaN and Infinity go out as the bare words
    reply = client.request("POST", endpoint, raw=raw)
    assert reply.status < 500, (reply.status, reply.text[:2000], raw[:2000])
    kind = reply.headers.get("Content-Type", "")
    if reply.status >= 400:
        assert kind == "application/json", (reply.status, kind, raw[:500])
        if endpoint == "/v1/messages":
            assert reply.json["type"] == "error" and reply.json["error"]["message"]
        else:
            assert reply.error["message"] and "code" in reply.error
        return
    assert reply.status == 200, (reply.status, reply.text[:500])
    if kind == "text/event-stream":
        assert "data: " in reply.text  # a stream that had started may end in an error event
    else:
        answer = reply.json
        shaped = answer.get("choices") or answer.get("content") is not None
        assert shaped or answer.get("output") is not None, answer


@pytest.fixture(scope="module", params=FAMILIES)
def fuzzed(request, family_dirs) -> Client:
    model, tokenizer = mlx_loom.load(family_dirs[request.param])
    yield from serve(model, tokenizer, max_tokens_limit=2)


FUZZ = settings(
    max_examples=EXAMPLES,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.mark.parametrize("endpoint", sorted(REQUEST_FIELDS))
def test_no_body_gets_a_5xx_and_every_error_is_json(fuzzed, endpoint):
    @FUZZ
    @given(body=bodies(endpoint))
    def fuzz(body: Any) -> None:
        check_answer(fuzzed, endpoint, body)

    fuzz()
    assert fuzzed.get("/health").status == 200


#: The issue's reproducers: (where it goes, its raw JSON text, words of the error).
REPRODUCERS = {
    "deep-json": ("prompt", "[" * 100_000 + "]" * 100_000, "deeper than the limit"),
    "huge-integer": ("prompt", "1" * 5000, "5000 digits"),
    "lone-surrogate": ("prompt", '"a \\ud800 b"', "surrogate"),
    "nan-temperature": ("temperature", "NaN", "temperature"),
}


def _raw_body(endpoint: str, where: str, raw_value: str) -> bytes:
    prompt = raw_value if where == "prompt" else '"hello"'
    extra = f', "temperature": {raw_value}' if where == "temperature" else ""
    if endpoint == "/v1/completions":
        return ('{"max_tokens": 2, "prompt": ' + prompt + extra + "}").encode()
    if endpoint == "/v1/responses":
        return ('{"max_output_tokens": 2, "input": ' + prompt + extra + "}").encode()
    return (
        '{"max_tokens": 2, "messages": [{"role": "user", "content": ' + prompt + "}]" + extra + "}"
    ).encode()


@pytest.mark.parametrize("case", sorted(REPRODUCERS))
@pytest.mark.parametrize("endpoint", sorted(REQUEST_FIELDS))
def test_each_reproducer_is_a_400_with_a_json_error_on_every_endpoint(fuzzed, endpoint, case):
    where, raw_value, needle = REPRODUCERS[case]
    reply = fuzzed.request("POST", endpoint, raw=_raw_body(endpoint, where, raw_value))
    assert reply.status == 400, reply.text[:500]
    error = reply.json["error"]
    assert needle in error["message"], error
    assert fuzzed.get("/health").status == 200
