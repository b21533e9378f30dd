"""Every family's real model through a tool-using chat turn on ``loom serve``, plain and streamed.

Each family's tiny checkpoint ships a chat template in the family's default
tool-call format. The request carries tools, an earlier call and its result,
and a named ``tool_choice``; the answer must be exactly what the engine's own
greedy generation of the same prompt reads as — the prompt being the
template's rendering of that history, plus the opening of the named call.
(Random weights write no sensible arguments, so the reply is typically a
call the format cannot read, which comes back as content; the test asserts
whichever it is, exactly.)
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

import mlx_loom
from mlx_loom.generation import stream_generate
from mlx_loom.serve import make_server
from mlx_loom.text.output_parser import Content, Reasoning, ToolCallFound

from .formats import FORMATS, WEATHER_TOOL, write_format_checkpoint
from .test_tools import ask

FAMILIES = ["llama", "qwen3_next", "qwen3_5", "gemma4_text", "gemma4"]
MAX_TOKENS = 10
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather"}}
HISTORY = [
    {"role": "system", "content": "You answer about weather."},
    {"role": "user", "content": "weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {**CALL, "function": {**CALL["function"], "arguments": json.dumps({"city": "Paris"})}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "user", "content": "and tomorrow?"},
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory) -> Iterator[tuple[object, tuple]]:
    """``(server, oracle (model, tokenizer))`` for the family's tiny model in its own format."""
    model_type = request.param
    claim = mlx_loom.default_host().registry.model_types[model_type]
    path = tmp_path_factory.mktemp(model_type) / "ckpt"
    write_format_checkpoint(path, FORMATS[claim.tool_parser], model_type=model_type)
    model, tokenizer = mlx_loom.load(path)
    server = make_server(model, tokenizer, port=0, model_id="tools")
    server.start_in_background()
    try:
        yield server, mlx_loom.load(path)
    finally:
        server.stop()


def expected_answer(server, oracle) -> tuple[list[int], tuple]:
    """The prompt the server should build, and how the engine's own greedy reply reads."""
    model, tokenizer = oracle
    fmt = server.app.chat_format
    parser = fmt.tool_parser
    as_objects = [dict(m) for m in HISTORY]
    as_objects[2] = {
        **HISTORY[2],
        "tool_calls": [
            {**CALL, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        ],
    }
    opening = parser.opening("get_weather", fmt.tools_template)
    text = tokenizer.apply_chat_template(as_objects, tools=[WEATHER_TOOL]) + parser.start + opening
    ids = tokenizer.encode(text, add_special_tokens=False)
    from mlx_loom.serve.tool_grammar import tool_call_grammar
    from mlx_loom.serve.tools import ToolPlan, output_parser

    # The server holds the call to the format's grammar where it has one; so does the oracle.
    plan = ToolPlan(tools=[WEATHER_TOOL], parse=True, forced=opening)
    grammar = tool_call_grammar(plan, fmt, tokenizer)
    responses = list(
        stream_generate(model, tokenizer, ids, max_tokens=MAX_TOKENS, grammar=grammar)
    )
    generated = "".join(r.text for r in responses)
    # What the answer must be: the forced call's opening plus the generated text, read
    # by the format (the parser's behaviour is specified by its own tests).
    splitter = output_parser(plan, fmt, in_reasoning=False)
    events = splitter.feed(generated) + splitter.finish()
    content = "".join(e.text for e in events if isinstance(e, Content)) or None
    reasoning = "".join(e.text for e in events if isinstance(e, Reasoning)) or None
    calls = [(e.call.name, e.call.arguments) for e in events if isinstance(e, ToolCallFound)]
    finish = responses[-1].finish_reason
    if calls and finish == "stop":
        finish = "tool_calls"
    return ids, (content, reasoning, calls, finish)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_tool_turn_on_the_real_model_is_the_engines_own_answer(family, stream):
    server, oracle = family
    ids, (content, reasoning, calls, finish) = expected_answer(server, oracle)
    got_content, got_reasoning, got_calls, got_finish = ask(
        server,
        HISTORY,
        stream=stream,
        tools=[WEATHER_TOOL],
        tool_choice=NAMED,
        max_tokens=MAX_TOKENS,
    )
    assert (got_content, got_reasoning, got_finish) == (content, reasoning, finish)
    assert [(c["name"], json.loads(c["arguments"])) for c in got_calls] == calls
    if got_content is not None:  # an unreadable call comes back whole, markers included
        assert got_content.startswith(server.app.chat_format.tool_parser.start)


def test_the_prompt_is_the_templates_rendering_of_tools_and_history(family):
    server, oracle = family
    ids, _ = expected_answer(server, oracle)
    reply = server.app.prepare(
        {"messages": HISTORY, "tools": [WEATHER_TOOL], "tool_choice": NAMED}, chat=True
    )
    assert reply.choices[0].job.prompt == ids
