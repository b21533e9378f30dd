"""The Anthropic Messages API (``POST /v1/messages``) on the same engine as the OpenAI endpoints.

A request is checked against Anthropic's shape, translated into the
equivalent chat-completions request (``system`` becomes a system message,
``tool_use`` blocks become assistant ``tool_calls``, ``tool_result`` blocks
become ``tool`` messages, ``stop_sequences`` become ``stop``, ``tool_choice``
``any`` becomes ``required``, ``thinking`` becomes the template's
``enable_thinking``) and validated by the same code, so both APIs generate
the same tokens for the same conversation; a final assistant message is
continued (prefill, :mod:`mlx_loom.serve.prefill`), as Anthropic does. The answer is then shaped as
Anthropic's content blocks — ``thinking``, ``text``, ``tool_use`` — and, when
streamed, as its event sequence: ``message_start``, ``ping``, per block
``content_block_start`` / ``content_block_delta`` / ``content_block_stop``,
then ``message_delta`` (stop reason, output tokens) and ``message_stop``.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from . import schemas
from .errors import HttpError, rename_param
from .routine import ANTHROPIC_IGNORED, log_ignored

#: finish_reason -> Anthropic's stop_reason (a stop string is "stop_sequence").
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}

# Request fields named differently in the chat-completions request we build,
# so that an error found there names the field the client sent.
_RENAMED = {"stop": "stop_sequences"}


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _Block(BaseModel):
    """A content block; its other keys (``cache_control``, ``citations`` ...) are accepted."""

    model_config = ConfigDict(extra="allow", frozen=True)

    type: StrictStr


class AnthropicMessage(_Model):
    role: Literal["user", "assistant"]
    content: StrictStr | list[_Block]


class AnthropicTool(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    name: StrictStr = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: StrictStr | None = None
    input_schema: dict[str, Any]


class AnthropicToolChoice(_Model):
    type: Literal["auto", "any", "tool", "none"]
    name: StrictStr | None = None
    disable_parallel_tool_use: StrictBool | None = None


class Thinking(_Model):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: StrictInt | None = None


class MessagesRequest(_Model):
    """``POST /v1/messages``. ``max_tokens`` is required, as in Anthropic's API."""

    model: StrictStr | None = None
    max_tokens: StrictInt
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: StrictStr | list[_Block] | None = None
    stop_sequences: list[StrictStr] | None = None
    stream: StrictBool = False
    temperature: Any = None
    top_p: Any = None
    top_k: Any = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: Thinking | None = None
    # Accepted and ignored (mlx_loom.serve.routine.ANTHROPIC_IGNORED).
    metadata: dict[str, Any] | None = None
    service_tier: StrictStr | None = None


def _stop_reason(reason: str | None, stop: str | None) -> tuple[str, str | None]:
    """Anthropic's ``(stop_reason, stop_sequence)`` for a finish reason and the stop string hit."""
    if reason == "stop" and stop is not None:
        return "stop_sequence", stop
    return _STOP_REASONS.get(reason or "stop", "end_turn"), None


def _invalid(message: str, *, param: str, fix: str, code: str = "invalid_parameter") -> HttpError:
    return HttpError(400, message, fix=fix, param=param, code=code)


def _text_of(blocks: list[_Block] | str, where: str) -> str:
    """The text of a ``system`` or ``tool_result`` value: a string or text blocks."""
    if isinstance(blocks, str):
        return blocks
    texts = []
    for i, block in enumerate(blocks):
        text = getattr(block, "text", None)
        if block.type != "text" or not isinstance(text, str):
            raise _invalid(
                f"{where}[{i}] is a {block.type!r} block; only text blocks can be served here.",
                param=f"{where}[{i}]",
                fix='send text blocks only: {"type": "text", "text": "..."}',
                code="unsupported_content",
            )
        texts.append(text)
    return "".join(texts)


