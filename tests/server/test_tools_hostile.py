"""Hostile tools and hostile model output get bounded, typed answers; the server keeps serving."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

import mlx_loom
from mlx_loom.serve import make_server

from .conftest import Client
from .formats import FORMATS, SCRIPTED_CALLS, WEATHER_TOOL, scripted, write_format_checkpoint

USER = {"role": "user", "content": "hi"}


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[Client, object]]:
    path = write_format_checkpoint(tmp_path_factory.mktemp("h") / "ckpt", FORMATS["json_tools"])
    model, tokenizer = mlx_loom.load(path)
    server = make_server(model, tokenizer, port=0)
    # Big pieces: these replies are long, and the hold-back is specified elsewhere.
    worker = scripted(server, chunk=4096)
    server.start_in_background()
    try:
        yield Client(server), worker
    finally:
        server.stop()


def still_serving(client: Client, worker) -> None:
    worker.clear()
    worker.script("fine")
    reply = client.post("/v1/chat/completions", {"messages": [USER]})
    assert reply.status == 200 and reply.json["choices"][0]["message"]["content"] == "fine"


def nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


def test_a_deeply_nested_parameters_schema_is_a_400_naming_it(served):
    client, worker = served
    tool = {"type": "function", "function": {"name": "deep", "parameters": nested(60)}}
    reply = client.post("/v1/chat/completions", {"messages": [USER], "tools": [tool]})
    assert reply.status == 400
    assert reply.error["param"] == "tools[0].function.parameters"
    assert "levels deep" in reply.error["message"]
    still_serving(client, worker)


def test_a_schema_nested_as_deep_as_allowed_is_served_and_coerced(served):
    client, worker = served
    tool = {"type": "function", "function": {"name": "deep", "parameters": nested(40)}}
    arguments = "1"
    for _ in range(40):
        arguments = {"x": arguments}
    worker.script(
        f'<tool_call>{{"name": "deep", "arguments": {json.dumps(arguments)}}}</tool_call>'
    )
    reply = client.post("/v1/chat/completions", {"messages": [USER], "tools": [tool]})
    assert reply.status == 200, reply.text
    call = reply.json["choices"][0]["message"]["tool_calls"][0]
    assert json.loads(call["function"]["arguments"]) == arguments


@pytest.mark.parametrize(
    "reply",
    [
        '<tool_call>{"name": "get_weather", "arguments": ' + "[" * 100_000,
        "<tool_call>" + "x" * 200_000 + "</tool_call>",
        '<tool_call>{"name": "get_weather", "arguments": {"city": "'
        + "\\ud800" * 50
        + '"}}</tool_call>',
        "<tool_call>" * 5_000,
        "</tool_call><tool_call></tool_call>\x00<tool_call>",
    ],
    ids=["deep", "long", "lone-surrogates", "many-starts", "stray-markers"],
)
def test_hostile_model_output_never_fails_the_request(served, reply):
    client, worker = served
    for stream in (False, True):
        worker.script((reply, "length"))
        answer = client.post(
            "/v1/chat/completions", {"messages": [USER], "tools": [WEATHER_TOOL], "stream": stream}
        )
        assert answer.status == 200, answer.text
        if stream:
            assert answer.events()[-1] == "[DONE]"
            assert all("error" not in e for e in answer.events()[:-1])
    still_serving(client, worker)


def test_a_tool_call_with_a_huge_argument_round_trips(served):
    client, worker = served
    big = "y" * 100_000
    call = json.dumps({"name": "get_weather", "arguments": {"city": big}})
    worker.script(f"<tool_call>{call}</tool_call>")
    reply = client.post("/v1/chat/completions", {"messages": [USER], "tools": [WEATHER_TOOL]})
    arguments = reply.json["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
    assert json.loads(arguments) == {"city": big}


def test_thousands_of_tools_are_accepted_within_the_body_limit(served):
    client, worker = served
    tools = [
        {"type": "function", "function": {"name": f"t{i}", "parameters": {"type": "object"}}}
        for i in range(2000)
    ]
    worker.script(SCRIPTED_CALLS["json_tools"].replace("get_weather", "t1999"))
    reply = client.post("/v1/chat/completions", {"messages": [USER], "tools": tools})
    # The prompt outgrows the tiny model's context: a clear 400, not a crash.
    assert reply.status in (200, 400)
    if reply.status == 400:
        assert reply.error["code"] == "context_length_exceeded"
    still_serving(client, worker)
