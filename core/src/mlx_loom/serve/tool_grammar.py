"""Grammars for forced tool calls: the model's own call format, arguments valid by schema.

With ``tool_choice: "required"`` or a named function the prompt already
ends with the format's start marker (and, for a name, the opening of the
call: :func:`mlx_loom.serve.tools.prompt_suffix`). The grammar here is the
rest of the call, in the format the model was trained on, with the arguments
held to the tool's ``parameters`` schema — so the call the server parses
always validates. One call per reply.

Formats with a grammar: ``json_tools`` (Hermes, Qwen) — the call is JSON,
checked by llguidance's JSON-schema compiler; ``minicpm5`` — XML parameters
whose text must read as the declared type (string, with its
``minLength``/``maxLength``; integer, number, boolean, an ``enum``; object
and array values as JSON). A schema
feature the XML value grammar cannot enforce (a string ``pattern``, a
number's bounds) is refused, never loosened. Other formats get the opening
alone (the model writes the arguments unconstrained), as documented.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import CapabilityRefused, RequestError
from ..text import Tokenizer
from .tools import ChatFormat, ToolPlan

#: Compact JSON inside a call (``%json`` in a Lark grammar): free whitespace
#: lets a weak model pad forever.
_COMPACT = {"whitespace_flexible": False}


def _lit(text: str) -> str:
    """A Lark string literal for ``text``."""
    return json.dumps(text, ensure_ascii=False)


def _json_rule(schema: Mapping[str, Any]) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": _COMPACT}, ensure_ascii=False)


def _parameters(tool: Mapping[str, Any]) -> dict[str, Any]:
    params = tool["function"].get("parameters")
    return dict(params) if isinstance(params, Mapping) else {"type": "object"}


# --- json_tools: <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call> -------------


def _json_tools(tools: dict[str, dict[str, Any]], named: str | None) -> str:
    end = _lit("}\n</tool_call>")
    if named is not None:  # the prompt ends with '\n{"name": "f", "arguments": '
        return f"start: args {end}\nargs: {_json_rule(tools[named])}\n"
    rules = []
    for i, (name, params) in enumerate(tools.items()):
        call = {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": params},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        rules.append(f"c{i}: {_json_rule(call)}")
    alts = " | ".join(f"c{i}" for i in range(len(tools)))
    return f'start: "\\n" call {_lit(chr(10) + "</tool_call>")}\ncall: {alts}\n' + "\n".join(
        rules
    )


# --- minicpm5: <function name="f"><param name="p">value</param></function> -----------------

_XML_TEXT = r"/[^<&\n]*/"
_INTEGER = r"/-?(0|[1-9][0-9]{0,17})/"
_NUMBER = r"/-?(0|[1-9][0-9]{0,17})(\.[0-9]{1,17})?([eE][-+]?[0-9]{1,3})?/"
#: Keywords that only describe a value (nothing to enforce).
_DESCRIPTIVE = {"type", "description", "title", "default", "examples", "$comment"}


def _xml_value(tool: str, param: str, schema: Any) -> str:
    """A Lark expression for one XML parameter's text, or a refusal naming what cannot be held."""
    where = f"tool {tool!r}, parameter {param!r}"
    if not isinstance(schema, Mapping):
        return _XML_TEXT
    kind = schema.get("type")
    if "enum" in schema:
        members = schema["enum"]
        if not isinstance(members, list) or not members:
            raise RequestError(f"{where}: enum must be a non-empty list.", fix="Fix the schema.")
        texts = [m if isinstance(m, str) else json.dumps(m) for m in members]
        if any(not t or any(c in t for c in "<&\n") for t in texts):
            raise RequestError(
                f"{where}: an enum value holds '<', '&', a newline or nothing, which this "
                "model's XML call format cannot carry verbatim.",
                fix="Use plain enum values, or tool_choice 'auto'.",
            )
        return "(" + " | ".join(_lit(t) for t in texts) + ")"
    if kind in ("object", "array"):
        return _json_rule(schema)
    lengths = {"minLength", "maxLength"} if kind in (None, "string") else set()
    extra = sorted(set(schema) - _DESCRIPTIVE - lengths)
    if extra:
        raise RequestError(
            f"{where}: the keyword(s) {extra} cannot be enforced in this model's XML tool-call "
            "format (parameter values are plain text).",
            fix="Drop those keywords from the tool's parameters, or use tool_choice 'auto'.",
        )
    if kind == "integer":
        return _INTEGER
    if kind == "number":
        return _NUMBER
    if kind == "boolean":
        return '("true" | "false")'
    if kind in (None, "string"):
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        if not all(isinstance(n, int) and 0 <= n <= 10_000 for n in (low, high or 0)):
            raise RequestError(
                f"{where}: minLength/maxLength must be integers from 0 to 10000.",
                fix="Fix the schema.",
            )
        if low == 0 and high is None:
            return _XML_TEXT
        return "/[^<&\\n]{" + f"{low},{'' if high is None else high}" + "}/"
    raise RequestError(
        f"{where}: type {kind!r} cannot be enforced in this model's XML tool-call format.",
        fix="Declare a single type (string, integer, number, boolean, object or array).",
    )


