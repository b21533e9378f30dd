"""Prompt-cache reuse across calls: keep the caches and the tokens they hold.

A chat turn re-sends the whole conversation; only the part after the longest
prefix already in the cache needs a forward. When the cached tokens diverge
from the new prompt, the cache must drop its tail — which only a trimmable
cache can do exactly. A non-trimmable cache (recurrent state, a sliding
window that has wrapped) is never trimmed: it is reused only when what it
holds is an exact prefix of the new prompt, and otherwise started afresh.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..model import Model


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PromptCache:
    """The caches of one conversation plus the exact tokens they hold."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self.cache: list[Any] = model.make_cache()
        self.tokens: list[int] = []

    def reset(self) -> None:
        self.cache = self.model.make_cache()
        self.tokens = []

    def prepare(self, prompt: Sequence[int]) -> list[int]:
        """Make the caches hold a prefix of ``prompt``; return the tokens still to feed.

        At least one token is always left to feed, since the last prompt
        token's logits choose the first new token.
        """
        prompt = list(prompt)
        keep = min(_common_prefix(self.tokens, prompt), len(prompt) - 1)
        drop = len(self.tokens) - keep
        if drop > 0:
            if keep > 0 and all(c.is_trimmable() for c in self.cache):
                for c in self.cache:
                    c.trim(drop)
                self.tokens = self.tokens[:keep]
            else:
                self.reset()
                keep = 0
        return prompt[keep:]

    @property
    def reused(self) -> int:
        return len(self.tokens)

    def record(self, fed: Sequence[int]) -> None:
        """Note tokens the loop fed into the caches."""
        self.tokens.extend(fed)

    @property
    def nbytes(self) -> int:
        return sum(int(getattr(c, "nbytes", 0)) for c in self.cache)
