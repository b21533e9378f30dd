"""Tool calls in generated text: one small module per format, chosen per model.

A format is a :class:`ToolParser` (markers plus a parser); the streaming
state machine that finds calls in a generation as it arrives is
:class:`mlx_loom.text.output_parser.OutputParser`. Formats built in (the
names are mlx-lm's, so ``tool_parser_type`` in a converted checkpoint's
``tokenizer_config.json`` works unchanged):

=============== ==========================================================
``json_tools``  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
``qwen3_coder`` ``<tool_call><function=f><parameter=p>v</parameter></function></tool_call>``
``gemma4``      ``<|tool_call>call:f{p:<|"|>v<|"|>}<tool_call|>``
``minicpm5``    ``<function name="f"><param name="p">v</param></function>``
``pythonic``    ``<|tool_call_start|>[f(p="v")]<|tool_call_end|>``
``mistral``     ``[TOOL_CALLS]f[ARGS]{...}`` or ``[TOOL_CALLS][{...}]``
``harmony``     ``<|channel|>commentary to=functions.f <|constrain|>json<|message|>{...}<|call|>``
=============== ==========================================================

Plugins add formats through the ``loom_tool_parsers`` hook.
"""

from .base import MalformedToolCall, ToolCall, ToolParser
from .schema import coerce_arguments, coerce_value, tool_schemas
from .selection import (
    BUILTIN_TOOL_PARSERS,
    ToolParserChoice,
    choose_tool_parser,
    lookup,
    parser_table,
)

__all__ = [
    "BUILTIN_TOOL_PARSERS",
    "MalformedToolCall",
    "ToolCall",
    "ToolParser",
    "ToolParserChoice",
    "choose_tool_parser",
    "coerce_arguments",
    "coerce_value",
    "lookup",
    "parser_table",
    "tool_schemas",
]
