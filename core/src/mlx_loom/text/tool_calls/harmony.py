"""Harmony (gpt-oss): a message addressed to a function in the ``commentary`` channel.

A call is a message whose recipient is ``functions.NAME``; its body is the
JSON arguments, and ``<|call|>`` ends it. The recipient may stand in the
channel header (how the models write it) or in the role header (how the
chat template renders earlier calls)::

    <|channel|>commentary to=functions.f <|constrain|>json<|message|>{"city": "Paris"}<|call|>
    <|start|>assistant to=functions.f<|channel|>commentary json<|message|>{...}<|call|>

The message headers around it (``<|start|>assistant``, ``<|channel|>commentary``,
``<|message|>``, ``<|end|>``) are layout that Harmony's reasoning format
(:data:`mlx_loom.text.reasoning.HARMONY`) drops from the answer, so what
reaches this parser after the start marker ``" to=functions."`` is
``NAME``, an optional channel, an optional content type, ``<|message|>`` and
the arguments. ``<|call|>`` is usually an end-of-sequence token and then
never appears in the text: the call runs to the end of the generation.

Recipients other than ``functions.*`` (gpt-oss's built-in ``browser`` and
``python`` tools) are not function calls and stay text.
"""

from __future__ import annotations

import re

from .base import MalformedToolCall, ToolCall, ToolParser
from .common import load_json, snippet

START = " to=functions."
END = "<|call|>"
_HEAD = re.compile(
    r"\s*(?P<name>[^\s<]+)\s*"
    r"(?:<\|channel\|>\s*commentary\s*)?"
    r"(?:<\|constrain\|>\s*)?(?:json\s*)?"
    r"<\|message\|>"
)


def parse(text: str) -> list[ToolCall]:
    head = _HEAD.match(text)
    if head is None:
        raise MalformedToolCall(
            f"expected NAME <|constrain|>json<|message|>{{...}}, found {snippet(text.strip())}"
        )
    name = head.group("name")
    body = text[head.end() :].strip()
    arguments = load_json(body, what=f"the arguments of {name!r}") if body else {}
    if not isinstance(arguments, dict):
        raise MalformedToolCall(
            f"the arguments of {name!r} are a JSON {type(arguments).__name__}, not an object"
        )
    return [ToolCall(name=name, arguments=arguments)]


def opening(name: str, template: str) -> str:
    """After ``<|start|>assistant`` and the start marker: the role-header form of a call."""
    return f"{name}<|channel|>commentary json<|message|>"


PARSER = ToolParser(
    name="harmony",
    start=START,
    end=END,
    parse=parse,
    template_markers=(("<|channel|>", "<|call|>", "functions."),),
    opening=opening,
    description="<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}"
    "<|call|> (gpt-oss Harmony)",
)
