"""What the server refuses about tools, tool_choice and response_format, and n > 1 choices."""

from __future__ import annotations

import dataclasses
import json

import pytest

import mlx_loom
from mlx_loom.cli.main import main
from mlx_loom.errors import ToolParserUnavailable
from mlx_loom.host import Registry
from mlx_loom.serve import make_server

from .conftest import serve
from .formats import WEATHER_TOOL
from .test_errors import assert_error_body

CHAT = [{"role": "user", "content": "hello"}]


def chat(client, **body):
    return client.post("/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, **body})


def test_the_family_default_format_applies_to_a_template_without_markers(client):
    assert client.get("/health").json["tool_call_parser"] == "minicpm5"
    assert "model type 'llama'" in client.server.app.chat_format.tool_parser_reason


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_asking_for_a_call_without_tools_is_a_400(client, choice):
    assert_error_body(chat(client, tool_choice=choice), 400, param="tool_choice")


def test_a_named_tool_choice_must_name_one_of_the_tools(client):
    choice = {"type": "function", "function": {"name": "get_time"}}
    reply = chat(client, tools=[WEATHER_TOOL], tool_choice=choice)
    error = assert_error_body(reply, 400, param="tool_choice")
    assert "'get_time'" in error["message"] and "get_weather" in error["message"]


def test_two_tools_with_one_name_are_a_400(client):
    reply = chat(client, tools=[WEATHER_TOOL, WEATHER_TOOL])
    assert "get_weather" in assert_error_body(reply, 400, param="tools")["message"]


@pytest.mark.parametrize(
    ("tool", "param"),
    [
        ({"type": "custom", "custom": {"name": "x"}}, "tools[0].type"),
        ({"type": "function", "function": {"name": "no spaces"}}, "tools[0].function.name"),
        ({"type": "function", "function": {"description": "no name"}}, "tools[0].function.name"),
        ({"type": "function", "function": {"name": "f", "parameters": "{}"}}, None),
    ],
)
def test_a_malformed_tool_is_a_400_naming_it(client, tool, param):
    error = assert_error_body(chat(client, tools=[tool]), 400, param=param)
    assert error["param"].startswith("tools[0]")


def test_an_unknown_tool_choice_is_a_400(client):
    assert_error_body(chat(client, tools=[WEATHER_TOOL], tool_choice="any"), 400)


def test_a_json_schema_response_format_is_enforced(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    reply = chat(client, response_format=fmt, max_tokens=20).json["choices"][0]
    assert json.loads(reply["message"]["content"]) in ({"ok": True}, {"ok": False})


def test_a_response_format_without_its_schema_is_a_400_naming_the_parameter(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "x"}}
    error = assert_error_body(chat(client, response_format=fmt), 400, param="response_format")
    assert "json_schema.schema" in error["message"]


def test_a_text_response_format_is_served(client):
    assert chat(client, response_format={"type": "text"}).status == 200


def test_n_choices_are_each_generated_and_counted(client):
    eos = next(iter(client.server.app.tokenizer.eos_token_ids))
    body = dict(n=2, temperature=1.0, seed=3, max_tokens=6, logit_bias={str(eos): -100})
    reply = chat(client, **body).json
    assert [c["index"] for c in reply["choices"]] == [0, 1]
    assert reply["usage"]["completion_tokens"] == 12
    first, second = (c["message"]["content"] for c in reply["choices"])
    assert first != second  # each choice is its own sample
    one = chat(client, **{**body, "n": 1}).json["choices"][0]["message"]["content"]
    assert first == one  # choice 0 samples with the request's seed


def test_streamed_n_choices_carry_their_index_and_end_once_each(client):
    events = client.post(
        "/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "n": 2, "stream": True}
    ).events()
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert {c["choices"][0]["index"] for c in chunks} == {0, 1}
    finals = [c for c in chunks if c["choices"][0]["finish_reason"] is not None]
    assert [c["choices"][0]["index"] for c in finals] == [0, 1]
    roles = [c["choices"][0]["index"] for c in chunks if "role" in c["choices"][0]["delta"]]
    assert roles == [0, 1]


def test_greedy_choices_are_identical(client):
    reply = chat(client, n=3, max_tokens=5).json
    assert len({c["message"]["content"] for c in reply["choices"]}) == 1


def test_tools_for_a_model_with_no_known_format_are_refused(checkpoint):
    model, tokenizer = mlx_loom.load(checkpoint)
    base = mlx_loom.default_host().registry
    claim = dataclasses.replace(base.model_types["llama"], tool_parser=None)
    registry = Registry(model_types=[claim])
    for c in serve(model, tokenizer, registry=registry):
        assert c.get("/health").json["tool_call_parser"] is None
        error = assert_error_body(chat(c, tools=[WEATHER_TOOL]), 422, param="tools")
        assert "--tool-call-parser" in error["fix"]
        assert chat(c, tools=[WEATHER_TOOL], tool_choice="none").status == 200


def test_an_unknown_tool_call_parser_is_refused_listing_the_registered_ones(checkpoint):
    model, tokenizer = mlx_loom.load(checkpoint)
    with pytest.raises(ToolParserUnavailable) as info:
        make_server(model, tokenizer, port=0, tool_call_parser="hermes")
    assert "'hermes'" in info.value.message and "json_tools" in info.value.message


def test_loom_serve_with_an_unknown_tool_call_parser_exits_3(checkpoint, capsys):
    code = main(["serve", "--model", str(checkpoint), "--port", "0", "--tool-call-parser", "x"])
    assert code == 3
    assert "qwen3_coder" in capsys.readouterr().err


def test_completions_serve_n_choices_plain_and_streamed(client):
    eos = next(iter(client.server.app.tokenizer.eos_token_ids))
    body = {
        "prompt": "the model",
        "max_tokens": 4,
        "n": 2,
        "temperature": 1.0,
        "seed": 5,
        "logit_bias": {str(eos): -100},
    }
    whole = client.post("/v1/completions", body).json
    assert [c["index"] for c in whole["choices"]] == [0, 1]
    assert whole["usage"]["completion_tokens"] == 8
    events = client.post("/v1/completions", {**body, "stream": True}).events()[:-1]
    streamed = {0: "", 1: ""}
    for chunk in events:
        choice = chunk["choices"][0]
        streamed[choice["index"]] += choice["text"]
    assert [streamed[0], streamed[1]] == [c["text"] for c in whole["choices"]]
