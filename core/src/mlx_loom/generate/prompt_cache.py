"""Prompt-cache reuse across calls: keep the caches and the tokens they hold.

A chat turn re-sends the whole conversation; only the part after the longest
prefix already in the cache needs a forward. When the cached tokens diverge
from the new prompt, the cache must drop its tail — which only a trimmable
cache can do exactly. A non-trimmable cache (recurrent state, a sliding
window that has wrapped) is never trimmed: it is reused only when what it
holds is an exact prefix of the new prompt, and otherwise started afresh.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..bounded_json import parse_json
from ..cache import load_prompt_cache, save_prompt_cache
from ..cache.geometry import check_caches_fit
from ..errors import CacheError
from ..model import Model


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):  # stops at the shorter
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

    def save(self, path: str | Path) -> None:
        """Write the caches and the tokens they hold to a ``.safetensors`` file."""
        save_prompt_cache(
            path,
            self.cache,
            {
                "tokens": json.dumps(self.tokens),
                "implementation": self.model.implementation.id,
                "model": str(self.model.model_dir.resolve()),
            },
            kinds=self.model.binding.cache_kinds,
        )

    @classmethod
    def load(cls, path: str | Path, model: Model) -> PromptCache:
        """Read a cache saved by :meth:`save` for ``model`` (the same implementation).

        The file is verified before anything is used (see
        :mod:`mlx_loom.cache.persist`): checksum, token list, and the caches'
        geometry against this model (:mod:`mlx_loom.cache.geometry`). Only
        the cache kinds ``model``'s registry knows (the core's and those
        plugins registered) can be restored.
        """
        caches, meta = load_prompt_cache(path, kinds=model.binding.cache_kinds)
        source = f"The prompt cache {str(path)!r}"
        # A cache is only meaningful with the weights that produced it: the same
        # implementation and the same model directory.
        want = {"implementation": model.implementation.id, "model": str(model.model_dir.resolve())}
        for key, value in want.items():
            if meta.get(key) != value:
                raise CacheError(
                    f"{source} was saved for {key} {meta.get(key)!r}; this model's is {value!r}.",
                    fix="Load it with the model it was saved for, or rebuild the cache.",
                )
        tokens = _saved_tokens(meta.get("tokens"), source=source, vocab=model.vocab_size)
        check_caches_fit(caches, model, tokens=len(tokens), source=source)
        out = cls(model)
        out.cache, out.tokens = caches, tokens
        return out


def _saved_tokens(raw: str | None, *, source: str, vocab: int | None) -> list[int]:
    """The token list a saved cache holds: bounded JSON, ints, inside the vocabulary."""
    fix = "Rebuild the cache."
    if raw is None:
        raise CacheError(f"{source} has no token list in its metadata.", fix=fix)
    tokens = parse_json(raw, source=f"{source}: the token list", error=CacheError, fix=fix)
    if not isinstance(tokens, list) or not all(
        type(t) is int and t >= 0 and (vocab is None or t < vocab) for t in tokens
    ):
        limit = f" below the vocabulary size {vocab}" if vocab is not None else ""
        raise CacheError(
            f"{source}: the token list is not a list of token ids (integers >= 0{limit}).",
            fix=fix,
        )
    return tokens
