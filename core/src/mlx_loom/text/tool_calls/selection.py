"""Which tool-call format a model speaks: the built-in parsers, and how one is chosen.

The choice, first match wins (the rule mlx-lm follows, plus an explicit
override and the family's say):

1. the name given by the operator (``loom serve --tool-call-parser NAME``);
2. ``tool_parser_type`` in the model's ``tokenizer_config.json``;
3. the first format whose markers the chat template contains (plugin
   parsers are tried before the built-ins, most specific built-in first);
4. the default the model type's plugin declares.

A name that no registered parser answers to (1, 2 or 4) is a
:class:`~mlx_loom.errors.ToolParserUnavailable` refusal listing the
registered names — never a guess at another format.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ...errors import RegistrationError, ToolParserUnavailable
from . import gemma4, harmony, json_tools, minicpm5, mistral, pythonic, qwen3_coder
from .base import ToolParser

#: The core's parsers, in the order template inference tries them: a format
#: whose markers contain another's (``<tool_call>\n<function=`` contains
#: ``<tool_call>``) comes first.
BUILTIN_TOOL_PARSERS: tuple[ToolParser, ...] = (
    gemma4.PARSER,
    harmony.PARSER,
    pythonic.PARSER,
    qwen3_coder.PARSER,
    minicpm5.PARSER,
    mistral.PARSER,
    json_tools.PARSER,
)


def parser_table(extra: Iterable[ToolParser] = ()) -> dict[str, ToolParser]:
    """Plugin parsers (``extra``) then the built-ins, by name; a name twice is an error."""
    table: dict[str, ToolParser] = {}
    for parser in (*extra, *BUILTIN_TOOL_PARSERS):
        if parser.name in table:
            first = table[parser.name].provider or "the host"
            if parser in BUILTIN_TOOL_PARSERS:
                raise RegistrationError(
                    f"Tool parser {parser.name!r} is built into the core; {first} registers "
                    "another under that name.",
                    fix="Rename the plugin's parser (built-in names: "
                    + ", ".join(p.name for p in BUILTIN_TOOL_PARSERS)
                    + ").",
                )
            raise RegistrationError(
                f"Tool parser {parser.name!r} is registered twice: by {first} and by "
                f"{parser.provider or 'the host'}.",
                fix="Rename one of the parsers, or uninstall or disallow one of the plugins.",
            )
        table[parser.name] = parser
    return table


@dataclass(frozen=True)
class ToolParserChoice:
    """The parser chosen for a model (``None``: no format known) and why, for logs and docs."""

    parser: ToolParser | None
    reason: str


def lookup(name: str, parsers: Mapping[str, ToolParser], *, asked_by: str) -> ToolParser:
    """The parser registered as ``name``, or a refusal listing the registered names."""
    parser = parsers.get(name)
    if parser is None:
        raise ToolParserUnavailable(
            f"{asked_by} asks for tool-call parser {name!r}, which is not registered "
            f"(registered: {', '.join(sorted(parsers))}).",
            fix="Name one of the registered parsers (loom serve --tool-call-parser NAME), or "
            "install the plugin that provides this one.",
        )
    return parser


def choose_tool_parser(
    parsers: Mapping[str, ToolParser],
    *,
    override: str | None = None,
    tokenizer_config: str | None = None,
    template: str | None = None,
    family_default: str | None = None,
    model_type: str | None = None,
) -> ToolParserChoice:
    """Apply the rule in the module docstring."""
    if override is not None:
        parser = lookup(override, parsers, asked_by="--tool-call-parser")
        return ToolParserChoice(parser, f"--tool-call-parser {override}")
    if tokenizer_config is not None:
        where = "tokenizer_config.json (tool_parser_type)"
        parser = lookup(tokenizer_config, parsers, asked_by=where)
        return ToolParserChoice(parser, f"{where} = {tokenizer_config}")
    if template:
        for parser in parsers.values():
            if parser.matches_template(template):
                return ToolParserChoice(parser, f"the chat template's {parser.name} markers")
    if family_default is not None:
        who = f"model type {model_type!r}" if model_type else "the model's plugin"
        parser = lookup(family_default, parsers, asked_by=f"the plugin of {who}")
        return ToolParserChoice(parser, f"the default of {who}")
    return ToolParserChoice(None, "no tool-call format is declared or recognisable")
