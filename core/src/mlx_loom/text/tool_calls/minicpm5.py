"""MiniCPM5: ``<function name="get_weather"><param name="city">Paris</param></function>``.

There is no outer wrapper: each call is its own ``<function ...>`` block, so
parallel calls are consecutive blocks. A value holding ``<``, ``&`` or a
newline is wrapped in ``<![CDATA[...]]>`` by the template and read verbatim;
other values are trimmed. Every value is text; types come from the tool's
schema afterwards.
"""

from __future__ import annotations

import re

from .base import MalformedToolCall, ToolCall, ToolParser
from .common import snippet

_QUOTED = r"(?:\"([^\"]*)\"|'([^']*)'|([^\s\"'<>]+))"
_HEAD = re.compile(r"\s*" + _QUOTED + r"\s*>")
_PARAM = re.compile(r"<param\s+name\s*=\s*" + _QUOTED + r"\s*>(.*?)</param>", re.DOTALL)
_CDATA = re.compile(r"\s*<!\[CDATA\[(.*?)\]\]>\s*", re.DOTALL)


def _name(match: re.Match[str]) -> str:
    return next(g for g in match.groups()[:3] if g is not None).strip()


def parse(text: str) -> list[ToolCall]:
    # ``text`` is what follows the start marker ``<function name=``.
    head = _HEAD.match(text)
    if head is None:
        raise MalformedToolCall(f"expected a quoted function name and '>': {snippet(text)}")
    name = _name(head)
    if not name:
        raise MalformedToolCall("<function name=...> names no function")
    arguments: dict[str, str] = {}
    pos = head.end()
    for match in _PARAM.finditer(text, pos):
        if text[pos : match.start()].strip():
            raise MalformedToolCall(
                f"unexpected text between the params of {name!r}: "
                f"{snippet(text[pos : match.start()].strip())}"
            )
        raw = match.group(4)
        cdata = _CDATA.fullmatch(raw)
        arguments[_name(match)] = cdata.group(1) if cdata else raw.strip()
        pos = match.end()
    if text[pos:].strip():
        raise MalformedToolCall(
            f"unexpected text after the params of {name!r}: {snippet(text[pos:].strip())}"
        )
    return [ToolCall(name=name, arguments=arguments)]


def opening(name: str, template: str) -> str:
    return f'"{name}">'


PARSER = ToolParser(
    name="minicpm5",
    start="<function name=",
    end="</function>",
    parse=parse,
    template_markers=(('<function name="', '<param name="'),),
    opening=opening,
    description='<function name="NAME"><param name="P">value</param></function> (MiniCPM5)',
)
