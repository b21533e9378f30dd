"""gpt-oss's Harmony format: analysis is reasoning, final is the answer, a function call is a
commentary message to ``functions.NAME`` — read from the stream however it is chunked."""

from __future__ import annotations

import pytest

from mlx_loom.text.output_parser import Content, OutputParser, Reasoning, ToolCallFound
from mlx_loom.text.reasoning import HARMONY, infer_reasoning
from mlx_loom.text.tool_calls import (
    BUILTIN_TOOL_PARSERS,
    MalformedToolCall,
    ToolCall,
    choose_tool_parser,
    parser_table,
)

PARSER = {p.name: p for p in BUILTIN_TOOL_PARSERS}["harmony"]
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
CALL = ToolCall("get_weather", {"city": "Paris", "days": 2})
SIZES = [None, 1, 2, 3, 5, 7]

# What a reply to a prompt ending "<|start|>assistant" looks like (<|return|> and
# <|call|> are end-of-sequence tokens: usually absent from the text).
ANSWER = (
    "<|channel|>analysis<|message|>The user greets me.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hello there!"
)
TOOL = (
    "<|channel|>analysis<|message|>Need the weather.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris", "days": "2"}'
)


def run(parser: OutputParser, text: str, size: int | None) -> list:
    chunks = [text] if size is None else [text[i : i + size] for i in range(0, len(text), size)]
    events = [e for chunk in chunks for e in parser.feed(chunk)] + parser.finish()
    out: list = []
    for event in events:  # merge adjacent text events
        if out and type(event) is type(out[-1]) and not isinstance(event, ToolCallFound):
            out[-1] = type(event)(out[-1].text + event.text)
        else:
            out.append(event)
    return out


def harmony(**options) -> OutputParser:
    return OutputParser(tool_parser=PARSER, tools=WEATHER, reasoning=HARMONY, **options)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("tail", ["", "<|return|>"])
def test_analysis_is_reasoning_and_final_is_the_answer(size, tail):
    assert run(harmony(), ANSWER + tail, size) == [
        Reasoning("The user greets me."),
        Content("Hello there!"),
    ]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("tail", ["", "<|call|>"])
def test_a_commentary_message_to_a_function_is_a_typed_call(size, tail):
    parser = harmony()
    assert run(parser, TOOL + tail, size) == [Reasoning("Need the weather."), ToolCallFound(CALL)]
    assert parser.calls == 1


def test_the_role_header_form_and_a_preamble_are_read():
    text = (
        "<|channel|>commentary<|message|>Let me check.<|end|>"
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city":'
        ' "Paris", "days": 2}<|call|>'
    )
    assert run(harmony(), text, 3) == [Content("Let me check."), ToolCallFound(CALL)]


def test_no_streamed_answer_ever_holds_harmony_markup():
    parser = harmony()
    contents = []
    for ch in ANSWER + "<|return|>":
        contents += [e.text for e in parser.feed(ch) if isinstance(e, Content)]
    contents += [e.text for e in parser.finish() if isinstance(e, Content)]
    assert "".join(contents) == "Hello there!"


def test_without_tools_the_answer_is_still_separated_from_the_reasoning():
    parser = OutputParser(reasoning=HARMONY)
    assert run(parser, ANSWER, 4) == [Reasoning("The user greets me."), Content("Hello there!")]


def test_an_unreadable_call_comes_back_as_content():
    text = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{bad"
    events = run(harmony(), text, None)
    assert not any(isinstance(e, ToolCallFound) for e in events)
    assert "{bad" in "".join(e.text for e in events if isinstance(e, Content))


@pytest.mark.parametrize(
    "text",
    [
        'get_weather {"city": "Paris"}',  # no <|message|>
        "get_weather<|message|>[1, 2]",  # arguments not an object
        'get weather<|message|>{"city": "Paris"}',  # a name with a space
    ],
)
def test_the_parser_refuses_what_is_not_a_call(text):
    with pytest.raises(MalformedToolCall):
        PARSER.parse(text)


def test_an_opening_plus_the_models_continuation_parses_as_that_call():
    calls = PARSER.parse(PARSER.opening("get_weather", "") + '{"city": "Paris"}')
    assert calls == [ToolCall("get_weather", {"city": "Paris"})]


HARMONY_TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
    "{% for t in m.tool_calls %}<|start|>assistant to=functions.{{ t.name }}"
    "<|channel|>commentary json<|message|>{{ t.arguments }}<|call|>{% endfor %}"
)


def test_a_harmony_template_selects_the_harmony_formats():
    assert infer_reasoning(HARMONY_TEMPLATE, lambda t: False) is HARMONY
    choice = choose_tool_parser(parser_table(), template=HARMONY_TEMPLATE)
    assert choice.parser is PARSER
