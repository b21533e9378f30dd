"""Assistant prefill: a conversation ending in the assistant's own turn is continued.

Anthropic's API (and OpenAI-compatible servers after it) treat a final
assistant message as the start of the reply: the prompt leaves that turn
open and the model writes on from its last character, so a client can
steer the answer ("continue from ``{``"). The reply carries the
continuation only; the client already has the part it sent.

Every chat door (chat completions, Anthropic messages, Responses) decides
with :func:`continues_final_message` and renders with the template's
``continue_final_message`` behaviour.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def continues_final_message(messages: Sequence[Mapping[str, Any]]) -> bool:
    """Whether the prompt should continue the last message instead of opening a new turn.

    True when the last message is the assistant's, with text content and no
    tool calls (a turn ending in a tool call is complete: its result comes
    next). An empty assistant message is a closed turn too: there is nothing
    to continue, and templates render it as an ordinary empty reply.
    """
    if not messages:
        return False
    last = messages[-1]
    content = last.get("content")
    return (
        last.get("role") == "assistant"
        and isinstance(content, str)
        and content != ""
        and not last.get("tool_calls")
    )
