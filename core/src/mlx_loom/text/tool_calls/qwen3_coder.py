"""Qwen3-Coder XML (also Qwen3.5): one function per ``<tool_call>`` block.

::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Every value is text (the template writes strings as they are and other
values as JSON); one newline after the opening tag and one before the closing
tag are layout, not value. Types come from the tool's schema afterwards.
"""

from __future__ import annotations

import re

from .base import MalformedToolCall, ToolCall, ToolParser
from .common import snippet

_FUNCTION = re.compile(r"<function=([^>\n]*)>(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)</parameter>", re.DOTALL)


def parse(text: str) -> list[ToolCall]:
    calls: list[ToolCall] = []
    pos = 0
    for match in _FUNCTION.finditer(text):
        _only_space(text[pos : match.start()], "before <function=...>")
        name = match.group(1).strip()
        if not name:
            raise MalformedToolCall("<function=> names no function")
        calls.append(ToolCall(name=name, arguments=_parameters(name, match.group(2))))
        pos = match.end()
    _only_space(text[pos:], "after the last </function>" if calls else "(no <function=...> block)")
    if not calls:
        raise MalformedToolCall("the tool call holds no <function=NAME>...</function> block")
    return calls


def _parameters(function: str, body: str) -> dict[str, str]:
    arguments: dict[str, str] = {}
    pos = 0
    for match in _PARAMETER.finditer(body):
        _only_space(body[pos : match.start()], f"between the parameters of {function!r}")
        name = match.group(1).strip()
        if not name:
            raise MalformedToolCall(f"a parameter of {function!r} has no name")
        value = match.group(2)
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        arguments[name] = value
        pos = match.end()
    _only_space(body[pos:], f"after the parameters of {function!r}")
    return arguments


def _only_space(text: str, where: str) -> None:
    if text.strip():
        raise MalformedToolCall(f"unexpected text {where}: {snippet(text.strip())}")


def opening(name: str, template: str) -> str:
    return f"\n<function={name}>\n"


PARSER = ToolParser(
    name="qwen3_coder",
    start="<tool_call>",
    end="</tool_call>",
    parse=parse,
    template_markers=(("<tool_call>\n<function=",), ("<tool_call>\\n<function=",)),
    opening=opening,
    description="<tool_call><function=NAME><parameter=P>value</parameter></function></tool_call> "
    "(Qwen3-Coder, Qwen3.5)",
)
