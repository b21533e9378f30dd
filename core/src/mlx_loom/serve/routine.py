"""Request fields a local server accepts and ignores, and ``reasoning_effort``.

SDKs and agent clients send fields that only mean something to a hosted
service: whether to keep the exchange (``store``), tags for a dashboard
(``metadata``), a caller id for abuse tracking (``user``,
``safety_identifier``), a billing tier (``service_tier``), a routing hint
for a hosted prompt cache (``prompt_cache_key``). Refusing them would make
the official clients unusable; honouring them is impossible. So they are
type-checked like every other field, then logged at debug and dropped.
The lists here are the documented ones (docs/serve.md); any other unknown
field is still a 400.

``reasoning_effort`` is the one routine field that does mean something
here: it is mapped onto the chat template's thinking switch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import BaseModel

log = logging.getLogger("mlx_loom.serve")

#: OpenAI request fields accepted on /v1/chat/completions and /v1/completions
#: and ignored (``modalities`` is accepted only as ``["text"]``).
OPENAI_IGNORED = (
    "store",
    "metadata",
    "user",
    "service_tier",
    "prompt_cache_key",
    "safety_identifier",
    "modalities",
)

#: Anthropic request fields accepted on /v1/messages and ignored.
ANTHROPIC_IGNORED = ("metadata", "service_tier")

#: ``reasoning_effort`` values and whether each turns the template's thinking on.
#: The templates of the served families have an on/off switch, not a budget:
#: ``none`` and ``minimal`` ask for (next to) no reasoning, so they turn it off.
REASONING_EFFORTS: Mapping[str, bool] = {
    "none": False,
    "minimal": False,
    "low": True,
    "medium": True,
    "high": True,
    "xhigh": True,
}


def log_ignored(request: BaseModel, names: Iterable[str], endpoint: str) -> None:
    """Log (at debug) which of ``names`` the client set; their values are not logged."""
    sent = sorted(n for n in names if n in request.model_fields_set)
    if sent:
        log.debug("%s: accepted and ignored %s", endpoint, ", ".join(sent))


def thinking_kwargs(effort: str | None) -> dict[str, Any]:
    """The template variables ``reasoning_effort`` sets (none when it is absent).

    ``enable_thinking`` is the switch the Qwen-style templates read; the
    effort itself is passed on as ``reasoning_effort`` too, for templates that
    read that name. A template that reads neither is rendered as before.
    """
    if effort is None:
        return {}
    return {"enable_thinking": REASONING_EFFORTS[effort], "reasoning_effort": effort}
