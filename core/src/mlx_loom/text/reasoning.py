"""Thinking sections in generated text: a model's markers, and whether a reply opens inside one.

Reasoning models write their chain of thought between markers before the
answer — ``<think>...</think>`` (Qwen3, MiniCPM, DeepSeek-R1 and most
others), Gemma 4's ``<|channel>thought ...<channel|>`` or gpt-oss's Harmony
``<|channel|>analysis<|message|>...<|end|>`` (whose message headers around
the answer are layout, dropped). The server returns
that text as ``reasoning_content`` and only the rest as ``content``.

A format is recognised, as mlx-lm does, when the chat template mentions both
markers or the vocabulary holds both marker tokens. Some templates open the
thinking section themselves at the end of the prompt (``<think>\\n``); then
the reply starts *inside* it, which :func:`opens_inside` detects from the
rendered prompt: the last start marker comes after the last end marker.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..backends import Provider


@dataclass(frozen=True)
class ReasoningFormat:
    """The markers around a thinking section.

    ``tokens`` are the strings (vocabulary entries, usually special tokens)
    whose presence in the chat template or the vocabulary identifies the
    format; ``start`` may span several tokens (Gemma 4's ``<|channel>thought``).
    """

    name: str
    start: str
    end: str
    tokens: tuple[str, ...] = ()
    #: Markup between sections that carries no text of its own (Harmony's
    #: message headers): dropped wherever it appears in the answer.
    layout: tuple[str, ...] = ()
    description: str = ""
    provider: Provider | None = field(default=None, compare=False)

    def matches_template(self, source: str) -> bool:
        return all(marker in source for marker in (self.tokens or (self.start, self.end)))

    def matches_vocabulary(self, has_token: Callable[[str], bool]) -> bool:
        return bool(self.tokens) and all(has_token(t) for t in self.tokens)

    def opens_inside(self, prompt: str) -> bool:
        """Whether a reply to ``prompt`` starts inside a thinking section."""
        return prompt.rfind(self.start) > prompt.rfind(self.end)


THINK = ReasoningFormat(
    name="think",
    start="<think>",
    end="</think>",
    tokens=("<think>", "</think>"),
    description="<think>...</think> (Qwen3, MiniCPM, DeepSeek-R1 ...)",
)

GEMMA4_CHANNEL = ReasoningFormat(
    name="gemma4",
    start="<|channel>thought",
    end="<channel|>",
    tokens=("<|channel>", "<channel|>"),
    description="<|channel>thought ...<channel|> (Gemma 4)",
)

# gpt-oss writes every message with a header: reasoning is the ``analysis``
# channel, the answer the ``final`` channel, tool calls and their preambles the
# ``commentary`` channel. The headers are layout; the analysis message is the
# thinking section.
HARMONY = ReasoningFormat(
    name="harmony",
    start="<|channel|>analysis<|message|>",
    end="<|end|>",
    tokens=("<|channel|>", "<|message|>"),
    layout=(
        "<|start|>assistant",
        "<|channel|>final",
        "<|channel|>commentary",
        "<|constrain|>json",
        "<|message|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
    ),
    description="<|channel|>analysis<|message|>...<|end|> then <|channel|>final (gpt-oss Harmony)",
)

BUILTIN_REASONING_FORMATS: tuple[ReasoningFormat, ...] = (GEMMA4_CHANNEL, HARMONY, THINK)


def infer_reasoning(
    template: str | None,
    has_token: Callable[[str], bool],
    formats: tuple[ReasoningFormat, ...] = BUILTIN_REASONING_FORMATS,
) -> ReasoningFormat | None:
    """The format the template mentions, else the one the vocabulary holds, else ``None``."""
    if template:
        for fmt in formats:
            if fmt.matches_template(template):
                return fmt
    for fmt in formats:
        if fmt.matches_vocabulary(has_token):
            return fmt
    return None
