"""What a tool-call format is: markers around a call, and a parser for the text between them.

A model asks for a tool by writing markup its chat template taught it, such
as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. A
:class:`ToolParser` describes one such format as data: the ``start`` and
``end`` markers that delimit a call in the generated text, a ``parse``
function for the text between them, the chat-template markers that identify
the format, and how to open a call to a named function (used to honour
``tool_choice``). The streaming machinery in
:mod:`mlx_loom.text.output_parser` is written once against this; a format
module only knows its own syntax.

``parse`` raises :class:`MalformedToolCall` for text it cannot read. That is
an expected outcome (a model may write a broken call, or run out of tokens
in the middle of one), never a crash: the caller returns the text as content
and logs the reason.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...errors import RegistrationError

if TYPE_CHECKING:
    from ...backends import Provider


class MalformedToolCall(ValueError):
    """The text between a format's markers is not a call it can read; says why."""


@dataclass(frozen=True)
class ToolCall:
    """One call the model asked for: a function name and its JSON arguments.

    ``id`` is the model's own call id where the format carries one (Mistral);
    the server assigns one otherwise.
    """

    name: str
    arguments: dict[str, Any]
    id: str | None = None


def _invalid(who: str, field_name: str, want: str, got: object) -> RegistrationError:
    return RegistrationError(
        f"{who}: {field_name} must be {want}, got {got!r}.",
        fix=f"Correct {field_name} where the parser is declared.",
    )


def _no_opening(name: str, template: str) -> str:
    return ""


@dataclass(frozen=True)
class ToolParser:
    """One tool-call format.

    * ``start`` opens a call in the generated text; ``end`` closes it. An
      empty ``end`` means the call runs to the end of the output (Mistral's
      ``[TOOL_CALLS]`` has no closing marker).
    * ``parse(text)`` reads the text between the markers into one or more
      :class:`ToolCall` s, with argument values as the format spells them
      (XML formats give strings); the caller then coerces them to the types
      the tool's JSON schema declares. It raises :class:`MalformedToolCall`.
    * ``template_markers``: groups of strings; a chat template whose source
      contains every string of any one group is taken to use this format.
    * ``opening(name, template)``: the text that follows ``start`` to begin a
      call to the function ``name`` (``template`` is the chat template's
      source, for formats with versions), so a server can make the model call
      it (a named ``tool_choice``) by writing the opening into the prompt.
    """

    name: str
    start: str
    end: str
    parse: Callable[[str], list[ToolCall]]
    template_markers: tuple[tuple[str, ...], ...] = ()
    opening: Callable[[str, str], str] = _no_opening
    description: str = ""
    provider: Provider | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        """Check every field, so a malformed registration fails where it is made."""
        who = f"ToolParser {self.name!r}"
        if not isinstance(self.name, str) or not self.name or any(c.isspace() for c in self.name):
            raise _invalid(who, "name", "a non-blank string without whitespace", self.name)
        if not isinstance(self.start, str) or not self.start:
            raise _invalid(who, "start", "the non-empty text that opens a call", self.start)
        if not isinstance(self.end, str):
            raise _invalid(who, "end", 'the text that closes a call ("" for none)', self.end)
        for name in ("parse", "opening"):
            if not callable(getattr(self, name)):
                raise _invalid(who, name, "a callable", getattr(self, name))
        markers = self.template_markers
        if not (
            isinstance(markers, (tuple, list))
            and all(
                isinstance(group, (tuple, list))
                and group
                and all(isinstance(m, str) and m for m in group)
                for group in markers
            )
        ):
            raise _invalid(who, "template_markers", "groups (tuples) of non-empty strings", markers)
        object.__setattr__(self, "template_markers", tuple(tuple(g) for g in markers))
        if not isinstance(self.description, str):
            raise _invalid(who, "description", "a string", self.description)

    def matches_template(self, source: str) -> bool:
        """Whether a chat template's source carries this format's markers."""
        return any(all(marker in source for marker in group) for group in self.template_markers)
