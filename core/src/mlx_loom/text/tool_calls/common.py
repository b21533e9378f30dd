"""Helpers the format parsers share: bounded JSON reading and short excerpts for messages."""

from __future__ import annotations

import json
from typing import Any

from .base import MalformedToolCall

#: How much of an offending value a message quotes.
SNIPPET_CHARS = 80


def snippet(value: Any) -> str:
    """A short ``repr`` of ``value`` for an error message."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    text = repr(text) if isinstance(value, str) else text
    return text if len(text) <= SNIPPET_CHARS else text[: SNIPPET_CHARS - 3] + "..."


def load_json(text: str, *, what: str) -> Any:
    """``json.loads`` whose failures (including nesting too deep) are :class:`MalformedToolCall`."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise MalformedToolCall(f"{what} is not valid JSON ({exc.msg} at char {exc.pos})") from None
    except RecursionError:
        raise MalformedToolCall(f"{what} is nested too deeply to read") from None
