"""The forced-call grammars, format by format, against each format's own parser.

A "model" here draws every token uniformly from those the grammar allows —
harsher than random weights, which favour few tokens — and each finished
call must read back, through the server's output parser, as one call whose
arguments validate against the tool's schema. Schemas a format cannot carry
are refused by name.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import numpy as np
import pytest

from mlx_loom.engine.constraints import RowConstraint, allocate_masks, compile_constraint
from mlx_loom.errors import CapabilityRefused, RequestError
from mlx_loom.serve.tool_grammar import tool_call_grammar
from mlx_loom.serve.tools import ChatFormat, ToolPlan, output_parser
from mlx_loom.testing.tokenizer import write_tokenizer
from mlx_loom.text import Tokenizer
from mlx_loom.text.output_parser import ToolCallFound
from mlx_loom.text.tool_calls import parser_table

from .formats import FORMATS, add_tokens
from .test_forced_tool_calls import MISTRAL_LIST

#: Characters a published tokenizer writes and the trained test vocabulary lacks.
BYTES = ("<", ">", "/", "|", "_", "\\", "&", "\t", "\\u", "d8")
RICH = {
    "type": "function",
    "function": {
        "name": "rich.v2",
        "parameters": {
            "type": "object",
            "properties": {
                "mode": {"enum": ["a b", "x", 3, True, None]},
                "k": {"const": "zz"},
                "obj": {
                    "type": "object",
                    "properties": {
                        "n": {"type": "integer"},
                        "s": {"type": "string", "maxLength": 4},
                    },
                    "required": ["n"],
                },
                "arr": {"type": "array", "items": {"type": "integer"}},
                "ns": {"type": ["string", "null"], "maxLength": 6},
                "f": {"type": "number"},
                "ok": {"type": "boolean"},
            },
            "required": ["mode", "k", "obj", "ns"],
        },
    },
}
CASES = {**FORMATS, "mistral_list": MISTRAL_LIST}


def valid(value, schema) -> bool:
    """The JSON-schema keywords these tests use."""
    if "enum" in schema and value not in schema["enum"]:
        return False
    if "const" in schema and value != schema["const"]:
        return False
    kinds = schema.get("type")
    kinds = [kinds] if isinstance(kinds, str) else kinds or []
    checks = {
        "string": lambda v: isinstance(v, str),
        "integer": lambda v: type(v) is int,
        "number": lambda v: type(v) in (int, float),
        "boolean": lambda v: type(v) is bool,
        "null": lambda v: v is None,
        "object": lambda v: isinstance(v, dict),
        "array": lambda v: isinstance(v, list),
    }
    if kinds and not any(checks[k](value) for k in kinds):
        return False
    if isinstance(value, str) and len(value) > schema.get("maxLength", len(value)):
        return False
    if isinstance(value, list):
        return all(valid(v, schema.get("items", {})) for v in value)
    if isinstance(value, dict):
        props = schema.get("properties", {})
        return (
            all(r in value for r in schema.get("required", ()))
            and set(value) <= set(props)
            and all(valid(v, props[k]) for k, v in value.items())
        )
    return True


def tokenizer_for(path: Path, fmt) -> Tokenizer:
    write_tokenizer(path, 512)
    add_tokens(path, (*fmt.tokens, *fmt.think_tokens, *BYTES))
    return Tokenizer.from_dir(path)


def draw(tokenizer: Tokenizer, grammar: str, seed: int, limit: int = 300) -> str | None:
    """A uniformly random output the grammar allows (``None``: not finished in ``limit``)."""
    constraint = compile_constraint("grammar", grammar, tokenizer)
    eos = frozenset(tokenizer.eos_token_ids)
    row = RowConstraint(constraint, tokenizer, eos)
    rng = random.Random(seed)
    out: list[int] = []
    for _ in range(limit):
        mask = allocate_masks(1, row.words * 32)
        row.fill(mask, 0)
        allowed = np.nonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))[0]
        token = int(rng.choice(allowed))
        if token in eos and row.matcher.is_accepting():
            return tokenizer.decode(out)
        row.advance([token])
        out.append(token)
    return None


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_drawn_call_reads_back_and_validates(case, tmp_path):
    fmt = CASES[case]
    tokenizer = tokenizer_for(tmp_path, fmt)
    chat = ChatFormat(parser_table()[fmt.parser], "test", None, fmt.template)
    parser = chat.tool_parser
    schema = RICH["function"]["parameters"]
    finished = 0
    for forced in ("", parser.opening("rich.v2", chat.tools_template)):
        plan = ToolPlan([RICH], True, forced, True)
        grammar = tool_call_grammar(plan, chat, tokenizer)
        for seed in range(6):
            text = draw(tokenizer, grammar, seed)
            if text is None:  # a long free string: ran out of draws
                continue
            finished += 1
            reader = output_parser(plan, chat, in_reasoning=False)
            events = reader.feed(text) + reader.finish()
            assert len(events) == 1 and isinstance(events[0], ToolCallFound), (case, text)
            call = events[0].call
            assert call.name == "rich.v2" and valid(call.arguments, schema), (case, text)
    assert finished >= 6


def grammar_for(
    case: str, parameters: dict, tmp_path: Path, name: str = "f", *, named: bool = False
) -> str | None:
    fmt = CASES[case]
    chat = ChatFormat(parser_table()[fmt.parser], "test", None, fmt.template)
    tool = {"type": "function", "function": {"name": name, "parameters": parameters}}
    forced = chat.tool_parser.opening(name, chat.tools_template) if named else ""
    return tool_call_grammar(ToolPlan([tool], True, forced, True), chat)


def one(schema: dict) -> dict:
    return {"type": "object", "properties": {"p": schema}, "required": ["p"]}


@pytest.mark.parametrize("case", ["qwen3_coder", "gemma4", "pythonic", "minicpm5"])
@pytest.mark.parametrize(
    ("schema", "words"),
    [
        ({"type": "string", "pattern": "^a+$"}, "pattern"),
        ({"type": "integer", "minimum": 3}, "minimum"),
        ({"anyOf": [{"type": "string"}, {"type": "integer"}]}, "anyOf"),
    ],
)
def test_text_formats_refuse_what_a_text_value_cannot_carry(case, schema, words, tmp_path):
    with pytest.raises(RequestError, match=f"{words}.*{case}"):
        grammar_for(case, one(schema), tmp_path)


@pytest.mark.parametrize("case", ["json_tools", "mistral", "mistral_list"])
def test_json_formats_leave_such_keywords_to_the_schema_compiler(case, tmp_path):
    grammar = grammar_for(case, one({"type": "string", "pattern": "^a+$"}), tmp_path)
    assert grammar is not None and "%json" in grammar and "pattern" in grammar


@pytest.mark.parametrize(
    ("case", "parameters", "name", "words"),
    [
        ("pythonic", {"type": "object", "properties": {"class": {}}}, "f", "'class'"),
        ("pythonic", one({"type": "string"}), "not-a-name", "'not-a-name'"),
        ("gemma4", one({"enum": ["a<tool_call|>"]}), "f", "<tool_call|>"),
        ("qwen3_coder", one({"enum": ["a</parameter>"]}), "f", "</parameter>"),
        ("minicpm5", one({"enum": ["a<b"]}), "f", "verbatim"),
        ("json_tools", one({"const": "x</tool_call>"}), "f", "</tool_call>"),
        ("mistral", one({"type": "string"}), "f g", "'f g'"),
    ],
)
@pytest.mark.parametrize("named", [False, True], ids=["required", "named"])
def test_values_and_names_a_format_cannot_write_are_refused(
    case, parameters, name, words, named, tmp_path
):
    with pytest.raises(RequestError, match=words):
        grammar_for(case, parameters, tmp_path, name, named=named)


def test_a_format_without_a_grammar_is_refused(tmp_path):
    fmt = FORMATS["json_tools"]
    chat = ChatFormat(parser_table()["json_tools"], "test", None, fmt.template)
    chat = dataclasses.replace(
        chat, tool_parser=dataclasses.replace(chat.tool_parser, name="plugin_format")
    )
    tool = {"type": "function", "function": {"name": "f"}}
    with pytest.raises(CapabilityRefused, match="plugin_format"):
        tool_call_grammar(ToolPlan([tool], True, "", True), chat)
    assert tool_call_grammar(ToolPlan([tool], True, None, True), chat) is None  # auto


def test_a_marker_token_that_is_not_special_can_be_written(tmp_path):
    """llguidance takes an added ``<...>`` token for a special one unless told otherwise;
    the server tells it the tokenizer's own flags, so ``</tool_call>`` is text."""
    write_tokenizer(tmp_path, 512)
    add_tokens(tmp_path, ("<tool_call>", "</tool_call>", *BYTES))
    tokenizer = Tokenizer.from_dir(tmp_path)
    for seed in range(4):
        assert draw(tokenizer, 'start: "a</tool_call>b"\n', seed) == "a</tool_call>b"
        assert draw(tokenizer, 'start: "a" ("<tool_call>" | "</tool_call>")\n', seed) in (
            "a<tool_call>",
            "a</tool_call>",
        )


def test_a_forced_call_over_the_grammar_bound_is_a_400_naming_it(tmp_path):
    """The grammar grows with the tools; past the compile bound, a 400 that says what to do."""
    from types import SimpleNamespace

    from mlx_loom.serve.errors import HttpError
    from mlx_loom.serve.structured import request_constraint

    fmt = FORMATS["qwen3_coder"]
    tokenizer = tokenizer_for(tmp_path, fmt)
    chat = ChatFormat(parser_table()["qwen3_coder"], "test", None, fmt.template)
    params = RICH["function"]["parameters"]
    tools = [
        {"type": "function", "function": {"name": f"tool{i}", "parameters": params}}
        for i in range(100)
    ]
    request = SimpleNamespace(
        response_format=None, structured_outputs=None, json_schema=None, grammar=None
    )
    with pytest.raises(HttpError, match="name one function") as info:
        request_constraint(
            request, tokenizer, plan=ToolPlan(tools, True, "", True), chat_format=chat
        )
    assert info.value.status == 400 and info.value.param == "tool_choice"
    named = ToolPlan(tools, True, chat.tool_parser.opening("tool7", fmt.template), True)
    assert request_constraint(request, tokenizer, plan=named, chat_format=chat) is not None
