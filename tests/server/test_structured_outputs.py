"""Structured output through the real ``openai`` client, on the bundled tiny model.

At temperature 1.0 on random-ish weights, every door — OpenAI's
``response_format`` (plain and streamed), vLLM's ``structured_outputs``,
llama.cpp's ``json_schema``/``grammar``, and forced tool calls — returns
output that parses and validates; a bad request is a 400 naming the field.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import openai
import pytest

import mlx_loom

from .conftest import serve

TINY = Path(mlx_loom.__file__).parent / "assets" / "tiny-minicpm5"
MESSAGES = [{"role": "user", "content": "Describe a pet."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "legs": {"type": "integer", "minimum": 0, "maximum": 8},
        "kind": {"enum": ["cat", "dog", "bird"]},
    },
    "required": ["name", "legs", "kind"],
    "additionalProperties": False,
}
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "days": {"type": "integer"},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
        },
    },
}
OTHER_TOOL = {
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


def valid_pet(value: object) -> bool:
    return (
        isinstance(value, dict)
        and set(value) == {"name", "legs", "kind"}
        and isinstance(value["name"], str)
        and len(value["name"]) <= 10
        and type(value["legs"]) is int
        and 0 <= value["legs"] <= 8
        and value["kind"] in ("cat", "dog", "bird")
    )


@pytest.fixture(scope="module")
def served():
    model, tokenizer = mlx_loom.load(TINY)
    yield from serve(model, tokenizer, model_id="m")


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served.server.url}/v1", api_key="x", max_retries=0)


def chat(client, *, stream=False, **kwargs):
    kwargs = {"model": "m", "messages": MESSAGES, "max_tokens": 80, "temperature": 1.0, **kwargs}
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        return choice.message.content, choice.finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_json_schema_replies_parse_and_validate(client, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}
    for seed in range(3):
        text, finish = chat(client, stream=stream, seed=seed, response_format=fmt)
        assert finish == "stop" and valid_pet(json.loads(text)), text


def test_json_object_replies_are_json_objects(client):
    # Random weights write long keys; a bias toward closing keeps the reply short.
    for seed in range(2):
        text, finish = chat(
            client, seed=seed, max_tokens=200, response_format={"type": "json_object"},
            logit_bias=_bias_towards(client, '"}'),
        )
        assert finish == "stop" and isinstance(json.loads(text), dict), text


def _bias_towards(client, chars: str) -> dict[str, float]:
    from mlx_loom.text import Tokenizer

    tokenizer = Tokenizer.from_dir(TINY)
    return {str(tokenizer.encode(c, add_special_tokens=False)[-1]): 8.0 for c in chars}


def test_vllm_structured_outputs_on_both_endpoints(client):
    for seed in range(3):
        choice = {"structured_outputs": {"choice": ["yes", "no"]}}
        text, _ = chat(client, seed=seed, extra_body=choice)
        assert text in ("yes", "no")
        done = client.completions.create(
            model="m", prompt="Code:", max_tokens=20, temperature=1.0, seed=seed,
            extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}"}},
        ).choices[0]
        assert re.fullmatch("[A-Z]{2}-[0-9]{3}", done.text) and done.finish_reason == "stop"
        done = client.completions.create(
            model="m", prompt="Pet:", max_tokens=80, temperature=1.0, seed=seed,
            extra_body={"structured_outputs": {"json": SCHEMA}},
        ).choices[0]
        assert valid_pet(json.loads(done.text)), done.text


def test_llama_cpp_fields_json_schema_and_gbnf_grammar(client):
    done = client.completions.create(
        model="m", prompt="Pet:", max_tokens=80, temperature=1.0, seed=4,
        extra_body={"json_schema": SCHEMA},
    ).choices[0]
    assert valid_pet(json.loads(done.text))
    text, _ = chat(client, seed=5, extra_body={"grammar": 'root ::= ("up" | "down") " " [0-9]'})
    assert re.fullmatch("(up|down) [0-9]", text)


def forced_call(client, choice, seed: int, stream: bool) -> tuple[str, str, str | None]:
    """``(function name, arguments JSON, finish_reason)`` of a forced reply."""
    kwargs = dict(
        model="m", messages=MESSAGES, max_tokens=200, temperature=1.0, seed=seed,
        tools=[TOOL, OTHER_TOOL], tool_choice=choice,
    )
    if not stream:
        reply = client.chat.completions.create(**kwargs).choices[0]
        assert reply.message.tool_calls, reply.message.content
        (call,) = reply.message.tool_calls
        return call.function.name, call.function.arguments, reply.finish_reason
    name, arguments, finish = "", "", None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        for part in delta.tool_calls or ():
            assert part.index == 0  # one call
            name += part.function.name or ""
            arguments += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return name, arguments, finish


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize(
    "choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"],
)
def test_forced_tool_calls_always_parse_and_validate(client, choice, stream):
    for seed in range(3):
        name, arguments, finish = forced_call(client, choice, seed, stream)
        assert finish == "tool_calls"
        args = json.loads(arguments)
        if name == "add":
            assert choice == "required"
            assert type(args["a"]) is int and isinstance(args["b"], (int, float))
            continue
        assert name == "get_weather"
        assert isinstance(args["city"], str) and len(args["city"]) <= 12
        assert args["unit"] in ("c", "f") and type(args.get("days", 0)) is int


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format", "json_schema.schema"),
        ({"extra_body": {"json_schema": {"type": "array", "uniqueItems": True}}},
         "json_schema", "uniqueItems"),
        ({"extra_body": {"structured_outputs": {"regex": "a(b"}}},
         "structured_outputs.regex", "unclosed"),
        ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}},
         "structured_outputs", "exactly one"),
        ({"extra_body": {"grammar": "root ::= (", "json_schema": {"type": "object"}}},
         "grammar", "more than one"),
        ({"extra_body": {"structured_outputs": {"structural_tag": {}}}},
         "structured_outputs", "structural_tag"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"s": {"type": "string", "pattern": "^a$"}}}}}],
          "tool_choice": "required"},
         "tool_choice", "pattern"),
    ],
)
def test_bad_constraints_are_a_400_naming_the_field(client, body, param, words):
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, max_tokens=4, **body)
    error = info.value.body
    assert info.value.status_code == 400
    assert error["param"] == param and words in error["message"], error


def test_a_grammar_that_dead_ends_mid_reply_is_a_400_not_a_500(tmp_path):
    """The test tokenizer has no token for '<': the grammar can start, then cannot go on."""
    from mlx_loom.testing.checkpoints import write_checkpoint

    claim = mlx_loom.default_host().registry.model_types["llama"]
    path = write_checkpoint(
        tmp_path / "ckpt", claim.tiny_config, claim.checkpoint_tensors(claim.tiny_config),
        tokenizer=True,
    )
    model, tokenizer = mlx_loom.load(path)
    for served in serve(model, tokenizer, model_id="m"):
        client = openai.OpenAI(base_url=f"{served.server.url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="broke the regex constraint"):
            client.completions.create(
                model="m", prompt="the cat", max_tokens=8,
                extra_body={"structured_outputs": {"regex": "[ab]<c>"}},
            )
        with pytest.raises(openai.BadRequestError, match="cannot write"):
            client.completions.create(
                model="m", prompt="the cat", max_tokens=8,
                extra_body={"structured_outputs": {"regex": "ab<c>"}},
            )


def test_hostile_schemas_and_grammars_are_a_400(client):
    deep: dict = {}
    for _ in range(200):  # under the body's JSON nesting bound, past the compiler's
        deep = {"type": "array", "items": deep}
    huge = "start: " + " | ".join(f'"w{i}"' for i in range(12000))  # past 64 KiB
    for extra, words in [
        ({"json_schema": deep}, "recursion limit"),
        ({"grammar": huge}, "bytes"),
        ({"structured_outputs": {"choice": [str(i) for i in range(5000)]}}, "at most"),
    ]:
        with pytest.raises(openai.BadRequestError, match=words):
            chat(client, max_tokens=4, extra_body=extra)


def test_anthropic_tool_choice_any_is_a_call_that_validates(served):
    import anthropic

    client = anthropic.Anthropic(base_url=served.server.url, api_key="x", max_retries=0)
    function = TOOL["function"]
    tool = {"name": function["name"], "input_schema": function["parameters"]}
    for _ in range(2):  # unseeded draws: the call validates whatever is drawn
        reply = client.messages.create(
            model="m", max_tokens=200, messages=MESSAGES, tools=[tool],
            tool_choice={"type": "any"}, extra_body={"temperature": 1.0},
        )
        (use,) = [b for b in reply.content if b.type == "tool_use"]
        assert reply.stop_reason == "tool_use" and use.name == "get_weather"
        assert use.input["unit"] in ("c", "f") and len(use.input["city"]) <= 12
