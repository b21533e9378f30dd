"""The Anthropic Messages API on /v1/messages, through the real ``anthropic`` client."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import pytest

import mlx_loom
from mlx_loom.serve import make_server

from .formats import FORMATS, SCRIPTED_CALLS, WEATHER_TOOL, scripted, write_format_checkpoint

WEATHER = {
    "name": "get_weather",
    "description": "The weather forecast for a city.",
    "input_schema": WEATHER_TOOL["function"]["parameters"],
}
USER = {"role": "user", "content": "weather in Paris?"}


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    path = write_format_checkpoint(tmp_path_factory.mktemp("msg") / "ckpt", FORMATS["json_tools"])
    return mlx_loom.load(path)


@pytest.fixture(scope="module")
def served(loaded) -> Iterator[tuple[object, object]]:
    model, tokenizer = loaded
    server = make_server(model, tokenizer, port=0, model_id="tools")
    worker = scripted(server)
    server.start_in_background()
    try:
        yield server, worker
    finally:
        server.stop()


def client_for(server, **options) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, **options)


def test_a_plain_message_has_anthropics_shape(served):
    server, worker = served
    worker.script("<think>greeting</think>Hello!")
    message = client_for(server).messages.create(
        model="tools", max_tokens=16, messages=[{"role": "user", "content": "hi"}]
    )
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.model == "tools"
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == "greeting" and message.content[1].text == "Hello!"
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert message.usage.input_tokens == len(worker.jobs[-1].prompt)
    assert message.usage.output_tokens > 0


def test_a_tool_conversation_round_trips_as_tool_use_and_tool_result(served):
    server, worker = served
    worker.script("Checking." + SCRIPTED_CALLS["json_tools"], "Sunny.")
    client = client_for(server)
    first = client.messages.create(model="tools", max_tokens=64, messages=[USER], tools=[WEATHER])
    assert first.stop_reason == "tool_use"
    text, use = first.content
    assert text.type == "text" and text.text == "Checking."
    assert use.type == "tool_use" and use.name == "get_weather"
    assert use.input == {"city": "Paris", "days": 2}
    history = [
        USER,
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}],
        },
    ]
    second = client.messages.create(model="tools", max_tokens=64, messages=history, tools=[WEATHER])
    assert second.content[0].text == "Sunny." and second.stop_reason == "end_turn"
    # The same conversation in the chat-completions shape renders the same prompt.
    tokenizer = server.app.tokenizer
    call = {
        "id": use.id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": use.input},
    }
    chat = [
        USER,
        {"role": "assistant", "content": "Checking.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": use.id, "content": "sunny"},
    ]
    assert worker.jobs[-1].prompt == tokenizer.encode_chat(chat, tools=[WEATHER_TOOL])


def test_a_streamed_message_sends_anthropics_events_in_order(served):
    server, worker = served
    worker.script("<think>plan</think>Sure." + SCRIPTED_CALLS["json_tools"])
    with client_for(server).messages.stream(
        model="tools", max_tokens=64, messages=[USER], tools=[WEATHER]
    ) as stream:
        kinds = [event.type for event in stream]
        message = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "message_delta" in kinds
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use"]
    assert message.content[0].thinking == "plan" and message.content[1].text == "Sure."
    assert message.content[2].input == {"city": "Paris", "days": 2}
    assert message.stop_reason == "tool_use"


def test_raw_stream_events_are_named_and_carry_block_indices(served):
    from .conftest import Client

    server, worker = served
    worker.script("Hi there")
    body = {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    reply = Client(server).post("/v1/messages", body)
    assert reply.headers["Content-Type"] == "text/event-stream"
    events = []
    for block in reply.text.strip().split("\n\n"):
        name, data = block.split("\n")
        events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    assert all(name == data["type"] for name, data in events)
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert text == "Hi there"
    assert {d["index"] for _, d in events if "index" in d} == {0}
    assert events[-2][1]["usage"]["output_tokens"] == 3


def test_a_stop_sequence_is_reported_as_such(loaded):
    model, tokenizer = loaded
    server = make_server(model, tokenizer, port=0, model_id="tools")
    server.start_in_background()
    try:
        client = client_for(server)
        free = client.messages.create(
            model="tools", max_tokens=20, messages=[{"role": "user", "content": "hi"}]
        )
        text = free.content[0].text
        stop = text[4:7]
        assert stop.strip()
        stopped = client.messages.create(
            model="tools",
            max_tokens=20,
            messages=[{"role": "user", "content": "hi"}],
            stop_sequences=[stop],
        )
        assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
        assert stopped.content[0].text == text[: text.index(stop)]
    finally:
        server.stop()


def test_a_required_tool_choice_is_any(served):
    server, worker = served
    worker.script(SCRIPTED_CALLS["json_tools"].removeprefix("<tool_call>"))
    message = client_for(server).messages.create(
        model="tools", max_tokens=64, messages=[USER], tools=[WEATHER], tool_choice={"type": "any"}
    )
    assert [b.type for b in message.content] == ["tool_use"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [USER]}, "max_tokens"),
        ({"max_tokens": 8, "messages": [USER], "stop": ["x"]}, "stop"),
        ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, None),
    ],
)
def test_bad_requests_get_anthropics_error_shape(served, body, param):
    from .conftest import Client

    reply = Client(served[0]).post("/v1/messages", body)
    assert reply.status == 400
    assert reply.json["type"] == "error"
    assert reply.json["error"]["type"] == "invalid_request_error"
    if param is not None:
        assert param in reply.json["error"]["message"]


def test_the_sdk_raises_its_own_error_for_another_model(served):
    with pytest.raises(anthropic.NotFoundError):
        client_for(served[0]).messages.create(
            model="claude-other", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        )
