"""Split a generation, as it streams, into answer text, reasoning text and tool calls.

:class:`OutputParser` is fed the text of each generated piece and returns
events in order: :class:`Content`, :class:`Reasoning` and
:class:`ToolCallFound`. It is incremental in the way a streaming client
needs:

* text that may be the beginning of a marker (``<tool_`` could become
  ``<tool_call>``) is held back until it is decided, so raw markup is never
  sent as content and then taken back;
* a tool call is held until its end marker arrives (or the generation ends,
  for formats without one), parsed, its arguments coerced to the types the
  tool's schema declares and checked to encode as strict JSON, and released
  as one event;
* text a format cannot read — a broken call, or one cut off by
  ``max_tokens`` — is released as content, markers included, and the log
  says why. A parser (or the coercion after it) that raises anything is
  treated the same way, so no model output can fail a request.

A reasoning format may also list *layout* markers (Harmony's message
headers, ``<|start|>assistant<|channel|>final<|message|>``): in the answer
they are dropped, as separators.

Whitespace that only separates a section from a marker (the newline after
``<think>``, the blank line between ``</think>`` and the answer, the newline
between two calls) is dropped; all other text is passed through unchanged,
so a generation without markers comes out exactly as generated.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .reasoning import ReasoningFormat
from .tool_calls import ToolCall, ToolParser, coerce_arguments, tool_schemas

log = logging.getLogger("mlx_loom.text")

CONTENT, REASONING, TOOL = "content", "reasoning", "tool"


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class Reasoning:
    text: str


@dataclass(frozen=True)
class ToolCallFound:
    call: ToolCall


Event = Content | Reasoning | ToolCallFound


class OutputParser:
    """One generation's splitter; see the module docstring.

    ``tool_parser`` ``None`` disables tool-call parsing (the markup is then
    content), ``reasoning`` ``None`` disables reasoning. ``in_reasoning``:
    the prompt left a thinking section open, so the output starts inside it.
    ``forced_call``: the prompt already opened a tool call (its start marker
    and this text after it), so the output starts inside that call.
    """

    def __init__(
        self,
        *,
        tool_parser: ToolParser | None = None,
        tools: Sequence[Any] | None = None,
        reasoning: ReasoningFormat | None = None,
        in_reasoning: bool = False,
        forced_call: str | None = None,
    ) -> None:
        if forced_call is not None and tool_parser is None:
            raise ValueError("forced_call needs a tool_parser")
        self._tool = tool_parser
        self._schemas = tool_schemas(tools)
        self._reasoning = reasoning
        # Markers that open a call or a thinking section are not layout, even
        # where a format lists a prefix of them.
        self._layout = frozenset(reasoning.layout if reasoning is not None else ()) - {
            tool_parser.start if tool_parser is not None else "",
            reasoning.start if reasoning is not None else "",
        }
        self._buffer = forced_call or ""
        self._scanned = 0  # how much of a call's text has been searched for its end marker
        if forced_call is not None:
            self._state = TOOL
        elif in_reasoning and reasoning is not None:
            self._state = REASONING
        else:
            self._state = CONTENT
        # True right after a marker: the section's leading whitespace is layout.
        self._fresh = self._state != CONTENT
        self._done = False
        #: Tool calls found so far.
        self.calls = 0

    def feed(self, text: str) -> list[Event]:
        """Events that ``text`` (the next piece of the generation) completes."""
        if self._done:
            raise RuntimeError("feed() after finish()")
        self._buffer += text
        return self._drain(final=False)

    def finish(self) -> list[Event]:
        """Events for everything still held back; the generation has ended."""
        if self._done:
            return []
        self._done = True
        return self._drain(final=True)

    # --- the state machine ----------------------------------------------------------

    def _markers(self) -> list[str]:
        if self._state == REASONING:
            assert self._reasoning is not None
            return [self._reasoning.end]
        markers = []
        if self._tool is not None:
            markers.append(self._tool.start)
        if self._reasoning is not None:
            markers.append(self._reasoning.start)
            markers.extend(self._reasoning.layout)
        return markers

    def _drain(self, *, final: bool) -> list[Event]:
        events: list[Event] = []
        while True:
            if self._state == TOOL:
                if not self._drain_call(events, final=final):
                    return events
                continue
            markers = self._markers()
            hit = _first(self._buffer, markers)
            if hit is not None:
                at, marker = hit
                self._emit(events, self._buffer[:at], before_marker=True)
                self._buffer = self._buffer[at + len(marker) :]
                self._enter(marker)
                continue
            if final:
                self._emit(events, self._buffer, before_marker=False)
                self._buffer = ""
                return events
            held = _held_suffix(self._buffer, markers)
            ready = self._buffer[: len(self._buffer) - held]
            # Trailing whitespace waits too: it is dropped if a marker follows.
            body = ready.rstrip()
            self._emit(events, body, before_marker=False)
            self._buffer = self._buffer[len(body) :]
            return events

    def _enter(self, marker: str) -> None:
        self._fresh = True
        if self._state == CONTENT and marker in self._layout:
            return  # a message header between sections: dropped, the answer goes on
        if self._tool is not None and marker == self._tool.start and self._state == CONTENT:
            self._state = TOOL
            self._scanned = 0
        elif self._state == CONTENT:
            self._state = REASONING
        else:
            self._state = CONTENT

    def _drain_call(self, events: list[Event], *, final: bool) -> bool:
        """Close the current call if its end has arrived; True when the state changed."""
        assert self._tool is not None
        end = self._tool.end
        if end:
            at = self._buffer.find(end, max(0, self._scanned - len(end) + 1))
            if at >= 0:
                self._fresh = self._close(events, self._buffer[:at], terminated=True)
                self._buffer = self._buffer[at + len(end) :]
                self._state = CONTENT
                return True
            self._scanned = len(self._buffer)
        if final:
            self._fresh = self._close(events, self._buffer, terminated=not end)
            self._buffer = ""
            self._state = CONTENT
            return True
        return False

    def _emit(self, events: list[Event], text: str, *, before_marker: bool) -> None:
        if before_marker:
            text = text.rstrip()
        if self._fresh:
            text = text.lstrip()
        if not text:
            return
        self._fresh = False
        events.append(Reasoning(text) if self._state == REASONING else Content(text))

    def _close(self, events: list[Event], text: str, *, terminated: bool) -> bool:
        """Parse one call's text into ``events``; True if it was read as calls.

        What cannot be read is appended as content, markers included.
        """
        tool = self._tool
        assert tool is not None
        try:
            calls = tool.parse(text)
            if not isinstance(calls, list) or not calls:
                raise TypeError(f"parse() returned {type(calls).__name__}, not a list of calls")
            found = []
            for call in calls:
                if not (
                    isinstance(call, ToolCall)
                    and isinstance(call.name, str)
                    and isinstance(call.arguments, dict)
                ):
                    raise TypeError(f"parse() returned {type(call).__name__}, not a ToolCall")
                # Coercion and the encoding the answer will need run inside the
                # guard too, so whatever the model wrote, it cannot fail the request.
                arguments = coerce_arguments(call.arguments, self._schemas.get(call.name))
                json.dumps(arguments, ensure_ascii=False, allow_nan=False)
                found.append(ToolCall(name=call.name, arguments=arguments, id=call.id))
        except Exception as exc:  # a broken call, or a plugin parser that raised anything
            if not terminated:
                why = f"the generation ended inside the call ({exc})"
            else:
                why = f"{type(exc).__name__}: {exc}"
            log.warning("tool call in the %s format was not readable: %s", tool.name, why)
            events.append(Content(tool.start + text + (tool.end if terminated else "")))
            return False
        self.calls += len(found)
        events.extend(ToolCallFound(call) for call in found)
        return True


def _first(text: str, markers: list[str]) -> tuple[int, str] | None:
    """The earliest marker in ``text`` (the longer one on a tie)."""
    best: tuple[int, str] | None = None
    for marker in markers:
        at = text.find(marker)
        if at < 0:
            continue
        if best is None or at < best[0] or (at == best[0] and len(marker) > len(best[1])):
            best = (at, marker)
    return best


def _held_suffix(text: str, markers: list[str]) -> int:
    """Length of the longest end of ``text`` that could still grow into a marker."""
    held = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), held, -1):
            if text.endswith(marker[:size]):
                held = size
                break
    return held