def _xml_params(tool: str, schema: Mapping[str, Any]) -> str:
    props = schema.get("properties") or {}
    if not isinstance(props, Mapping):
        raise RequestError(f"tool {tool!r}: properties must be an object.", fix="Fix the schema.")
    required = schema.get("required") or []
    unknown = [r for r in required if r not in props]
    if unknown:
        raise RequestError(
            f"tool {tool!r}: required parameter(s) {unknown} are not in properties.",
            fix="Declare every required parameter under properties.",
        )
    parts = []
    for name, sub in props.items():
        if any(c in name for c in '"<>&\n'):
            raise RequestError(
                f"tool {tool!r}: parameter name {name!r} cannot be written in an XML attribute.",
                fix="Rename the parameter.",
            )
        part = f'{_lit(f"<param name={chr(34)}{name}{chr(34)}>")} {_xml_value(tool, name, sub)} '
        part += _lit("</param>")
        parts.append(f"({part})" if name in required else f"({part})?")
    return " ".join(parts) if parts else '""'


def _minicpm5(tools: dict[str, dict[str, Any]], named: str | None) -> str:
    end = _lit("</function>")
    if named is not None:  # the prompt ends with '<function name="f">'
        return f"start: {_xml_params(named, tools[named])} {end}\n"
    alts = [
        f'({_lit(json.dumps(name) + ">")} {_xml_params(name, params)})'
        for name, params in tools.items()
    ]
    return f"start: ({' | '.join(alts)}) {end}\n"


_BUILDERS: dict[str, Callable[[dict[str, dict[str, Any]], str | None], str]] = {
    "json_tools": _json_tools,
    "minicpm5": _minicpm5,
}

#: The fixed text each format's calls are made of (checked to be writable).
_LITERALS: dict[str, tuple[str, ...]] = {
    "json_tools": ('{"name":', '"arguments":', "}\n</tool_call>"),
    "minicpm5": ('<param name="', '">', "</param>", "</function>"),
}


def _check_writable(tokenizer: Tokenizer, fmt: str, tools: dict[str, dict[str, Any]]) -> None:
    """Refuse a format whose text this tokenizer cannot write (it drops characters it
    has no token for): no sampled call could ever follow the grammar."""
    texts = [*_LITERALS[fmt], *tools]
    for schema in tools.values():
        props = schema.get("properties")
        texts += list(props) if isinstance(props, Mapping) else []
    for text in texts:
        if tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) != text:
            raise CapabilityRefused(
                f"This model's tokenizer cannot write {text!r}, part of a {fmt} tool call, so "
                "a forced call cannot be held to the tool's schema.",
                fix='send tool_choice "auto", or serve a model whose tokenizer covers the '
                "format's characters",
            )


def tool_call_grammar(
    plan: ToolPlan, fmt: ChatFormat, tokenizer: Tokenizer | None = None
) -> str | None:
    """The Lark grammar of a forced call's remaining text (``None``: no grammar for
    this format, the opening alone forces the call). With ``tokenizer``, a format it
    cannot write is refused."""
    parser = fmt.tool_parser
    if plan.forced is None or parser is None or not plan.tools:
        return None
    build = _BUILDERS.get(parser.name)
    if build is None:
        return None
    tools = {t["function"]["name"]: _parameters(t) for t in plan.tools}
    if tokenizer is not None:
        _check_writable(tokenizer, parser.name, tools)
    named = None
    if plan.forced:
        named = next(
            (n for n in tools if parser.opening(n, fmt.tools_template) == plan.forced), None
        )
        if named is None:
            return None
    return build(tools, named)
