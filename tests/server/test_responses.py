"""OpenAI's Responses API on /v1/responses, through the real ``openai`` client.

A scripted worker checks the shapes (items, events, usage, errors) and that a
Responses conversation renders the same prompt as the equivalent chat
completions request; the bundled tiny model checks ``text.format``; each
family's tiny checkpoint checks that a Responses turn, plain and streamed, is
the chat-completions answer to the same conversation.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

import mlx_loom
from mlx_loom.errors import LoomError
from mlx_loom.serve import make_server
from mlx_loom.serve.worker import Piece

from .conftest import serve
from .formats import FORMATS, SCRIPTED_CALLS, WEATHER_TOOL, scripted, write_format_checkpoint
from .test_structured_outputs import SCHEMA, TINY, valid_pet

WEATHER = {"type": "function", **WEATHER_TOOL["function"]}
ASK = {"role": "user", "content": "weather in Paris?"}


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[object, object]]:
    path = write_format_checkpoint(tmp_path_factory.mktemp("resp") / "ckpt", FORMATS["json_tools"])
    model, tokenizer = mlx_loom.load(path)
    server = make_server(model, tokenizer, port=0, model_id="tools")
    worker = scripted(server)
    server.start_in_background()
    try:
        yield server, worker
    finally:
        server.stop()


def client_for(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)


def chat_prompt(server, worker, messages, **extra) -> list[int]:
    """The prompt the chat-completions path builds for the same conversation."""
    worker.script("ok")
    client_for(server).chat.completions.create(model="tools", messages=messages, **extra)
    return list(worker.jobs[-1].prompt)


def test_a_plain_response_has_reasoning_and_message_items(served):
    server, worker = served
    worker.script("<think>greeting</think>Hello!")
    response = client_for(server).responses.create(
        model="tools", input="hi", instructions="Be brief.", max_output_tokens=16, store=True
    )
    prompt = list(worker.jobs[-1].prompt)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status == "completed" and response.model == "tools"
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == "greeting"
    assert response.output_text == "Hello!"
    assert response.store is False  # accepted, and said not kept
    assert response.usage.input_tokens == len(prompt)
    assert response.usage.input_tokens_details.cached_tokens == 0
    assert response.usage.output_tokens > 0
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    system = {"role": "system", "content": "Be brief."}
    assert prompt == chat_prompt(server, worker, [system, {"role": "user", "content": "hi"}])


def test_instructions_and_developer_messages_are_one_system_turn(served):
    server, worker = served
    worker.script("ok")
    items = [
        {"role": "developer", "content": "Use tools."},
        {
            "type": "message",
            "role": "developer",
            "content": [{"type": "input_text", "text": "Be kind."}],
        },
        {"role": "user", "content": "hi"},
    ]
    client_for(server).responses.create(model="tools", input=items, instructions="Be brief.")
    prompt = list(worker.jobs[-1].prompt)
    system = {"role": "system", "content": "Be brief.\n\nUse tools.\n\nBe kind."}
    assert prompt == chat_prompt(server, worker, [system, {"role": "user", "content": "hi"}])


def test_a_streamed_response_sends_the_event_sequence(served):
    server, worker = served
    worker.script("<think>hmm</think>Hello there!")
    events = list(
        client_for(server).responses.create(model="tools", input="hi", stream=True)
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    reasoning = [e for e in kinds if e.startswith("response.reasoning_text")]
    assert reasoning[-1] == "response.reasoning_text.done"
    message = kinds[kinds.index("response.output_item.added", 3) :]
    assert message[:2] == ["response.output_item.added", "response.content_part.added"]
    assert message[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = events[-1].response
    assert deltas == "Hello there!" == done.output_text
    assert [item.type for item in done.output] == ["reasoning", "message"]
    assert done.usage.output_tokens > 0


def test_the_stream_helper_accumulates_the_same_response(served):
    server, worker = served
    worker.script("Hello there!")
    with client_for(server).responses.stream(model="tools", input="hi") as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert final.output_text == "Hello there!" and final.status == "completed"


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_function_call_round_trips_through_function_call_output(served, stream):
    server, worker = served
    worker.script("Checking." + SCRIPTED_CALLS["json_tools"], "Sunny.")
    client = client_for(server)
    kwargs = dict(model="tools", input=[ASK], tools=[WEATHER], max_output_tokens=64)
    if stream:
        events = list(client.responses.create(stream=True, **kwargs))
        kinds = [e.type for e in events]
        assert "response.function_call_arguments.delta" in kinds
        args_done = next(e for e in events if e.type == "response.function_call_arguments.done")
        assert json.loads(args_done.arguments) == {"city": "Paris", "days": 2}
        first = events[-1].response
    else:
        first = client.responses.create(**kwargs)
    message, call = first.output
    assert message.type == "message" and message.content[0].text == "Checking."
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris", "days": 2}
    history = [
        ASK,
        *[item.model_dump(exclude_none=True) for item in first.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
    ]
    second = client.responses.create(model="tools", input=history, tools=[WEATHER])
    assert second.output_text == "Sunny."
    as_chat = [
        ASK,
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
    ]
    prompt = list(worker.jobs[-1].prompt)
    assert prompt == chat_prompt(server, worker, as_chat, tools=[WEATHER_TOOL])


def test_a_named_tool_choice_and_reasoning_effort_reach_the_chat_path(served):
    server, worker = served
    # A named call's opening is the server's; the model writes the rest.
    worker.script('{"city": "Paris"}}\n</tool_call>')
    response = client_for(server).responses.create(
        model="tools",
        input=[ASK],
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        reasoning={"effort": "none"},
    )
    assert [item.type for item in response.output] == ["function_call"]
    assert json.loads(response.output[0].arguments) == {"city": "Paris"}
    prompt = list(worker.jobs[-1].prompt)
    want = chat_prompt(
        server,
        worker,
        [ASK],
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert prompt == want


def test_a_reply_cut_by_max_output_tokens_is_incomplete(served):
    server, worker = served
    worker.script(("Hello", "length"))
    response = client_for(server).responses.create(model="tools", input="hi", max_output_tokens=2)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    worker.script(("Hello", "length"))
    events = list(
        client_for(server).responses.create(
            model="tools", input="hi", max_output_tokens=2, stream=True
        )
    )
    assert events[-1].type == "response.incomplete"


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type", "'web_search'"),
        ({"previous_response_id": "resp_1"}, "previous_response_id", "keeps no past"),
        ({"max_output_tokens": "many"}, "max_output_tokens", "max_output_tokens"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type", "input_image"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input[0].content[0]",
            "input_image",
        ),
        ({"text": {"format": {"type": "json_schema"}}}, "text.format", "name and a schema"),
        ({"frequency_penalti": 1}, None, "frequency_penalti"),
    ],
)
def test_what_cannot_be_served_is_a_400_in_openais_shape(served, extra, param, words):
    server, worker = served
    body = {"model": "tools", "input": "hi", **extra}
    with pytest.raises(openai.BadRequestError) as caught:
        client_for(server).post("/responses", body=body, cast_to=object)
    error = caught.value.body
    assert words in error["message"]
    if param is not None:
        assert error["param"] == param
    worker.clear()


def test_a_failure_mid_stream_is_an_error_event_then_response_failed(served, monkeypatch):
    server, worker = served

    def fail_after_one_piece(job):
        worker.jobs.append(job)
        job.events.put(
            Piece(text="Hel", token=0, logprob=0.0, top_logprobs=[], prompt_tokens=3,
                  generation_tokens=1, cached_tokens=0, finish_reason=None)
        )
        job.events.put(LoomError("the engine failed", fix="retry"))

    monkeypatch.setattr(worker, "submit", fail_after_one_piece)
    events = list(client_for(server).responses.create(model="tools", input="hi", stream=True))
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    assert "the engine failed" in events[-2].message
    assert events[-1].response.status == "failed"


def test_routine_fields_are_accepted(served):
    server, worker = served
    worker.script("fine")
    response = client_for(server).responses.create(
        model="tools",
        input="hi",
        store=False,
        metadata={"k": "v"},
        user="u",
        include=["reasoning.encrypted_content"],
        prompt_cache_key="p",
        extra_body={"client_metadata": {"session_id": "s"}},
        parallel_tool_calls=False,
        text={"verbosity": "low"},
    )
    assert response.output_text == "fine"


# --- the real bundled tiny model: text.format ------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = mlx_loom.load(TINY)
    for served in serve(model, tokenizer, model_id="m"):
        yield openai.OpenAI(base_url=f"{served.server.url}/v1", api_key="x", max_retries=0)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_text_format_json_schema_replies_validate(tiny, stream):
    fmt = {"type": "json_schema", "name": "pet", "schema": SCHEMA, "strict": True}
    kwargs = dict(
        model="m", input="Describe a pet.", max_output_tokens=80, temperature=1.0,
        text={"format": fmt},
    )
    if stream:
        events = list(tiny.responses.create(stream=True, **kwargs))
        response = events[-1].response
    else:
        response = tiny.responses.create(**kwargs)
    assert response.status == "completed"
    assert valid_pet(json.loads(response.output_text)), response.output_text


# --- each family's tiny checkpoint ------------------------------------------------------

FAMILIES = ["llama", "qwen3_next", "qwen3_5", "gemma4_text", "gemma4"]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory) -> Iterator[openai.OpenAI]:
    claim = mlx_loom.default_host().registry.model_types[request.param]
    path = tmp_path_factory.mktemp(request.param) / "ckpt"
    write_format_checkpoint(path, FORMATS[claim.tool_parser], model_type=request.param)
    model, tokenizer = mlx_loom.load(path)
    for served in serve(model, tokenizer, model_id="m"):
        yield openai.OpenAI(base_url=f"{served.server.url}/v1", api_key="x", max_retries=0)


def _chat_answer(client: openai.OpenAI, messages, **extra) -> tuple:
    message = client.chat.completions.create(
        model="m", messages=messages, max_tokens=8, temperature=0, tools=[WEATHER_TOOL], **extra
    ).choices[0].message
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    return message.content or "", getattr(message, "reasoning_content", None) or "", calls


def _responses_answer(client: openai.OpenAI, items, *, stream: bool) -> tuple:
    kwargs = dict(model="m", input=items, max_output_tokens=8, temperature=0, tools=[WEATHER])
    if stream:
        events = list(client.responses.create(stream=True, **kwargs))
        assert events[0].type == "response.created"
        response = events[-1].response
    else:
        response = client.responses.create(**kwargs)
    reasoning = "".join(
        part.text for item in response.output if item.type == "reasoning"
        for part in item.content or []
    )
    calls = [(i.name, i.arguments) for i in response.output if i.type == "function_call"]
    return response.output_text, reasoning, calls


def test_every_family_answers_a_response_as_chat_completions_does(family):
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather",
            "arguments": json.dumps({"city": "Paris"})}
    items = [
        ASK,
        call,
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"role": "user", "content": "and tomorrow?"},
    ]
    messages = [
        ASK,
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": call["arguments"]}}
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "user", "content": "and tomorrow?"},
    ]
    want = _chat_answer(family, messages)
    assert _responses_answer(family, items, stream=False) == want
    assert _responses_answer(family, items, stream=True) == want
    assert _responses_answer(family, [ASK], stream=True) == _chat_answer(family, [ASK])


def test_a_resent_conversation_reports_its_cached_prompt_tokens(tiny):
    items = [{"role": "user", "content": "Describe a pet in a few words, please."}]
    first = tiny.responses.create(model="m", input=items, max_output_tokens=4, temperature=0)
    items += [
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And another?"},
    ]
    events = list(
        tiny.responses.create(
            model="m", input=items, max_output_tokens=4, temperature=0, stream=True
        )
    )
    usage = events[-1].response.usage
    # The second turn reuses more than the template's opening the first could.
    cached = usage.input_tokens_details.cached_tokens
    assert first.usage.input_tokens_details.cached_tokens < cached < usage.input_tokens
