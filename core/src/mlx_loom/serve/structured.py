"""The server's doors to structured output: which request field asks for which constraint.

One request may carry one constraint, from any of the dialects clients speak:

* OpenAI's ``response_format``: ``{"type": "json_schema", "json_schema":
  {"schema": ...}}`` or ``{"type": "json_object"}`` (``{"type": "text"}``:
  none);
* vLLM's ``structured_outputs``: exactly one of ``json`` (a schema),
  ``json_object``, ``regex``, ``choice`` or ``grammar`` (Lark or GBNF);
* llama.cpp's ``json_schema`` (a schema) and ``grammar`` (GBNF or Lark);
* ``tool_choice: "required"`` or a named function (chat only): the reply is
  held to the model's own tool-call format, with arguments valid against the
  tool's ``parameters`` schema (:mod:`mlx_loom.serve.tool_grammar`).

Two of them in one request is a 400 (they would contradict each other); so
is a malformed or unenforceable schema or grammar, and one over the compile
budget (:mod:`mlx_loom.engine.constraints`). All of it is decided on the HTTP
thread, before anything is queued.
"""

from __future__ import annotations

from typing import Any

from ..engine.constraints import (
    MAX_SOURCE_BYTES,
    Constraint,
    compile_constraint,
    from_response_format,
)
from ..errors import CapabilityRefused, RequestError
from ..text import Tokenizer
from .errors import HttpError, from_loom_error
from .tool_grammar import tool_call_grammar
from .tools import ChatFormat, ToolPlan


def _asked(request: Any, plan: ToolPlan | None) -> list[tuple[str, str, Any]]:
    """``(param, kind, spec)`` for each constraint the request asks for."""
    asked: list[tuple[str, str, Any]] = []
    fmt = getattr(request, "response_format", None)
    if fmt is not None and fmt.type != "text":
        asked.append(("response_format", "response_format", fmt.model_dump()))
    so = request.structured_outputs
    if so is not None:
        fields = [
            (name, value)
            for name, value in (
                ("json", so.json_),
                ("json_object", so.json_object or None),
                ("regex", so.regex),
                ("choice", so.choice),
                ("grammar", so.grammar),
            )
            if value is not None
        ]
        if len(fields) != 1:
            raise HttpError(
                400,
                "structured_outputs must set exactly one of json, json_object, regex, choice "
                f"or grammar; it sets {len(fields)}.",
                fix="send one of them",
                param="structured_outputs",
                code="invalid_parameter",
            )
        name, value = fields[0]
        kind = {"json": "json_schema", "json_object": "json_object"}.get(name, name)
        asked.append((f"structured_outputs.{name}", kind, value))
    if request.json_schema is not None:
        asked.append(("json_schema", "json_schema", request.json_schema))
    if request.grammar is not None:
        asked.append(("grammar", "grammar", request.grammar))
    if plan is not None and plan.forced is not None:
        asked.append(("tool_choice", "tool_choice", None))
    return asked


def request_constraint(
    request: Any,
    tokenizer: Tokenizer,
    *,
    plan: ToolPlan | None = None,
    chat_format: ChatFormat | None = None,
) -> Constraint | None:
    """The constraint ``request`` asks for (``None``: none); a 400 for a bad one."""
    asked = _asked(request, plan)
    if not asked:
        return None
    if len(asked) > 1:
        names = ", ".join(param for param, _, _ in asked)
        raise HttpError(
            400,
            f"The request asks for more than one output constraint ({names}); a reply can "
            "follow only one.",
            fix="keep one of them",
            param=asked[1][0],
            code="invalid_parameter",
        )
    param, kind, spec = asked[0]
    try:
        if kind == "response_format":
            return from_response_format(spec, tokenizer)
        if kind == "tool_choice":
            assert plan is not None and chat_format is not None
            grammar = tool_call_grammar(plan, chat_format, tokenizer)
            if grammar is None:
                return None
            size = len(grammar.encode("utf-8"))
            if size > MAX_SOURCE_BYTES:
                raise RequestError(
                    f"The forced tool call's grammar (the format's syntax for every tool's "
                    f"parameters) is {size} bytes; at most {MAX_SOURCE_BYTES} are compiled.",
                    fix="name one function in tool_choice, or send fewer or smaller tools",
                )
            return compile_constraint("grammar", grammar, tokenizer)
        return compile_constraint(kind, spec, tokenizer)
    except (RequestError, CapabilityRefused) as err:
        raise from_loom_error(err, param=param) from None
