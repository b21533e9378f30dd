"""What the engine hands back: one event per generated token, and one outcome per request.

Events are plain Python (ints, floats, strings), except ``logprobs``, the
full log-probability vector, which is an evaluated ``mx.array`` and only
present when the request asked for it. So they can cross to any thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import mlx.core as mx


@dataclass(frozen=True)
class TokenEvent:
    """One generated token of request ``uid`` and the text it released.

    ``text`` may be empty while a partial character or a possible stop string
    is held back. ``finish_reason`` is set on the request's last event:
    ``"stop"`` (EOS or a stop string; ``stop`` names the string) or
    ``"length"`` (``max_tokens``, or the end of the model's context).
    """

    uid: int
    token: int
    text: str
    logprob: float
    top_logprobs: list[tuple[int, float]]
    prompt_tokens: int
    cached_tokens: int
    generation_tokens: int
    prompt_tps: float
    generation_tps: float
    peak_memory: float
    finish_reason: str | None = None
    stop: str | None = None
    from_draft: bool = False
    logprobs: mx.array | None = field(default=None, repr=False)


@dataclass(frozen=True)
class Done:
    """How request ``uid`` ended; always the last thing delivered for it.

    ``caches`` and ``fed`` are set for a request that brought its own caches
    (a :class:`~mlx_loom.generation.PromptCache`): the single-row caches as the
    request left them, and every token fed into them beyond what they held.
    """

    uid: int
    outcome: Literal["finished", "cancelled", "failed"]
    error: BaseException | None = None
    caches: list[Any] | None = field(default=None, repr=False)
    fed: tuple[int, ...] = ()
    #: For a request that asked (``checkpoints=True``): the checkpoints taken
    #: while its prompt was prefilled, positions counted in its caches.
    checkpoints: tuple[Any, ...] = field(default=(), repr=False)

    @property
    def ok(self) -> bool:
        return self.outcome != "failed"


Event = TokenEvent | Done
