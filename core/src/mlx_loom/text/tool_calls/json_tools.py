"""JSON in tags (Hermes, Qwen2.5, Qwen3, Qwen3-Next).

``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

The body is one JSON object (some fine-tunes write a list of them). Arguments
may arrive as an object or as a JSON-encoded string, and a few models spell
the key ``parameters``; all three are read.
"""

from __future__ import annotations

import json
from typing import Any

from .base import MalformedToolCall, ToolCall, ToolParser
from .common import load_json, snippet


def parse(text: str) -> list[ToolCall]:
    payload = load_json(text.strip(), what="the tool call")
    items = payload if isinstance(payload, list) else [payload]
    if not items:
        raise MalformedToolCall("the tool call is an empty JSON list")
    return [_call(item) for item in items]


def _call(item: Any) -> ToolCall:
    if not isinstance(item, dict):
        raise MalformedToolCall(f"expected a JSON object with 'name', found {snippet(item)}")
    name = item.get("name")
    if not isinstance(name, str) or not name.strip():
        raise MalformedToolCall(f"the call has no function name: {snippet(item)}")
    arguments = item.get("arguments", item.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = load_json(arguments, what=f"the arguments of {name!r}") if arguments else {}
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise MalformedToolCall(
            f"the arguments of {name!r} are a JSON {type(arguments).__name__}, not an object"
        )
    return ToolCall(name=name.strip(), arguments=arguments)


def opening(name: str, template: str) -> str:
    return '\n{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": '


PARSER = ToolParser(
    name="json_tools",
    start="<tool_call>",
    end="</tool_call>",
    parse=parse,
    template_markers=(("<tool_call>", "tool_call.name"), ("<tool_call>", "tool_call['name']")),
    opening=opening,
    description='<tool_call>{"name": ..., "arguments": {...}}</tool_call> (Hermes, Qwen3)',
)
