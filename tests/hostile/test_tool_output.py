"""Model output can never fail a request: a tool call that cannot be read or coerced is text.

Before, coercion ran outside the output parser's guard: an integer argument
longer than Python's 4,300-digit ``int()`` limit, for a parameter declared
``integer``, raised ``ValueError`` in every format — a 500 on chat, an error
event mid-stream, a 500 on ``/v1/messages``.
"""

from __future__ import annotations

import json

import pytest

from mlx_loom.text.output_parser import Content, OutputParser, ToolCallFound
from mlx_loom.text.tool_calls import BUILTIN_TOOL_PARSERS, ToolCall, ToolParser

from ..server.conftest import Client
from ..server.formats import FORMATS, scripted, write_format_checkpoint

PARSERS = {p.name: p for p in BUILTIN_TOOL_PARSERS}
DIGITS = "7" * 5000  # past int()'s 4,300-digit limit

#: One call with ``days`` written as DIGITS, per format (quoted where the format is JSON:
#: a bare 5,000-digit JSON number is refused by the format's own JSON reader).
CALLS = {
    "json_tools": '<tool_call>{"name": "f", "arguments": {"days": "' + DIGITS + '"}}</tool_call>',
    "qwen3_coder": "<tool_call>\n<function=f>\n<parameter=days>\n"
    + DIGITS
    + "\n</parameter>\n</function>\n</tool_call>",
    "gemma4": "<|tool_call>call:f{days:<|\"|>" + DIGITS + '<|"|>}<tool_call|>',
    "minicpm5": '<function name="f"><param name="days">' + DIGITS + "</param></function>",
    "pythonic": '<|tool_call_start|>[f(days="' + DIGITS + '")]<|tool_call_end|>',
    "mistral": '[TOOL_CALLS]f[ARGS]{"days": "' + DIGITS + '"}',
    "harmony": ' to=functions.f <|constrain|>json<|message|>{"days": "' + DIGITS + '"}<|call|>',
}
TOOL = {
    "type": "function",
    "function": {
        "name": "f",
        "parameters": {"type": "object", "properties": {"days": {"type": "integer"}}},
    },
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_an_argument_past_the_int_digit_limit_stays_a_string(name):
    parser = OutputParser(tool_parser=PARSERS[name], tools=[TOOL])
    events = parser.feed(CALLS[name]) + parser.finish()
    calls = [e.call for e in events if isinstance(e, ToolCallFound)]
    assert calls == [ToolCall("f", {"days": DIGITS})], events
    json.dumps(calls[0].arguments, allow_nan=False)  # what the server sends


def _unencodable(text: str) -> list[ToolCall]:
    """A plugin parser whose arguments no strict JSON encoder takes (a NaN, an object)."""
    return [ToolCall("f", {"x": float("nan"), "y": object()})]


def test_arguments_that_cannot_be_sent_as_json_make_the_call_content():
    tool = ToolParser(name="bad", start="<c>", end="</c>", parse=_unencodable)
    parser = OutputParser(tool_parser=tool, tools=[TOOL])
    events = parser.feed("<c>anything</c>") + parser.finish()
    assert events == [Content("<c>anything</c>")]


# Harmony's doors are served from a gpt-oss checkpoint (tests/server/test_harmony.py).
@pytest.fixture(scope="module", params=sorted(set(CALLS) & set(FORMATS)))
def served(request, tmp_path_factory):
    import mlx_loom
    from mlx_loom.serve import make_server

    path = write_format_checkpoint(tmp_path_factory.mktemp("f") / "ckpt", FORMATS[request.param])
    model, tokenizer = mlx_loom.load(path)
    server = make_server(model, tokenizer, port=0)
    worker = scripted(server, chunk=4096)
    server.start_in_background()
    try:
        yield request.param, Client(server), worker
    finally:
        server.stop()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_every_door_answers_200_with_the_argument_as_text(served, path):
    name, client, worker = served
    worker.clear()
    worker.script(CALLS[name])
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [TOOL], "max_tokens": 8}
    if path == "/v1/messages":
        body["tools"] = [{"name": "f", "input_schema": TOOL["function"]["parameters"]}]
    reply = client.post(path, body)
    assert reply.status == 200, reply.text
    if path == "/v1/messages":
        (use,) = [b for b in reply.json["content"] if b["type"] == "tool_use"]
        assert use["input"] == {"days": DIGITS}
    else:
        (call,) = reply.json["choices"][0]["message"]["tool_calls"]
        assert json.loads(call["function"]["arguments"]) == {"days": DIGITS}
