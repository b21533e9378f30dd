"""Each tool-call format: what it reads, and what it refuses as malformed (never a crash)."""

from __future__ import annotations

import pytest

from mlx_loom.text.tool_calls import BUILTIN_TOOL_PARSERS, MalformedToolCall, ToolCall

PARSERS = {p.name: p for p in BUILTIN_TOOL_PARSERS}


def parse(name: str, text: str) -> list[ToolCall]:
    return PARSERS[name].parse(text)


def test_the_seven_formats_are_built_in():
    assert set(PARSERS) == {
        "harmony",
        "json_tools",
        "qwen3_coder",
        "gemma4",
        "minicpm5",
        "pythonic",
        "mistral",
    }


# --- json_tools -------------------------------------------------------------------


def test_json_tools_reads_name_and_arguments():
    calls = parse("json_tools", '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n')
    assert calls == [ToolCall("get_weather", {"city": "Paris"})]


def test_json_tools_reads_arguments_given_as_a_json_string():
    calls = parse("json_tools", '{"name": "f", "arguments": "{\\"n\\": 2}"}')
    assert calls == [ToolCall("f", {"n": 2})]


def test_json_tools_reads_a_list_of_calls():
    calls = parse("json_tools", '[{"name": "a", "arguments": {}}, {"name": "b"}]')
    assert [c.name for c in calls] == ["a", "b"]
    assert calls[1].arguments == {}


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "f", "arguments": {"city": "Par',  # cut off
        '{"arguments": {}}',  # no name
        '{"name": "f", "arguments": [1, 2]}',  # arguments not an object
        "[]",
        "[" * 100_000 + "]" * 100_000,  # deeper than json can recurse
    ],
)
def test_json_tools_refuses_what_is_not_a_call(text):
    with pytest.raises(MalformedToolCall):
        parse("json_tools", text)


# --- qwen3_coder ------------------------------------------------------------------

QWEN3_CODER = (
    "\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n"
)


def test_qwen3_coder_reads_parameters_as_text_without_layout_newlines():
    assert parse("qwen3_coder", QWEN3_CODER) == [
        ToolCall("get_weather", {"city": "New York", "days": "3"})
    ]


def test_qwen3_coder_keeps_inner_newlines_of_a_value():
    text = "<function=w>\n<parameter=body>\nline 1\nline 2\n</parameter>\n</function>"
    assert parse("qwen3_coder", text)[0].arguments == {"body": "line 1\nline 2"}


@pytest.mark.parametrize(
    "text",
    [
        "\n<function=f>\n<parameter=x>\n1\n",  # cut off
        '\n{"name": "f"}\n',  # the JSON format, not this one
        "<function=>\n</function>",  # no name
        "<function=f>junk<parameter=x>1</parameter></function>",
    ],
)
def test_qwen3_coder_refuses_what_is_not_a_call(text):
    with pytest.raises(MalformedToolCall):
        parse("qwen3_coder", text)


# --- gemma4 -----------------------------------------------------------------------


def test_gemma4_reads_its_own_object_notation():
    text = 'call:get_weather{city:<|"|>Paris, France<|"|>,days:3,metric:true,note:null}'
    assert parse("gemma4", text) == [
        ToolCall("get_weather", {"city": "Paris, France", "days": 3, "metric": True, "note": None})
    ]


def test_gemma4_reads_nested_objects_lists_and_floats():
    text = 'call:plot{points:[{x:1,y:-2.5},{x:2,y:0.5}],opts:{title:<|"|>a{b}c<|"|>}}'
    assert parse("gemma4", text)[0].arguments == {
        "points": [{"x": 1, "y": -2.5}, {"x": 2, "y": 0.5}],
        "opts": {"title": "a{b}c"},
    }


def test_gemma4_reads_several_calls_in_one_block():
    calls = parse("gemma4", "call:a{}call:b{n:1}")
    assert calls == [ToolCall("a", {}), ToolCall("b", {"n": 1})]


@pytest.mark.parametrize(
    "text",
    [
        'call:f{city:<|"|>Par',  # cut off inside a string
        "call:f{n:1",  # no closing brace
        "get_weather{}",  # no call: prefix
        "call:f{a:" + "[" * 200 + "]" * 200 + "}",  # deeper than the bound
    ],
)
def test_gemma4_refuses_what_is_not_a_call(text):
    with pytest.raises(MalformedToolCall):
        parse("gemma4", text)


