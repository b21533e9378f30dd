"""Pythonic calls (LFM2 and others).

``<|tool_call_start|>[get_weather(city="Paris")]<|tool_call_end|>``.

The body is a Python list of calls with keyword arguments only, read with
:mod:`ast` (never evaluated): a dotted function name and literal values.
Templates render nested values as JSON, so ``true``/``false``/``null`` are
read as the JSON literals they are.
"""

from __future__ import annotations

import ast
import math
from typing import Any

from .base import MalformedToolCall, ToolCall, ToolParser
from .common import snippet

#: Longer bodies are refused before parsing: ``ast.parse`` is not bounded in memory.
MAX_CHARS = 262144

_JSON_NAMES = {"true": True, "false": False, "null": None}


def parse(text: str) -> list[ToolCall]:
    body = text.strip()
    if len(body) > MAX_CHARS:
        raise MalformedToolCall(f"the tool call is {len(body)} characters; at most {MAX_CHARS}")
    if not body.startswith("["):
        body = f"[{body}]"
    try:
        tree = ast.parse(body, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise MalformedToolCall(f"not a Python list of calls ({type(exc).__name__})") from None
    if not isinstance(tree, ast.List) or not tree.elts:
        raise MalformedToolCall(f"expected a list of calls like [f(x=1)], found {snippet(body)}")
    return [_call(node) for node in tree.elts]


def _call(node: ast.expr) -> ToolCall:
    if not isinstance(node, ast.Call):
        raise MalformedToolCall(f"{snippet(ast.unparse(node))} is not a call")
    name = _dotted(node.func)
    if name is None:
        raise MalformedToolCall(f"{snippet(ast.unparse(node.func))} is not a function name")
    if node.args:
        raise MalformedToolCall(f"{name}() takes keyword arguments only")
    arguments: dict[str, Any] = {}
    for keyword in node.keywords:
        if keyword.arg is None:
            raise MalformedToolCall(f"{name}() has a **kwargs argument")
        arguments[keyword.arg] = _literal(keyword.value, name)
    return ToolCall(name=name, arguments=arguments)


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        parent = _dotted(node.value)
        return None if parent is None else f"{parent}.{node.attr}"
    return None


def _literal(node: ast.expr, function: str) -> Any:
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.Constant) and (
        node.value is None or isinstance(node.value, (str, bool, int, float))
    ):
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise MalformedToolCall(f"{function}() has a non-finite number")
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand, function)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(item, function) for item in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for key, value in zip(node.keys, node.values, strict=True):
            if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                raise MalformedToolCall(f"{function}() has a dict key that is not a string")
            out[key.value] = _literal(value, function)
        return out
    raise MalformedToolCall(f"{function}() has a non-literal argument {snippet(ast.unparse(node))}")


def opening(name: str, template: str) -> str:
    return f"[{name}("


PARSER = ToolParser(
    name="pythonic",
    start="<|tool_call_start|>",
    end="<|tool_call_end|>",
    parse=parse,
    template_markers=(("<|tool_call_start|>",), ("<|tool_list_start|>",)),
    opening=opening,
    description='<|tool_call_start|>[NAME(p="value")]<|tool_call_end|> (LFM2 and others)',
)
