"""Mistral: ``[TOOL_CALLS]`` followed by the calls, with no closing marker.

Two spellings exist, and both are read:

* older tokenizers: a JSON list,
  ``[TOOL_CALLS][{"name": "f", "arguments": {...}, "id": "a1b2c3d4e"}]``;
* newer ones: ``[TOOL_CALLS]f[ARGS]{...}``, optionally ``f[CALL_ID]a1b2c3d4e[ARGS]{...}``,
  repeated (each call after the first is introduced by ``[TOOL_CALLS]`` again).

Because there is no end marker, a call runs to the end of the generation.
"""

from __future__ import annotations

import json
import re
from typing import Any

from .base import MalformedToolCall, ToolCall, ToolParser
from .common import snippet

START = "[TOOL_CALLS]"
_HEADER = re.compile(r"\s*([\w.\-]+)\s*(?:\[CALL_ID\]\s*([\w\-]+)\s*)?\[ARGS\]\s*")
_DECODER = json.JSONDecoder()


def parse(text: str) -> list[ToolCall]:
    body = text.strip()
    if body.startswith("["):
        return _json_list(body)
    calls: list[ToolCall] = []
    for part in body.split(START):
        if part.strip():
            calls.append(_header_call(part))
    if not calls:
        raise MalformedToolCall("[TOOL_CALLS] is followed by no call")
    return calls


def _json_list(body: str) -> list[ToolCall]:
    try:
        payload, end = _DECODER.raw_decode(body)
    except json.JSONDecodeError as exc:
        raise MalformedToolCall(f"the call list is not valid JSON ({exc.msg})") from None
    except RecursionError:
        raise MalformedToolCall("the call list is nested too deeply to read") from None
    if body[end:].strip():
        raise MalformedToolCall(f"unexpected text after the call list: {snippet(body[end:])}")
    if not isinstance(payload, list) or not payload:
        raise MalformedToolCall("[TOOL_CALLS] must be followed by a non-empty JSON list")
    return [_json_call(item) for item in payload]


def _json_call(item: Any) -> ToolCall:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        raise MalformedToolCall(
            f"expected {{'name': ..., 'arguments': ...}}, found {snippet(item)}"
        )
    arguments = item.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):
            raise MalformedToolCall(f"the arguments of {item['name']!r} are not JSON") from None
    if not isinstance(arguments, dict):
        raise MalformedToolCall(f"the arguments of {item['name']!r} are not a JSON object")
    call_id = item.get("id")
    return ToolCall(
        name=item["name"], arguments=arguments, id=call_id if isinstance(call_id, str) else None
    )


def _header_call(part: str) -> ToolCall:
    header = _HEADER.match(part)
    if header is None:
        raise MalformedToolCall(f"expected NAME[ARGS]{{...}}, found {snippet(part.strip())}")
    name = header.group(1)
    try:
        arguments, end = _DECODER.raw_decode(part, header.end())
    except json.JSONDecodeError as exc:
        raise MalformedToolCall(
            f"the arguments of {name!r} are not valid JSON ({exc.msg})"
        ) from None
    except RecursionError:
        raise MalformedToolCall(f"the arguments of {name!r} are nested too deeply") from None
    if not isinstance(arguments, dict):
        raise MalformedToolCall(f"the arguments of {name!r} are not a JSON object")
    if part[end:].strip():
        raise MalformedToolCall(
            f"unexpected text after the arguments of {name!r}: {snippet(part[end:].strip())}"
        )
    return ToolCall(name=name, arguments=arguments, id=header.group(2))


def opening(name: str, template: str) -> str:
    if "[ARGS]" in template:
        return f"{name}[ARGS]"
    return '[{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": '


PARSER = ToolParser(
    name="mistral",
    start=START,
    end="",
    parse=parse,
    template_markers=((START,),),
    opening=opening,
    description="[TOOL_CALLS]NAME[ARGS]{...} or [TOOL_CALLS][{...}] (Mistral; runs to the end)",
)
