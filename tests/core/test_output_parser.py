"""Splitting a streamed generation into content, reasoning and tool calls."""

from __future__ import annotations

import logging

import pytest

from mlx_loom.text.output_parser import Content, OutputParser, Reasoning, ToolCallFound
from mlx_loom.text.reasoning import GEMMA4_CHANNEL, THINK
from mlx_loom.text.tool_calls import BUILTIN_TOOL_PARSERS, ToolCall, ToolParser

PARSERS = {p.name: p for p in BUILTIN_TOOL_PARSERS}
WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            },
        },
    }
]

#: One script per format: text, a call, more text. The days argument is
#: written as text (or a bare number) and must come out as the integer 2.
SCRIPTS = {
    "json_tools": 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": '
    '{"city": "Paris", "days": "2"}}\n</tool_call>\n',
    "qwen3_coder": "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
    "</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
    "gemma4": 'Checking.<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:2}<tool_call|>',
    "minicpm5": 'Checking.\n<function name="get_weather"><param name="city">Paris</param>'
    '<param name="days">2</param></function>',
    "pythonic": 'Checking.<|tool_call_start|>[get_weather(city="Paris", days=2)]<|tool_call_end|>',
    "mistral": 'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}',
}
CALL = ToolCall("get_weather", {"city": "Paris", "days": 2})


def run(parser: OutputParser, text: str, size: int | None = None) -> list:
    """Feed ``text`` in chunks of ``size`` (all at once for None); merge adjacent text events."""
    events = []
    chunks = [text] if size is None else [text[i : i + size] for i in range(0, len(text), size)]
    for chunk in chunks:
        events += parser.feed(chunk)
    events += parser.finish()
    return merged(events)


def merged(events: list) -> list:
    out: list = []
    for event in events:
        if out and type(event) is type(out[-1]) and not isinstance(event, ToolCallFound):
            out[-1] = type(event)(out[-1].text + event.text)
        else:
            out.append(event)
    return out


@pytest.mark.parametrize("size", [None, 1, 2, 3, 5, 7])
def test_text_without_markers_passes_through_unchanged(size):
    text = "  Hello,\n\nworld <b>bold</b> [x] {y} <|im_end|>?  \n"
    parser = OutputParser(tool_parser=PARSERS["json_tools"], tools=WEATHER, reasoning=THINK)
    assert run(parser, text, size) == [Content(text)]


@pytest.mark.parametrize("name", sorted(SCRIPTS))
@pytest.mark.parametrize("size", [None, 1, 2, 3, 4, 7, 11])
def test_each_format_yields_the_content_and_the_typed_call_however_it_is_chunked(name, size):
    parser = OutputParser(tool_parser=PARSERS[name], tools=WEATHER)
    assert run(parser, SCRIPTS[name], size) == [Content("Checking."), ToolCallFound(CALL)]
    assert parser.calls == 1


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_no_streamed_content_ever_holds_markup(name):
    parser = OutputParser(tool_parser=PARSERS[name], tools=WEATHER)
    contents = []
    for ch in SCRIPTS[name]:
        contents += [e.text for e in parser.feed(ch) if isinstance(e, Content)]
    contents += [e.text for e in parser.finish() if isinstance(e, Content)]
    assert "".join(contents) == "Checking."


def test_text_that_might_start_a_marker_is_held_until_decided():
    parser = OutputParser(tool_parser=PARSERS["json_tools"])
    assert parser.feed("Hi <tool") == [Content("Hi")]
    assert parser.feed("box>") == [Content(" <toolbox>")]


def test_reasoning_and_answer_are_separated_and_layout_newlines_dropped():
    parser = OutputParser(reasoning=THINK)
    text = "<think>\nThe user wants a greeting.\n</think>\n\nHello!"
    assert run(parser, text, 2) == [Reasoning("The user wants a greeting."), Content("Hello!")]


def test_a_reply_that_starts_inside_an_open_thinking_section_is_reasoning_first():
    parser = OutputParser(reasoning=THINK, in_reasoning=True)
    assert run(parser, "\nhmm\n</think>\n\nYes.", 3) == [Reasoning("hmm"), Content("Yes.")]


def test_gemma4_channel_reasoning_is_recognised():
    parser = OutputParser(reasoning=GEMMA4_CHANNEL)
    text = "<|channel>thought\nplan<channel|>Answer"
    assert run(parser, text, 4) == [Reasoning("plan"), Content("Answer")]


