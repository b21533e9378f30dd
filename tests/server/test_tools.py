"""Tool calling through the real ``openai`` client, for every tool-call format, plain and streamed.

The model's replies are scripted (a stand-in for the generation worker, see
``formats.py``) so each format's markup arrives exactly as a model writes
it, split across pieces; everything else — request parsing, the chat
template, the prompt, the output parser, the response — is the server's.
``test_tool_calls_end_to_end.py`` runs the same path on each family's real
model.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import openai
import pytest

import mlx_loom
from mlx_loom.serve import make_server

from .formats import FORMATS, SCRIPTED_CALLS, WEATHER_TOOL, scripted, write_format_checkpoint

USER = {"role": "user", "content": "weather in Paris?"}
PARIS = {"city": "Paris", "days": 2}


@pytest.fixture(scope="module", params=sorted(FORMATS))
def served(request, tmp_path_factory) -> Iterator[tuple[str, object, object]]:
    """``(format name, server, scripted worker)`` for a checkpoint whose template uses it."""
    name = request.param
    path = write_format_checkpoint(tmp_path_factory.mktemp(name) / "ckpt", FORMATS[name])
    model, tokenizer = mlx_loom.load(path)
    server = make_server(model, tokenizer, port=0, model_id="tools")
    worker = scripted(server)
    server.start_in_background()
    try:
        yield name, server, worker
    finally:
        server.stop()


def client_for(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def collect(stream) -> dict:
    """Accumulate a streamed chat answer the way a client does: text, reasoning, calls by index."""
    out = {"content": "", "reasoning": "", "calls": {}, "finish": None, "deltas": []}
    for chunk in stream:
        choice = chunk.choices[0]
        delta = choice.delta
        out["deltas"].append(delta)
        out["content"] += delta.content or ""
        out["reasoning"] += (delta.model_extra or {}).get("reasoning_content") or ""
        for call in delta.tool_calls or []:
            entry = out["calls"].setdefault(call.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = call.id or entry["id"]
            if call.function is not None:
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
        out["finish"] = choice.finish_reason or out["finish"]
    return out


def ask(server, messages, *, stream: bool, **options):
    """One chat request; returns ``(content, reasoning, calls as dicts, finish_reason)``."""
    client = client_for(server)
    if stream:
        got = collect(
            client.chat.completions.create(model="tools", messages=messages, stream=True, **options)
        )
        calls = [got["calls"][i] for i in sorted(got["calls"])]
        return got["content"] or None, got["reasoning"] or None, calls, got["finish"]
    reply = client.chat.completions.create(model="tools", messages=messages, **options)
    message = reply.choices[0].message
    calls = [
        {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
        for c in message.tool_calls or []
    ]
    reasoning = (message.model_extra or {}).get("reasoning_content")
    return message.content, reasoning, calls, reply.choices[0].finish_reason


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_an_openai_client_drives_a_tool_conversation(served, stream):
    name, server, worker = served
    worker.script("Let me check.\n" + SCRIPTED_CALLS[name], "It is sunny in Paris.")
    content, _, calls, finish = ask(server, [USER], stream=stream, tools=[WEATHER_TOOL])
    assert content == "Let me check."
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", PARIS)]
    call_id = calls[0]["id"]
    assert call_id and call_id.startswith("call_")

    history = [
        USER,
        {
            "role": "assistant",
            "content": content,
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": calls[0]["arguments"]},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": "sunny, 21 C"},
    ]
    content, _, calls, finish = ask(server, history, stream=stream, tools=[WEATHER_TOOL])
    assert (content, calls, finish) == ("It is sunny in Paris.", [], "stop")
    # The history reached the template: the earlier call in this format, then the result.
    tokenizer = server.app.tokenizer
    as_template_input = [
        history[0],
        {**history[1], "tool_calls": [{"function": {"name": "get_weather", "arguments": PARIS}}]},
        history[2],
    ]
    assert worker.jobs[-1].prompt == tokenizer.encode_chat(as_template_input, tools=[WEATHER_TOOL])


def test_streamed_calls_arrive_as_a_head_then_arguments_and_no_markup_as_content(served):
    name, server, worker = served
    worker.script("Checking." + SCRIPTED_CALLS[name])
    got = collect(
        client_for(server).chat.completions.create(
            model="tools", messages=[USER], tools=[WEATHER_TOOL], stream=True
        )
    )
    fragments = [c for d in got["deltas"] for c in d.tool_calls or []]
    assert len(fragments) == 2
    head, args = fragments
    assert head.id and head.type == "function" and head.function.name == "get_weather"
    assert head.function.arguments == ""
    assert args.id is None and json.loads(args.function.arguments) == PARIS
    assert got["content"] == "Checking."
    start = server.app.chat_format.tool_parser.start
    assert all(start[:3] not in (d.content or "") for d in got["deltas"])


def test_the_chosen_parser_is_the_templates_format(served):
    name, server, _ = served
    fmt = server.app.chat_format
    assert fmt.tool_parser.name == name
    assert "template" in fmt.tool_parser_reason


def test_tool_choice_none_keeps_tools_out_of_the_prompt_and_markup_in_the_content(served):
    name, server, worker = served
    worker.script(SCRIPTED_CALLS[name])
    content, _, calls, finish = ask(
        server, [USER], stream=False, tools=[WEATHER_TOOL], tool_choice="none"
    )
    assert calls == [] and finish == "stop"
    assert content == SCRIPTED_CALLS[name]
    assert worker.jobs[-1].prompt == server.app.tokenizer.encode_chat([USER])


def test_tool_choice_required_opens_a_call_in_the_prompt(served):
    name, server, worker = served
    parser = server.app.chat_format.tool_parser
    worker.script(SCRIPTED_CALLS[name].removeprefix(parser.start))
    _, _, calls, finish = ask(
        server, [USER], stream=False, tools=[WEATHER_TOOL], tool_choice="required"
    )
    assert finish == "tool_calls" and json.loads(calls[0]["arguments"]) == PARIS
    tokenizer = server.app.tokenizer
    expected = tokenizer.apply_chat_template([USER], tools=[WEATHER_TOOL]) + parser.start
    assert worker.jobs[-1].prompt == tokenizer.encode(expected, add_special_tokens=False)


def test_a_named_tool_choice_opens_a_call_to_that_function(served):
    name, server, worker = served
    parser = server.app.chat_format.tool_parser
    opening = parser.start + parser.opening("get_weather", server.app.chat_format.tools_template)
    worker.script(SCRIPTED_CALLS[name].removeprefix(opening))
    choice = {"type": "function", "function": {"name": "get_weather"}}
    _, _, calls, finish = ask(server, [USER], stream=True, tools=[WEATHER_TOOL], tool_choice=choice)
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", PARIS)]
    expected = server.app.tokenizer.apply_chat_template([USER], tools=[WEATHER_TOOL]) + opening
    assert worker.jobs[-1].prompt == server.app.tokenizer.encode(expected, add_special_tokens=False)


def test_parallel_tool_calls_false_ends_the_reply_after_the_first_call(served):
    name, server, worker = served
    for stream in (False, True):
        worker.script(SCRIPTED_CALLS[name] + "\n" + SCRIPTED_CALLS[name])
        _, _, calls, finish = ask(
            server, [USER], stream=stream, tools=[WEATHER_TOOL], parallel_tool_calls=False
        )
        assert len(calls) == 1 and finish == "tool_calls"


def test_a_malformed_call_comes_back_as_content_and_is_logged(served, caplog):
    name, server, worker = served
    broken = SCRIPTED_CALLS[name][: len(SCRIPTED_CALLS[name]) * 2 // 3]
    worker.script((broken, "length"))
    with caplog.at_level(logging.WARNING, logger="mlx_loom.text"):
        content, _, calls, finish = ask(server, [USER], stream=False, tools=[WEATHER_TOOL])
    assert calls == [] and finish == "length"
    assert content == broken
    assert f"{name} format was not readable" in caplog.text
