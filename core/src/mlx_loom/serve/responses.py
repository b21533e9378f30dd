"""OpenAI's Responses API (``POST /v1/responses``) on the same engine as chat completions.

A request is checked against the Responses shape and translated into the
equivalent chat-completions request, which the chat path validates and
renders with the same chat template, so both APIs generate the same tokens
for the same conversation:

- ``instructions`` becomes the leading system message; ``input`` (a string,
  or a list of items) becomes the turns: ``message`` items (roles ``user``,
  ``assistant``, ``system``, ``developer`` — the last read as ``system``;
  system messages next to each other, ``instructions`` included, are joined
  into one turn, the one templates accept) with text parts;
  ``function_call`` items as the assistant's ``tool_calls`` (calls next to
  each other, and the assistant text just before them, form one turn);
  ``function_call_output`` items as ``tool`` messages, and
  ``reasoning`` items as the next assistant turn's ``reasoning_content``;
- ``tools`` (function tools only), ``tool_choice``, ``max_output_tokens``,
  ``temperature``, ``top_p``, ``parallel_tool_calls`` map one to one;
  ``text.format`` (``json_object``, ``json_schema``) becomes
  ``response_format``; ``reasoning.effort`` becomes the template's
  ``enable_thinking`` (``"none"`` off, any other effort on).

The answer is shaped as output items — ``reasoning`` (its text as
``reasoning_text`` content), ``message`` (``output_text``), ``function_call``
— and, when streamed, as the Responses event sequence (``response.created``,
``response.in_progress``, per item ``response.output_item.added`` / deltas /
``response.output_item.done``, then ``response.completed`` or
``response.incomplete``), every event numbered by ``sequence_number``.

Responses are not kept: ``store`` is accepted and answered with
``"store": false``, and ``previous_response_id`` is refused with a 400 that
says to send the whole conversation. A store would hold every conversation
of every client in server memory for an unbounded set of ids; resending the
conversation costs little here because the prefix cache reuses the prompt
the previous turn already computed.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from . import schemas
from .errors import HttpError, rename_param

log = logging.getLogger(__name__)

#: Fields a client library or agent sends routinely that carry no meaning for
#: this server; they are accepted and have no effect.
IGNORED_FIELDS = (
    "store",
    "metadata",
    "user",
    "service_tier",
    "prompt_cache_key",
    "safety_identifier",
    "include",
    "truncation",
    "background",
    "max_tool_calls",
    "prompt_cache_retention",
    "stream_options",
    "top_logprobs",
    "client_metadata",
)

# Request fields named differently in the chat-completions request we build,
# so that an error found there names the field the client sent.
_RENAMED = {
    "max_tokens": "max_output_tokens",
    "messages": "input",
    "response_format": "text.format",
    "chat_template_kwargs": "reasoning",
}


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TextFormat(BaseModel):
    """``text.format``: ``text``, ``json_object`` or ``json_schema`` (flat, unlike chat's)."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: StrictStr | None = None
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class TextOptions(_Model):
    format: TextFormat | None = None
    verbosity: StrictStr | None = None  # a hint for OpenAI's models; no effect here


class Reasoning(_Model):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: StrictStr | None = None  # no summaries are written; accepted
    generate_summary: StrictStr | None = None


class ResponsesRequest(_Model):
    """``POST /v1/responses``. Items in ``input`` and ``tools`` are checked by hand (below)."""

    model: StrictStr | None = None
    input: StrictStr | list[Any]
    instructions: StrictStr | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    max_output_tokens: StrictInt | None = None
    temperature: Any = None
    top_p: Any = None
    text: TextOptions | None = None
    reasoning: Reasoning | None = None
    stream: StrictBool = False
    previous_response_id: StrictStr | None = None
    conversation: Any = None
    # Accepted and ignored (IGNORED_FIELDS).
    store: StrictBool | None = None
    metadata: dict[str, Any] | None = None
    user: StrictStr | None = None
    service_tier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None
    safety_identifier: StrictStr | None = None
    include: list[StrictStr] | None = None
    truncation: StrictStr | None = None
    background: StrictBool | None = None
    max_tool_calls: StrictInt | None = None
    prompt_cache_retention: StrictStr | None = None
    stream_options: dict[str, Any] | None = None
    top_logprobs: StrictInt | None = None
    client_metadata: dict[str, Any] | None = None


def _invalid(message: str, *, param: str, fix: str, code: str = "invalid_parameter") -> HttpError:
    return HttpError(400, message, fix=fix, param=param, code=code)


def _short(value: Any) -> str:
    """A client's value as shown in an error: its repr, cut to a readable length."""
    shown = repr(value)
    return shown if len(shown) <= 60 else shown[:57] + "..."


def _text_parts(content: Any, where: str) -> str:
    """The text of a message's or a call output's ``content``: a string or text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _invalid(
            f"{where} must be a string or a list of text parts.",
            param=where,
            fix='send a string, or parts like {"type": "input_text", "text": "..."}',
        )
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        text = part.get("text") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(text, str):
            raise _invalid(
                f"{where}[{i}] is a {_short(kind)} part; only text parts can be served here.",
                param=f"{where}[{i}]",
                fix='send text parts only: {"type": "input_text", "text": "..."}',
                code="unsupported_content",
            )
        texts.append(text)
    return "".join(texts)


def _field(item: dict[str, Any], key: str, where: str, example: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise _invalid(
            f"{where} has no string {key!r}.",
            param=f"{where}.{key}",
            fix=f"send {example}",
        )
    return value


def _messages(request: ResponsesRequest) -> list[dict[str, Any]]:
    """``instructions`` and ``input`` as chat-completions messages (see the module docstring)."""
    out: list[dict[str, Any]] = []
    if request.instructions is not None:
        out.append({"role": "system", "content": request.instructions})
    if isinstance(request.input, str):
        out.append({"role": "user", "content": request.input})
        return out
    reasoning: list[str] = []  # reasoning items waiting for their assistant turn

    def assistant_turn() -> dict[str, Any]:
        """The assistant turn a call joins: the last turn when it is the assistant's."""
        if out and out[-1]["role"] == "assistant":
            return out[-1]
        turn: dict[str, Any] = {"role": "assistant", "content": ""}
        out.append(turn)
        return turn

    def take_reasoning(turn: dict[str, Any]) -> None:
        """Give the waiting reasoning to ``turn`` (joined once, at the end: linear time)."""
        if reasoning:
            thoughts.setdefault(id(turn), (turn, []))[1].extend(reasoning)
            reasoning.clear()

    thoughts: dict[int, tuple[dict[str, Any], list[str]]] = {}
    system_texts: dict[int, list[str]] = {}  # system turns that several items make
    for i, item in enumerate(request.input):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _invalid(
                f"{where} is a JSON {type(item).__name__}; input items are objects.",
                param=where,
                fix='send items like {"role": "user", "content": "..."}',
            )
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise _invalid(
                    f"{where}.role is {_short(role)}; expected user, assistant, system or "
                    "developer.",
                    param=f"{where}.role",
                    fix='send {"role": "user", "content": "..."}',
                )
            text = _text_parts(item.get("content"), f"{where}.content")
            if role == "assistant":
                turn: dict[str, Any] = {"role": "assistant", "content": text}
                take_reasoning(turn)
                out.append(turn)
            elif role == "user":
                out.append({"role": "user", "content": text})
            elif out and out[-1]["role"] == "system":
                # Templates take one system turn, first: instructions and the
                # developer messages that follow them are that turn.
                system_texts.setdefault(len(out) - 1, [out[-1]["content"]]).append(text)
            else:
                out.append({"role": "system", "content": text})
        elif kind == "function_call":
            example = '{"type": "function_call", "call_id": ..., "name": ..., "arguments": "{}"}'
            call = {
                "id": _field(item, "call_id", where, example),
                "type": "function",
                "function": {
                    "name": _field(item, "name", where, example),
                    "arguments": _field(item, "arguments", where, example),
                },
            }
            joined = assistant_turn()
            joined.setdefault("tool_calls", []).append(call)
            take_reasoning(joined)
        elif kind == "function_call_output":
            example = '{"type": "function_call_output", "call_id": ..., "output": "..."}'
            call_id = _field(item, "call_id", where, example)
            output = _text_parts(item.get("output"), f"{where}.output")
            out.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            parts = item.get("content") or []
            for part in parts if isinstance(parts, list) else []:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    reasoning.append(part["text"])
        else:
            raise _invalid(
                f"{where} is a {_short(kind)} item; this server serves message, function_call, "
                "function_call_output and reasoning items.",
                param=f"{where}.type",
                fix="send those item types only",
                code="unsupported_content",
            )
    for owner, texts in thoughts.values():
        owner["reasoning_content"] = "".join(texts)
    for index, texts in system_texts.items():
        out[index]["content"] = "\n\n".join(texts)
    return out


def _tools(tools: list[Any]) -> list[dict[str, Any]]:
    """Function tools as chat tools; any other tool type is a 400 naming it."""
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise _invalid(
                f"tools[{i}] is a {_short(kind)} tool; this server runs no built-in tools "
                "and serves function tools only.",
                param=f"tools[{i}].type",
                fix='describe it as {"type": "function", "name": ..., "parameters": {...}}',
                code="unsupported_tool",
            )
        assert isinstance(tool, dict)
        function: dict[str, Any] = {"name": tool.get("name")}
        for key in ("description", "parameters", "strict"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        extra = set(tool) - {"type", "name", "description", "parameters", "strict"}
        if extra:
            raise _invalid(
                f"tools[{i}] has unknown field(s) {_short(sorted(extra))}.",
                param=f"tools[{i}]",
                fix="send type, name, description, parameters and strict only",
                code="unknown_parameter",
            )
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice  # "auto", "none", "required"; the chat path checks the word
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise _invalid(
        f"tool_choice {_short(choice)} is not served; function tools only.",
        param="tool_choice",
        fix='send "auto", "none", "required" or {"type": "function", "name": ...}',
    )


def _response_format(fmt: TextFormat) -> dict[str, Any] | None:
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None or fmt.name is None:
        raise _invalid(
            'text.format {"type": "json_schema"} needs a name and a schema.',
            param="text.format",
            fix='send {"type": "json_schema", "name": "...", "schema": {...}}',
        )
    spec: dict[str, Any] = {"name": fmt.name, "schema": fmt.schema_}
    if fmt.strict is not None:
        spec["strict"] = fmt.strict
    if fmt.description is not None:
        spec["description"] = fmt.description
    return {"type": "json_schema", "json_schema": spec}


def parse(body: Any) -> ResponsesRequest:
    """Check a Responses request's shape; what it cannot serve is a 400 naming the field."""
    request: ResponsesRequest = schemas.parse_request(ResponsesRequest, body)
    ignored = [name for name in IGNORED_FIELDS if getattr(request, name) is not None]
    if ignored:
        log.debug("/v1/responses: ignoring %s", ", ".join(ignored))
    if request.previous_response_id is not None or request.conversation is not None:
        field = "previous_response_id" if request.previous_response_id else "conversation"
        raise _invalid(
            f"{field} is not served: this server keeps no past responses.",
            param=field,
            fix="send the whole conversation in input (earlier turns as items); "
            "its prompt prefix is reused from the cache",
            code="unsupported_parameter",
        )
    if request.background:
        raise _invalid(
            "background responses are not served.",
            param="background",
            fix="leave background out, or stream the response",
            code="unsupported_parameter",
        )
    return request


def to_chat_body(request: ResponsesRequest) -> dict[str, Any]:
    """Translate a checked Responses request into a chat-completions body."""
    chat: dict[str, Any] = {"messages": _messages(request), "stream": request.stream}
    if request.model is not None:
        chat["model"] = request.model
    if request.max_output_tokens is not None:
        chat["max_tokens"] = request.max_output_tokens
    for name in ("temperature", "top_p", "parallel_tool_calls"):
        if getattr(request, name) is not None:
            chat[name] = getattr(request, name)
    if request.tools:
        chat["tools"] = _tools(request.tools)
    choice = _tool_choice(request.tool_choice)
    if choice is not None:
        chat["tool_choice"] = choice
    if request.text is not None and request.text.format is not None:
        response_format = _response_format(request.text.format)
        if response_format is not None:
            chat["response_format"] = response_format
    if request.reasoning is not None and request.reasoning.effort is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": request.reasoning.effort != "none"}
    return chat


def renamed(err: HttpError) -> HttpError:
    """An error found in the translated request, naming the field the client sent."""
    return rename_param(err, _RENAMED)


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseShaper:
    """Builds one Response from the chat deltas of a choice, streamed or whole.

    ``events`` are ``(name, data)`` pairs, ``data["type"] == name``, numbered
    in order by ``sequence_number`` as the Responses stream is.
    """

    def __init__(self, request: ResponsesRequest, model: str) -> None:
        self.id = _id("resp")
        self.created_at = int(time.time())
        self.model = model
        self.request = request
        self.items: list[dict[str, Any]] = []
        self._open: str | None = None  # the type of the item being streamed, if any
        self._seq = 0

    # --- the stream -------------------------------------------------------------------

    def start(self) -> list[tuple[str, dict[str, Any]]]:
        snapshot = self._response("in_progress", None, None)
        return [
            self._event("response.created", response=snapshot),
            self._event("response.in_progress", response=snapshot),
        ]

    def deltas(self, deltas: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
        """Stream events for chat deltas (``content``, ``reasoning_content``, ``tool_calls``)."""
        events: list[tuple[str, dict[str, Any]]] = []
        for delta in deltas:
            if delta.get("content"):
                events += self._into_message()
                part = self.items[-1]["content"][0]
                part["text"] += delta["content"]
                events.append(
                    self._event(
                        "response.output_text.delta",
                        **self._where(),
                        content_index=0,
                        delta=delta["content"],
                        logprobs=[],
                    )
                )
            elif delta.get("reasoning_content"):
                events += self._into_reasoning()
                part = self.items[-1]["content"][0]
                part["text"] += delta["reasoning_content"]
                events.append(
                    self._event(
                        "response.reasoning_text.delta",
                        **self._where(),
                        content_index=0,
                        delta=delta["reasoning_content"],
                    )
                )
            elif "tool_calls" in delta:
                call = delta["tool_calls"][0]
                if "id" in call:  # a call's head: its own item
                    events += self._close()
                    item = {
                        "id": _id("fc"),
                        "type": "function_call",
                        "status": "in_progress",
                        "call_id": call["id"],
                        "name": call["function"]["name"],
                        "arguments": "",
                    }
                    events += self._add(item, "function_call")
                else:  # its arguments, which end the item
                    arguments = call["function"]["arguments"]
                    self.items[-1]["arguments"] = arguments
                    events.append(
                        self._event(
                            "response.function_call_arguments.delta",
                            **self._where(),
                            delta=arguments,
                        )
                    )
                    events += self._close()
        return events

    def finish(
        self, reason: str | None, input_tokens: int, cached: int, output_tokens: int
    ) -> list[tuple[str, dict[str, Any]]]:
        events = self._close()
        response = self.response(reason, input_tokens, cached, output_tokens)
        name = "response.completed" if response["status"] == "completed" else "response.incomplete"
        events.append(self._event(name, response=response))
        return events

    def error(self, err: HttpError) -> list[tuple[str, dict[str, Any]]]:
        """A failure after the stream began: an ``error`` event, then ``response.failed``."""
        message = err.message if err.fix is None else f"{err.message} Fix: {err.fix}"
        failed = self._response("failed", None, None)
        failed["error"] = {"code": err.code or "server_error", "message": message}
        return [
            self._event("error", code=err.code, message=message, param=err.param),
            self._event("response.failed", response=failed),
        ]

    # --- the whole response -----------------------------------------------------------

    def response(
        self, reason: str | None, input_tokens: int, cached: int, output_tokens: int
    ) -> dict[str, Any]:
        """The finished Response: ``incomplete`` when cut by ``max_output_tokens``."""
        for item in self.items:
            item["status"] = "completed"
        usage = {
            "input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": output_tokens,
            # The engine does not count reasoning tokens apart from the others.
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens,
        }
        if reason == "length":
            return self._response("incomplete", {"reason": "max_output_tokens"}, usage)
        return self._response("completed", None, usage)

    # --- helpers --------------------------------------------------------------------

    def _response(
        self, status: str, incomplete: dict[str, Any] | None, usage: dict[str, Any] | None
    ) -> dict[str, Any]:
        request = self.request
        text_format: dict[str, Any] = {"type": "text"}
        if request.text is not None and request.text.format is not None:
            text_format = request.text.format.model_dump(by_alias=True, exclude_none=True)
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "model": self.model,
            "output": [_copy(item) for item in self.items] if usage is not None else [],
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": {"effort": request.reasoning.effort if request.reasoning else None},
            "store": False,
            "temperature": request.temperature,
            "text": {"format": text_format},
            "tool_choice": request.tool_choice if request.tool_choice is not None else "auto",
            "tools": list(request.tools or []),
            "top_p": request.top_p,
            "truncation": "disabled",
            "usage": usage,
            "metadata": dict(request.metadata or {}),
        }

    def _event(self, kind: str, /, **fields: Any) -> tuple[str, dict[str, Any]]:
        data = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return kind, data

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def _add(self, item: dict[str, Any], kind: str) -> list[tuple[str, dict[str, Any]]]:
        self.items.append(item)
        self._open = kind
        added = self._event(
            "response.output_item.added", output_index=len(self.items) - 1, item=_copy(item)
        )
        if kind == "function_call":
            return [added]
        part = self.items[-1]["content"][0]
        return [
            added,
            self._event(
                "response.content_part.added", **self._where(), content_index=0, part=dict(part)
            ),
        ]

    def _into_message(self) -> list[tuple[str, dict[str, Any]]]:
        if self._open == "message":
            return []
        events = self._close()
        item = {
            "id": _id("msg"),
            "type": "message",
            "role": "assistant",
            "status": "in_progress",
            "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}],
        }
        return events + self._add(item, "message")

    def _into_reasoning(self) -> list[tuple[str, dict[str, Any]]]:
        if self._open == "reasoning":
            return []
        events = self._close()
        item = {
            "id": _id("rs"),
            "type": "reasoning",
            "status": "in_progress",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": ""}],
        }
        return events + self._add(item, "reasoning")

    def _close(self) -> list[tuple[str, dict[str, Any]]]:
        kind, self._open = self._open, None
        if kind is None:
            return []
        item = self.items[-1]
        item["status"] = "completed"
        where = self._where()
        events = []
        if kind == "function_call":
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    **where,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        else:
            part = item["content"][0]
            done = f"response.{'output' if kind == 'message' else 'reasoning'}_text.done"
            extra: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
            events.append(self._event(done, **where, content_index=0, text=part["text"], **extra))
            events.append(
                self._event(
                    "response.content_part.done", **where, content_index=0, part=dict(part)
                )
            )
        events.append(
            self._event(
                "response.output_item.done", output_index=where["output_index"], item=_copy(item)
            )
        )
        return events


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    """An item with its content parts copied (events must not change as text is added)."""
    out = dict(item)
    if "content" in out:
        out["content"] = [dict(p) for p in out["content"]]
    return out