def test_a_thinking_section_cut_off_by_the_token_limit_stays_reasoning():
    parser = OutputParser(reasoning=THINK)
    assert run(parser, "<think>still thinking about <tool_c", 3) == [
        Reasoning("still thinking about <tool_c")
    ]


def test_tool_markup_inside_reasoning_is_thought_not_a_call():
    parser = OutputParser(tool_parser=PARSERS["json_tools"], reasoning=THINK)
    text = '<think>maybe <tool_call>{"name": "x"}</tool_call></think>Done'
    assert run(parser, text) == [
        Reasoning('maybe <tool_call>{"name": "x"}</tool_call>'),
        Content("Done"),
    ]


def test_reasoning_then_a_call_then_more_text():
    parser = OutputParser(tool_parser=PARSERS["json_tools"], tools=WEATHER, reasoning=THINK)
    text = "<think>need weather</think>\n\n" + SCRIPTS["json_tools"] + "Then more."
    assert run(parser, text, 5) == [
        Reasoning("need weather"),
        Content("Checking."),
        ToolCallFound(CALL),
        Content("Then more."),
    ]


def test_consecutive_calls_are_each_found():
    call = '<function name="get_weather"><param name="city">Paris</param></function>'
    parser = OutputParser(tool_parser=PARSERS["minicpm5"], tools=WEATHER)
    events = run(parser, call + "\n" + call, 6)
    assert events == [ToolCallFound(ToolCall("get_weather", {"city": "Paris"}))] * 2
    assert parser.calls == 2


def test_a_malformed_call_comes_back_as_content_and_the_log_says_why(caplog):
    parser = OutputParser(tool_parser=PARSERS["json_tools"])
    text = 'Try <tool_call>{"name": oops}</tool_call> end'
    with caplog.at_level(logging.WARNING, logger="mlx_loom.text"):
        events = run(parser, text, 4)
    assert events == [Content('Try<tool_call>{"name": oops}</tool_call> end')]
    assert "json_tools" in caplog.text and "not valid JSON" in caplog.text
    assert parser.calls == 0


def test_a_call_cut_off_by_the_end_of_generation_comes_back_as_content(caplog):
    parser = OutputParser(tool_parser=PARSERS["qwen3_coder"])
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"
    with caplog.at_level(logging.WARNING, logger="mlx_loom.text"):
        assert run(parser, text, 3) == [Content(text)]
    assert "ended inside the call" in caplog.text


def test_a_complete_call_missing_only_its_end_marker_is_still_read():
    parser = OutputParser(tool_parser=PARSERS["json_tools"], tools=WEATHER)
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
    assert run(parser, text) == [ToolCallFound(CALL)]


@pytest.mark.parametrize(
    "result",
    [
        RuntimeError("plugin bug"),
        None,
        ["not a call"],
        [ToolCall("f", "not a dict")],  # type: ignore[arg-type]
    ],
)
def test_a_plugin_parser_that_raises_or_returns_junk_yields_content(result, caplog):
    def parse(text):
        if isinstance(result, Exception):
            raise result
        return result

    bad = ToolParser(name="bad", start="<<", end=">>", parse=parse)
    parser = OutputParser(tool_parser=bad)
    with caplog.at_level(logging.WARNING, logger="mlx_loom.text"):
        assert run(parser, "a <<x>> b") == [Content("a<<x>> b")]
    assert "bad format" in caplog.text


def test_without_a_tool_parser_markup_is_content():
    text = SCRIPTS["json_tools"]
    assert run(OutputParser(), text, 3) == [Content(text)]


def test_a_forced_call_starts_inside_the_call_with_its_opening():
    parser = PARSERS["json_tools"]
    out = OutputParser(
        tool_parser=parser, tools=WEATHER, forced_call=parser.opening("get_weather", "")
    )
    assert run(out, '{"city": "Paris", "days": "2"}}\n</tool_call>', 3) == [ToolCallFound(CALL)]


def test_mistral_calls_run_to_the_end_of_the_generation():
    parser = OutputParser(tool_parser=PARSERS["mistral"], tools=WEATHER)
    call = 'get_weather[ARGS]{"city": "Paris", "days": 2}'
    text = f"[TOOL_CALLS]{call}[TOOL_CALLS]{call}"
    assert run(parser, text, 5) == [ToolCallFound(CALL), ToolCallFound(CALL)]


def test_feed_after_finish_is_an_error():
    parser = OutputParser()
    parser.finish()
    with pytest.raises(RuntimeError):
        parser.feed("x")