# --- minicpm5 ---------------------------------------------------------------------


def test_minicpm5_reads_params_after_the_start_marker():
    text = '"get_weather"><param name="city">Paris</param><param name="days">3</param>'
    assert parse("minicpm5", text) == [ToolCall("get_weather", {"city": "Paris", "days": "3"})]


def test_minicpm5_reads_cdata_values_verbatim():
    text = '"run"><param name="code"><![CDATA[if a < b:\n    print("&")]]></param>'
    assert parse("minicpm5", text)[0].arguments == {"code": 'if a < b:\n    print("&")'}


@pytest.mark.parametrize(
    "text",
    ['"f"><param name="x">1', "get weather", '"f">stray text<param name="x">1</param>'],
)
def test_minicpm5_refuses_what_is_not_a_call(text):
    with pytest.raises(MalformedToolCall):
        parse("minicpm5", text)


# --- pythonic ---------------------------------------------------------------------


def test_pythonic_reads_a_list_of_keyword_calls():
    text = "[get_weather(city=\"Paris\", days=3), tools.search(q='x', exact=true, limit=None)]"
    assert parse("pythonic", text) == [
        ToolCall("get_weather", {"city": "Paris", "days": 3}),
        ToolCall("tools.search", {"q": "x", "exact": True, "limit": None}),
    ]


def test_pythonic_reads_nested_literals():
    text = "[f(a=[1, -2.5, (3, 4)], b={'k': {'z': false}})]"
    expected = {"a": [1, -2.5, [3, 4]], "b": {"k": {"z": False}}}
    assert parse("pythonic", text)[0].arguments == expected


@pytest.mark.parametrize(
    "text",
    [
        "[f(x=1",  # cut off
        "[f(1, 2)]",  # positional arguments
        "[f(x=open('/etc/passwd'))]",  # not a literal: never evaluated
        "[f(**kw)]",
        "[1, 2]",
    ],
)
def test_pythonic_refuses_what_is_not_a_call(text):
    with pytest.raises(MalformedToolCall):
        parse("pythonic", text)


# --- mistral ----------------------------------------------------------------------


def test_mistral_reads_the_json_list_with_ids():
    text = '[{"name": "f", "arguments": {"n": 1}, "id": "abc123def"}, {"name": "g"}]'
    assert parse("mistral", text) == [ToolCall("f", {"n": 1}, id="abc123def"), ToolCall("g", {})]


def test_mistral_reads_repeated_name_args_calls():
    text = 'get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[CALL_ID]x9[ARGS]{}'
    assert parse("mistral", text) == [
        ToolCall("get_weather", {"city": "Paris"}),
        ToolCall("get_time", {}, id="x9"),
    ]


@pytest.mark.parametrize(
    "text", ['f[ARGS]{"city": "Par', '[{"name": "f"', "just some words", "f[ARGS]{} and more"]
)
def test_mistral_refuses_what_is_not_a_call(text):
    with pytest.raises(MalformedToolCall):
        parse("mistral", text)


# --- opening a named call -------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "rest"),
    [
        ("json_tools", '{"city": "Paris"}}\n'),
        ("qwen3_coder", "<parameter=city>\nParis\n</parameter>\n</function>\n"),
        ("gemma4", 'city:<|"|>Paris<|"|>}'),
        ("minicpm5", '<param name="city">Paris</param>'),
        ("pythonic", 'city="Paris")]'),
    ],
)
def test_an_opening_plus_the_models_continuation_parses_as_that_call(name, rest):
    parser = PARSERS[name]
    calls = parser.parse(parser.opening("get_weather", "") + rest)
    assert calls == [ToolCall("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize(
    ("template", "rest"),
    [
        ("{{ '[TOOL_CALLS]' + name + '[ARGS]' }}", '{"city": "Paris"}'),
        ("[TOOL_CALLS]", '{"city": "Paris"}}]'),
    ],
)
def test_mistral_opens_a_call_in_the_spelling_its_template_uses(template, rest):
    parser = PARSERS["mistral"]
    calls = parser.parse(parser.opening("get_weather", template) + rest)
    assert calls == [ToolCall("get_weather", {"city": "Paris"})]
