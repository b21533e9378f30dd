"""Tools and reasoning for chat requests: what reaches the template, and how the output is read.

:class:`ChatFormat` is decided once per server: the model's tool-call format
(see :func:`mlx_loom.text.tool_calls.choose_tool_parser`) and its reasoning
markers. :func:`plan_tools` turns one request's ``tools``, ``tool_choice``
and ``parallel_tool_calls`` into a :class:`ToolPlan`:

* ``auto`` (the default when tools are given): the tools reach the template
  and the output is searched for calls;
* ``none``: the tools do not reach the template and the output is not
  searched, so the model answers in text — OpenAI's meaning, guaranteed
  rather than hoped for;
* ``required`` / a named function: the prompt ends with the format's start
  marker (and, for a name, the opening of a call to it), so the reply *is* a
  call; the rest of it is held to the format's grammar, arguments valid by
  the tool's schema (:mod:`mlx_loom.serve.tool_grammar`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import LoomError, ToolParserUnavailable
from ..host import Registry, default_host
from ..model import Model
from ..text import Tokenizer
from ..text.output_parser import OutputParser
from ..text.reasoning import ReasoningFormat, infer_reasoning
from ..text.tool_calls import ToolParser, choose_tool_parser
from . import schemas
from .errors import HttpError, from_loom_error

#: The deepest nesting (objects and lists) a tool's definition may have. Real
#: schemas nest a few levels; templates and schema coercion recurse over it.
MAX_TOOL_DEPTH = 100

#: Placeholder tool list used only to pick the template a request with tools renders with.
_ANY_TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {"name": "f"}}]


@dataclass(frozen=True)
class ChatFormat:
    """How a model's chat output is read: its tool-call format and reasoning markers.

    The server decides it once, at start-up; a Python caller can do the same
    to read :func:`mlx_loom.generate` output as the server does::

        fmt = ChatFormat.for_model(model, tokenizer)
        prompt = tokenizer.apply_chat_template(messages, tools=tools)
        parser = fmt.output_parser(tools=tools, prompt=prompt)
        events = parser.feed(mlx_loom.generate(model, tokenizer, prompt_ids)) + parser.finish()
    """

    tool_parser: ToolParser | None
    #: Why this parser (or none): for the start-up log and ``/health``.
    tool_parser_reason: str
    reasoning: ReasoningFormat | None
    #: Source of the template requests with tools render with (for versioned openings).
    tools_template: str

    @classmethod
    def for_model(
        cls,
        model: Model,
        tokenizer: Tokenizer,
        *,
        registry: Registry | None = None,
        override: str | None = None,
    ) -> ChatFormat:
        """Choose for ``model``: ``override`` (a parser name), else what the artifact and
        its family declare (see :func:`~mlx_loom.text.tool_calls.choose_tool_parser`).

        ``registry`` (default: the default host's) supplies the registered
        parsers and the model type's default format.
        """
        registry = registry if registry is not None else default_host().registry
        claim = registry.model_types.get(model.model_type)
        source = ""
        if tokenizer.has_chat_template:
            try:
                source = tokenizer.chat_template(tools=_ANY_TOOLS).source
            except LoomError:  # several templates, none of them the default
                source = ""
        choice = choose_tool_parser(
            registry.tool_parsers,
            override=override,
            tokenizer_config=tokenizer.config.tool_parser_type,
            template=source,
            family_default=claim.tool_parser if claim is not None else None,
            model_type=model.model_type,
        )
        reasoning = infer_reasoning(source, lambda t: tokenizer.token_to_id(t) is not None)
        return cls(choice.parser, choice.reason, reasoning, source)

    def output_parser(
        self, *, tools: Sequence[Any] | None = None, prompt: str = ""
    ) -> OutputParser:
        """A splitter for one reply to ``prompt`` (the rendered chat), searching for calls
        to ``tools`` (none given: tool markup stays text)."""
        return OutputParser(
            tool_parser=self.tool_parser if tools else None,
            tools=tools,
            reasoning=self.reasoning,
            in_reasoning=self.reasoning is not None and self.reasoning.opens_inside(prompt),
        )


@dataclass(frozen=True)
class ToolPlan:
    """One request's tools: what the template sees, and how the reply is read."""

    #: The tools the template renders (``None``: none, or ``tool_choice`` ``none``).
    tools: list[dict[str, Any]] | None = None
    #: Whether the reply is searched for calls.
    parse: bool = False
    #: ``None``: the model decides. Otherwise the prompt already opened a call:
    #: this is the text after the start marker (``""`` for ``required``).
    forced: str | None = None
    #: ``parallel_tool_calls``: ``False`` ends the reply after its first call.
    parallel: bool = True


def plan_tools(request: schemas.ChatCompletionRequest, fmt: ChatFormat) -> ToolPlan:
    """Check ``tools``/``tool_choice`` against each other and the model (400, 422)."""
    tools = [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None
    choice = request.tool_choice
    parallel = request.parallel_tool_calls is not False
    if tools is None:
        if choice not in (None, "none", "auto"):
            raise HttpError(
                400,
                "tool_choice asks for a tool call, but the request has no tools.",
                fix="send the tools the model may call, or drop tool_choice",
                param="tool_choice",
                code="invalid_parameter",
            )
        return ToolPlan(parallel=parallel)
    for index, tool in enumerate(tools):
        depth = _nesting(tool)
        if depth > MAX_TOOL_DEPTH:
            raise HttpError(
                400,
                f"tools[{index}] nests {depth} levels deep; at most {MAX_TOOL_DEPTH} are served.",
                fix="flatten the tool's parameters schema",
                param=f"tools[{index}].function.parameters",
                code="invalid_parameter",
            )
    names = [t["function"]["name"] for t in tools]
    # One counting pass: every step of a request's preparation is linear in
    # its body (a ``names.count`` per name took minutes for 150,000 tools).
    twice = sorted(name for name, seen in Counter(names).items() if seen > 1)
    if twice:
        shown = twice[:5] + ([f"... {len(twice) - 5} more"] if len(twice) > 5 else [])
        raise HttpError(
            400,
            f"tools declares the function(s) {shown} more than once.",
            fix="give every tool a distinct function name",
            param="tools",
            code="invalid_parameter",
        )
    if choice == "none":
        return ToolPlan(parallel=parallel)
    parser = fmt.tool_parser
    if parser is None:
        raise from_loom_error(
            ToolParserUnavailable(
                f"The request has tools, but this server does not know how the model writes "
                f"tool calls ({fmt.tool_parser_reason}), so it could not return them.",
                fix="start loom serve with --tool-call-parser NAME for the model's format, or "
                'send tool_choice "none"',
            ),
            param="tools",
        )
    if isinstance(choice, schemas.NamedToolChoice):
        name = choice.function.name
        if name not in names:
            raise HttpError(
                400,
                f"tool_choice names the function {name!r}, which is not in tools "
                f"(tools: {', '.join(names[:20])}{', ...' if len(names) > 20 else ''}).",
                fix="name one of the functions in tools",
                param="tool_choice",
                code="invalid_parameter",
            )
        return ToolPlan(tools, True, parser.opening(name, fmt.tools_template), parallel)
    if choice == "required":
        return ToolPlan(tools, True, "", parallel)
    return ToolPlan(tools, True, None, parallel)


def _nesting(value: Any) -> int:
    """How deeply objects and lists nest in ``value`` (iteratively: the value is client input)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children: Iterable[Any]
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def prompt_suffix(plan: ToolPlan, fmt: ChatFormat, *, in_reasoning: bool) -> str:
    """Text appended to the rendered prompt so that the reply starts inside a forced call.

    A template that opened a thinking section gets it closed first: a forced
    call is the whole reply.
    """
    if plan.forced is None or fmt.tool_parser is None:
        return ""
    close = fmt.reasoning.end + "\n\n" if in_reasoning and fmt.reasoning is not None else ""
    return close + fmt.tool_parser.start + plan.forced


def output_parser(plan: ToolPlan, fmt: ChatFormat, *, in_reasoning: bool) -> OutputParser:
    """The splitter for one choice of this request."""
    forced = plan.forced is not None
    return OutputParser(
        tool_parser=fmt.tool_parser if plan.parse else None,
        tools=plan.tools,
        reasoning=fmt.reasoning,
        in_reasoning=in_reasoning and not forced,
        forced_call=plan.forced,
    )