def _messages(request: MessagesRequest) -> list[dict[str, Any]]:
    """Anthropic turns as chat-completions messages (see the module docstring)."""
    out: list[dict[str, Any]] = []
    if request.system is not None:
        out.append({"role": "system", "content": _text_of(request.system, "system")})
    for i, message in enumerate(request.messages):
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
            continue
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        thinking: list[str] = []
        results: list[dict[str, Any]] = []
        for j, block in enumerate(message.content):
            where = f"messages[{i}].content[{j}]"
            data = block.model_dump()
            if block.type == "text" and isinstance(data.get("text"), str):
                texts.append(data["text"])
            elif block.type == "tool_use" and message.role == "assistant":
                if not isinstance(data.get("name"), str) or not isinstance(data.get("input"), dict):
                    raise _invalid(
                        f"{where} is a tool_use block without a name and an input object.",
                        param=where,
                        fix='send {"type": "tool_use", "id": ..., "name": ..., "input": {...}}',
                    )
                call_id = data.get("id") if isinstance(data.get("id"), str) else f"toolu_{j}"
                calls.append(
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": data["name"], "arguments": data["input"]},
                    }
                )
            elif block.type == "tool_result" and message.role == "user":
                content = data.get("content", "")
                if isinstance(content, list):
                    content = _text_of(
                        [_Block.model_validate(b) for b in content], where + ".content"
                    )
                if not isinstance(content, str):
                    raise _invalid(
                        f"{where}.content must be a string or a list of text blocks.",
                        param=where + ".content",
                        fix="send the tool's result as text",
                    )
                results.append(
                    {"role": "tool", "tool_call_id": data.get("tool_use_id"), "content": content}
                )
            elif block.type == "thinking" and message.role == "assistant":
                if isinstance(data.get("thinking"), str):
                    thinking.append(data["thinking"])
            elif block.type == "redacted_thinking":
                continue  # opaque to anyone but its issuer
            else:
                raise _invalid(
                    f"{where} is a {block.type!r} block in a {message.role} message; this server "
                    "serves text, thinking, tool_use and tool_result blocks.",
                    param=where,
                    fix="send text blocks (and tool blocks where they belong)",
                    code="unsupported_content",
                )
        out.extend(results)
        if message.role == "assistant":
            turn: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
            if calls:
                turn["tool_calls"] = calls
            if thinking:
                turn["reasoning_content"] = "".join(thinking)
            out.append(turn)
        elif texts or not results:
            out.append({"role": "user", "content": "".join(texts)})
    return out


def to_chat_body(body: Any) -> dict[str, Any]:
    """Check an Anthropic request and translate it into a chat-completions body."""
    request = schemas.parse_request(MessagesRequest, body)
    log_ignored(request, ANTHROPIC_IGNORED, "/v1/messages")
    chat: dict[str, Any] = {
        "messages": _messages(request),
        "max_tokens": request.max_tokens,
        "stream": request.stream,
    }
    if request.model is not None:
        chat["model"] = request.model
    for name in ("temperature", "top_p", "top_k"):
        if getattr(request, name) is not None:
            chat[name] = getattr(request, name)
    if request.stop_sequences:
        chat["stop"] = list(request.stop_sequences)
    if request.tools:
        chat["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    **({"description": t.description} if t.description else {}),
                    "parameters": t.input_schema,
                },
            }
            for t in request.tools
        ]
    choice = request.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if choice.name is None:
                raise _invalid(
                    'tool_choice {"type": "tool"} names no tool.',
                    param="tool_choice.name",
                    fix='send {"type": "tool", "name": "<one of the tools>"}',
                )
            chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        if choice.disable_parallel_tool_use:
            chat["parallel_tool_calls"] = False
    if request.thinking is not None and request.thinking.type != "adaptive":
        chat["chat_template_kwargs"] = {"enable_thinking": request.thinking.type == "enabled"}
    return chat


def renamed(err: HttpError) -> HttpError:
    """An error found in the translated request, naming the field the client sent."""
    return rename_param(err, _RENAMED)


