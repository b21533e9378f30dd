"""Reasoning comes back as reasoning_content; template variables reach the template."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

import mlx_loom
from mlx_loom.serve import make_server

from .formats import FORMATS, scripted, write_format_checkpoint
from .test_tools import ask

USER = {"role": "user", "content": "hello"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, object]:
    """A ``<think>`` model (json_tools template) and a Gemma 4 ``<|channel>`` one."""
    out = {}
    for name in ("json_tools", "gemma4"):
        path = write_format_checkpoint(tmp_path_factory.mktemp(name) / "ckpt", FORMATS[name])
        out[name] = mlx_loom.load(path)
    return out


def serving(loaded, **options) -> Iterator[tuple[object, object]]:
    model, tokenizer = loaded
    server = make_server(model, tokenizer, port=0, model_id="tools", **options)
    worker = scripted(server)
    server.start_in_background()
    try:
        yield server, worker
    finally:
        server.stop()


@pytest.fixture(scope="module")
def think(checkpoints):
    yield from serving(checkpoints["json_tools"])


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_thinking_is_returned_as_reasoning_content(think, stream):
    server, worker = think
    worker.script("<think>\nThe user greets me.\n</think>\n\nHello there!")
    content, reasoning, calls, finish = ask(server, [USER], stream=stream)
    assert (content, reasoning, calls, finish) == (
        "Hello there!",
        "The user greets me.",
        [],
        "stop",
    )


def test_a_streamed_reasoning_delta_is_never_content(think):
    server, worker = think
    worker.script("<think>plan</think>answer")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    stream = client.chat.completions.create(model="tools", messages=[USER], stream=True)
    deltas = [c.choices[0].delta for c in stream]
    assert "".join(d.content or "" for d in deltas) == "answer"
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == "plan"


def test_enable_thinking_reaches_the_template_and_the_reply_opens_inside_it(think):
    server, worker = think
    worker.script("\nweighing it\n</think>\n\nYes.")
    content, reasoning, _, _ = ask(
        server, [USER], stream=False, extra_body={"chat_template_kwargs": {"enable_thinking": True}}
    )
    assert (content, reasoning) == ("Yes.", "weighing it")
    tokenizer = server.app.tokenizer
    assert worker.jobs[-1].prompt == tokenizer.encode_chat([USER], enable_thinking=True)


def test_thinking_disabled_by_the_template_leaves_the_reply_as_content(think):
    server, worker = think
    worker.script("Just an answer.")
    content, reasoning, _, _ = ask(
        server,
        [USER],
        stream=False,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert (content, reasoning) == ("Just an answer.", None)
    assert server.app.tokenizer.decode(worker.jobs[-1].prompt).endswith("</think>\n\n")


def test_gemma4_channel_thoughts_are_reasoning(checkpoints):
    for server, worker in serving(checkpoints["gemma4"]):
        assert server.app.chat_format.reasoning.name == "gemma4"
        worker.script("<|channel>thought\nshort plan<channel|>The answer.")
        content, reasoning, _, _ = ask(server, [USER], stream=True)
        assert (content, reasoning) == ("The answer.", "short plan")


def test_server_wide_template_args_apply_and_a_request_overrides_them(checkpoints):
    tokenizer = checkpoints["json_tools"][1]
    for server, worker in serving(
        checkpoints["json_tools"], chat_template_args={"enable_thinking": False}
    ):
        worker.script("a", "b")
        ask(server, [USER], stream=False)
        assert worker.jobs[-1].prompt == tokenizer.encode_chat([USER], enable_thinking=False)
        ask(
            server,
            [USER],
            stream=False,
            extra_body={"chat_template_kwargs": {"enable_thinking": True}},
        )
        assert worker.jobs[-1].prompt == tokenizer.encode_chat([USER], enable_thinking=True)


@pytest.mark.parametrize("args", [{"messages": []}, {"add_generation_prompt": False}, ["x"]])
def test_server_wide_template_args_may_not_set_what_the_server_sets(checkpoints, args):
    model, tokenizer = checkpoints["json_tools"]
    with pytest.raises(mlx_loom.LoomError):
        make_server(model, tokenizer, port=0, chat_template_args=args)


def test_python_callers_read_a_reply_with_the_servers_chat_format(checkpoints):
    from mlx_loom.serve import ChatFormat
    from mlx_loom.text import Content, Reasoning, ToolCallFound

    from .formats import SCRIPTED_CALLS, WEATHER_TOOL

    model, tokenizer = checkpoints["json_tools"]
    fmt = ChatFormat.for_model(model, tokenizer)
    assert (fmt.tool_parser.name, fmt.reasoning.name) == ("json_tools", "think")
    prompt = tokenizer.apply_chat_template([USER], tools=[WEATHER_TOOL], enable_thinking=True)
    parser = fmt.output_parser(tools=[WEATHER_TOOL], prompt=prompt)
    events = parser.feed("why\n</think>\nSure." + SCRIPTED_CALLS["json_tools"]) + parser.finish()
    assert [type(e) for e in events] == [Reasoning, Content, ToolCallFound]
    assert events[2].call.arguments == {"city": "Paris", "days": 2}
    # Without tools, the markup is text.
    plain = fmt.output_parser(prompt=prompt)
    assert [type(e) for e in plain.feed("a</think>b<tool_call>") + plain.finish()] == [
        Reasoning,
        Content,
    ]


def test_a_forced_call_closes_a_thinking_section_the_template_opened(think):
    from .formats import SCRIPTED_CALLS, WEATHER_TOOL

    server, worker = think
    worker.script(SCRIPTED_CALLS["json_tools"].removeprefix("<tool_call>"))
    content, reasoning, calls, finish = ask(
        server,
        [USER],
        stream=False,
        tools=[WEATHER_TOOL],
        tool_choice="required",
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )
    assert (content, reasoning, finish) == (None, None, "tool_calls")
    assert calls[0]["name"] == "get_weather"
    tokenizer = server.app.tokenizer
    rendered = tokenizer.apply_chat_template([USER], tools=[WEATHER_TOOL], enable_thinking=True)
    assert rendered.endswith("<think>\n")
    expected = tokenizer.encode(rendered + "</think>\n\n<tool_call>", add_special_tokens=False)
    assert worker.jobs[-1].prompt == expected
