"""Gemma 4: ``<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>``.

Arguments are an object in Gemma's own notation: bare keys, strings between
``<|"|>`` delimiters (so they need no escaping), and bare numbers, booleans
and ``null``; objects and lists nest. One block may hold several calls. The
reader below is a small recursive-descent parser with a depth bound, so a
runaway generation cannot exhaust the stack.
"""

from __future__ import annotations

import json
import re
from typing import Any

from .base import MalformedToolCall, ToolCall, ToolParser
from .common import snippet

QUOTE = '<|"|>'
MAX_DEPTH = 64

_NAME = re.compile(r"call:([\w.\-]+)")
_BARE_KEY = re.compile(r"[^\s:{}\[\],<\"]+")
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][-+]?\d+)?")
_LITERALS = {"true": True, "false": False, "null": None}


class _Reader:
    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def fail(self, what: str) -> MalformedToolCall:
        return MalformedToolCall(f"{what} at char {self.pos}: {snippet(self.text[self.pos :])}")

    def space(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1

    def peek(self, token: str) -> bool:
        return self.text.startswith(token, self.pos)

    def expect(self, token: str) -> None:
        self.space()
        if not self.peek(token):
            raise self.fail(f"expected {token!r}")
        self.pos += len(token)

    def calls(self) -> list[ToolCall]:
        calls = []
        self.space()
        while self.pos < len(self.text):
            match = _NAME.match(self.text, self.pos)
            if match is None:
                raise self.fail("expected call:NAME{...}")
            self.pos = match.end()
            self.space()
            if not self.peek("{"):
                raise self.fail(f"expected '{{' after call:{match.group(1)}")
            calls.append(ToolCall(name=match.group(1), arguments=self.object(0)))
            self.space()
        if not calls:
            raise MalformedToolCall("the tool call holds no call:NAME{...}")
        return calls

    def object(self, depth: int) -> dict[str, Any]:
        if depth > MAX_DEPTH:
            raise self.fail(f"arguments nested deeper than {MAX_DEPTH}")
        self.expect("{")
        out: dict[str, Any] = {}
        self.space()
        while not self.peek("}"):
            key = self.key()
            self.expect(":")
            out[key] = self.value(depth)
            self.space()
            if self.peek(","):
                self.pos += 1
                self.space()
            elif not self.peek("}"):
                raise self.fail("expected ',' or '}'")
        self.pos += 1
        return out

    def array(self, depth: int) -> list[Any]:
        if depth > MAX_DEPTH:
            raise self.fail(f"arguments nested deeper than {MAX_DEPTH}")
        self.expect("[")
        out: list[Any] = []
        self.space()
        while not self.peek("]"):
            out.append(self.value(depth))
            self.space()
            if self.peek(","):
                self.pos += 1
                self.space()
            elif not self.peek("]"):
                raise self.fail("expected ',' or ']'")
        self.pos += 1
        return out

    def key(self) -> str:
        self.space()
        if self.peek(QUOTE) or self.peek('"'):
            return self.string()
        match = _BARE_KEY.match(self.text, self.pos)
        if match is None:
            raise self.fail("expected a key")
        self.pos = match.end()
        return match.group(0)

    def string(self) -> str:
        if self.peek(QUOTE):
            end = self.text.find(QUOTE, self.pos + len(QUOTE))
            if end < 0:
                raise self.fail('unterminated <|"|> string')
            value = self.text[self.pos + len(QUOTE) : end]
            self.pos = end + len(QUOTE)
            return value
        try:  # a JSON string, which some generations write instead
            scan = json.decoder.scanstring  # type: ignore[attr-defined]  # missing from typeshed
            value, self.pos = scan(self.text, self.pos + 1)
        except json.JSONDecodeError:
            raise self.fail("unterminated string") from None
        return value

    def value(self, depth: int) -> Any:
        self.space()
        if self.peek("{"):
            return self.object(depth + 1)
        if self.peek("["):
            return self.array(depth + 1)
        if self.peek(QUOTE) or self.peek('"'):
            return self.string()
        end = self.pos
        while end < len(self.text) and self.text[end] not in ",}]":
            end += 1
        bare = self.text[self.pos : end].strip()
        if not bare:
            raise self.fail("expected a value")
        self.pos = end
        if bare in _LITERALS:
            return _LITERALS[bare]
        if _NUMBER.fullmatch(bare):
            number = float(bare)
            return int(bare) if re.fullmatch(r"-?\d+", bare) else number
        return bare


def parse(text: str) -> list[ToolCall]:
    return _Reader(text).calls()


def opening(name: str, template: str) -> str:
    return f"call:{name}{{"


PARSER = ToolParser(
    name="gemma4",
    start="<|tool_call>",
    end="<tool_call|>",
    parse=parse,
    template_markers=(("<|tool_call>", "<tool_call|>"),),
    opening=opening,
    description='<|tool_call>call:NAME{key:<|"|>text<|"|>,n:1}<tool_call|> (Gemma 4)',
)