class MessageShaper:
    """Builds one Anthropic message from the chat deltas of a choice, streamed or whole."""

    def __init__(self, model: str) -> None:
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.model = model
        self.blocks: list[dict[str, Any]] = []
        self._open: str | None = None  # the type of the block being streamed, if any

    def start(self, input_tokens: int, cached: int) -> list[tuple[str, dict[str, Any]]]:
        message = self._message(None, None, input_tokens, cached, 0)
        return [
            ("message_start", {"type": "message_start", "message": message}),
            ("ping", {"type": "ping"}),
        ]

    def deltas(self, deltas: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
        """Stream events for chat deltas (``content``, ``reasoning_content``, ``tool_calls``)."""
        events: list[tuple[str, dict[str, Any]]] = []
        for delta in deltas:
            if "content" in delta and delta["content"]:
                events += self._into("text", {"type": "text", "text": ""})
                self.blocks[-1]["text"] += delta["content"]
                events.append(self._delta({"type": "text_delta", "text": delta["content"]}))
            elif "reasoning_content" in delta:
                events += self._into(
                    "thinking", {"type": "thinking", "thinking": "", "signature": ""}
                )
                self.blocks[-1]["thinking"] += delta["reasoning_content"]
                events.append(
                    self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]})
                )
            elif "tool_calls" in delta:
                call = delta["tool_calls"][0]
                if "id" in call:  # a call's head: its own block
                    block = {
                        "type": "tool_use",
                        "id": call["id"],
                        "name": call["function"]["name"],
                        "input": {},
                    }
                    events += self._close()
                    events += self._into("tool_use", block)
                else:  # its arguments, which end the block
                    arguments = call["function"]["arguments"]
                    self.blocks[-1]["input"] = json.loads(arguments)
                    events.append(
                        self._delta({"type": "input_json_delta", "partial_json": arguments})
                    )
                    events += self._close()
        return events

    def finish(
        self, reason: str | None, stop: str | None, output_tokens: int
    ) -> list[tuple[str, dict[str, Any]]]:
        events = self._close()
        stop_reason, stop = _stop_reason(reason, stop)
        events.append(
            (
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop_reason, "stop_sequence": stop},
                    "usage": {"output_tokens": output_tokens},
                },
            )
        )
        events.append(("message_stop", {"type": "message_stop"}))
        return events

    def message(
        self, reason: str | None, stop: str | None, input_tokens: int, cached: int, output: int
    ) -> dict[str, Any]:
        """The whole (non-streamed) message."""
        stop_reason, stop = _stop_reason(reason, stop)
        return self._message(stop_reason, stop, input_tokens, cached, output)

    # --- helpers --------------------------------------------------------------------

    def _message(
        self, stop_reason: str | None, stop: str | None, input_tokens: int, cached: int, output: int
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [dict(b) for b in self.blocks] if stop_reason is not None else [],
            "stop_reason": stop_reason,
            "stop_sequence": stop,
            "usage": {
                # Anthropic counts tokens read from a cache apart from the others.
                "input_tokens": input_tokens - cached,
                "cache_read_input_tokens": cached,
                "cache_creation_input_tokens": 0,
                "output_tokens": output,
            },
        }

    def _into(self, kind: str, block: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        if self._open == kind and kind != "tool_use":
            return []
        events = self._close()
        self.blocks.append(block)
        self._open = kind
        start = {
            "type": "content_block_start",
            "index": len(self.blocks) - 1,
            "content_block": dict(block),
        }
        return [*events, ("content_block_start", start)]

    def _delta(self, delta: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        return (
            "content_block_delta",
            {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta},
        )

    def _close(self) -> list[tuple[str, dict[str, Any]]]:
        if self._open is None:
            return []
        self._open = None
        return [
            ("content_block_stop", {"type": "content_block_stop", "index": len(self.blocks) - 1})
        ]
