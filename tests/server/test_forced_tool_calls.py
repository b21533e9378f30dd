"""Forced tool calls in every tool-call format, through the real ``openai`` and ``anthropic``
clients, on random-weight tiny models at temperature 1.0.

Each format's checkpoint ships a chat template in that format (``formats.py``);
``tool_choice: "required"``, a named function and Anthropic's ``any`` must give a
call the format's parser reads, with arguments valid against the tool's schema —
every time, whatever the weights write.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator

import openai
import pytest

import mlx_loom
from mlx_loom.serve import make_server

from .formats import FORMATS, Format, write_format_checkpoint

#: The older Mistral spelling, ``[TOOL_CALLS][{"name": ..., "arguments": ...}]``.
MISTRAL_LIST = Format(
    parser="mistral",
    call="{{ '[TOOL_CALLS][' + ({'name': tool_call.name, 'arguments': tool_call.arguments} "
    "| tojson) + ']' }}",
    tokens=("[TOOL_CALLS]", "<tool_response>", "</tool_response>", "_"),
)
#: A published tokenizer writes every byte; the trained test vocabulary lacks "<", ">",
#: "/" and "|", which a grammar may need alone (where "</param>" and "<param name=" part ways).
CASES = {
    name: dataclasses.replace(fmt, tokens=(*fmt.tokens, "<", ">", "/", "|"))
    for name, fmt in {**FORMATS, "mistral_list": MISTRAL_LIST}.items()
}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "days": {"type": "integer"},
                "unit": {"enum": ["c", "f"]},
                "exact": {"type": "boolean"},
            },
            "required": ["city", "unit"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "number"}},
            "required": ["a", "b"],
        },
    },
}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def valid_call(name: str, args: object) -> bool:
    """Whether ``args`` validates against the schema of the tool ``name``."""
    if not isinstance(args, dict):
        return False
    if name == "add":
        return set(args) == {"a", "b"} and type(args["a"]) is int and (
            type(args["b"]) in (int, float)
        )
    return (
        name == "get_weather"
        and set(args) <= {"city", "days", "unit", "exact"}
        and isinstance(args.get("city"), str)
        and len(args["city"]) <= 12
        and args.get("unit") in ("c", "f")
        and type(args.get("days", 0)) is int
        and type(args.get("exact", True)) is bool
    )


@pytest.fixture(scope="module", params=sorted(CASES))
def served(request, tmp_path_factory) -> Iterator[tuple[str, object]]:
    case = request.param
    path = tmp_path_factory.mktemp(case) / "ckpt"
    write_format_checkpoint(path, CASES[case])
    model, tokenizer = mlx_loom.load(path)
    server = make_server(model, tokenizer, port=0, model_id="m")
    server.start_in_background()
    try:
        assert server.app.chat_format.tool_parser.name == CASES[case].parser
        yield case, server
    finally:
        server.stop()


def forced(server, choice, seed: int, stream: bool) -> tuple[str, str, str | None]:
    """``(function name, arguments JSON, finish_reason)`` of the one call in the reply."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    kwargs = dict(
        model="m", messages=MESSAGES, max_tokens=160, temperature=1.0, seed=seed,
        tools=[WEATHER, ADD], tool_choice=choice,
    )
    if not stream:
        reply = client.chat.completions.create(**kwargs).choices[0]
        assert reply.message.tool_calls and not reply.message.content, reply.message.content
        (call,) = reply.message.tool_calls
        return call.function.name, call.function.arguments, reply.finish_reason
    name, arguments, finish = "", "", None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        assert not delta.content, delta.content
        for part in delta.tool_calls or ():
            assert part.index == 0  # one call
            name += part.function.name or ""
            arguments += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return name, arguments, finish


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_a_forced_call_parses_and_validates_in_every_format(served, choice, stream):
    case, server = served
    for seed in range(3):
        name, arguments, finish = forced(server, choice, seed, stream)
        assert finish == "tool_calls", (case, arguments)
        assert name == "get_weather" or (choice == "required" and name == "add")
        assert valid_call(name, json.loads(arguments)), (case, name, arguments)


def test_anthropic_any_is_a_call_that_validates_in_every_format(served):
    import anthropic

    case, server = served
    client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    tools = [
        {"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
        for t in (WEATHER, ADD)
    ]
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        reply = client.messages.create(
            model="m", max_tokens=160, messages=MESSAGES, tools=tools, tool_choice=choice,
            extra_body={"temperature": 1.0},
        )
        (use,) = [b for b in reply.content if b.type == "tool_use"]
        assert reply.stop_reason == "tool_use", (case, reply.content)
        assert valid_call(use.name, use.input), (case, use.name, use.input)
        assert choice["type"] == "any" or use.name == "get_weather"


def test_a_format_without_a_grammar_is_refused_naming_it(tmp_path):
    """A plugin's format the server has no grammar for: 422, never an unconstrained call."""
    path = write_format_checkpoint(tmp_path / "ckpt", CASES["json_tools"])
    model, tokenizer = mlx_loom.load(path)
    server = make_server(model, tokenizer, port=0, model_id="m")
    fmt = server.app.chat_format
    plugin = dataclasses.replace(fmt.tool_parser, name="plugin_xml")
    server.app.chat_format = dataclasses.replace(fmt, tool_parser=plugin)
    server.start_in_background()
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        for choice in ("required", NAMED):
            with pytest.raises(openai.UnprocessableEntityError, match="plugin_xml"):
                client.chat.completions.create(
                    model="m", messages=MESSAGES, max_tokens=8, tools=[WEATHER],
                    tool_choice=choice,
                )
        # tool_choice "auto" still works: the model decides, and the reply is parsed.
        client.chat.completions.create(
            model="m", messages=MESSAGES, max_tokens=4, tools=[WEATHER], tool_choice="auto"
        )
    finally:
        server.stop()
