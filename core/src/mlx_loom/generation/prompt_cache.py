"""Prompt-cache reuse across calls: keep the caches and the tokens they hold.

A chat turn re-sends the whole conversation; only the part after the longest
prefix already in the cache needs a forward. When the cached tokens diverge
from the new prompt, the cache must drop its tail — which only a trimmable
cache can do exactly. A non-trimmable cache (recurrent state, a sliding
window that has wrapped) is never trimmed: it is reused when what it holds
is an exact prefix of the new prompt, and otherwise steps back to the last
checkpoint the new prompt shares — the engine keeps one at each turn
boundary and at the end of each prompt it prefills into these caches (at
most :data:`MAX_CHECKPOINTS`, the latest) — or, with none, starts afresh.

One generation at a time: a :class:`PromptCache` is one conversation's
state, so a second generation that asks for it while one runs (from another
thread, or an interleaved generator) is refused with a
:class:`~mlx_loom.errors.RequestError` rather than corrupting it. The
caches themselves are only ever computed on the model's engine thread.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from ..bounded_json import parse_json
from ..cache import load_prompt_cache, save_prompt_cache
from ..cache.geometry import check_caches_fit
from ..engine.caches import fresh_caches
from ..engine.lockstep_service import lockstep_of
from ..engine.prefix import common_prefix, trims_as
from ..errors import CacheError, RequestError
from ..model import Model

if TYPE_CHECKING:
    from ..engine import Done


#: Checkpoints a PromptCache keeps (the latest): a conversation steps back a
#: turn or two (an edit, a retry), rarely further.
MAX_CHECKPOINTS = 8


class PromptCache:
    """The caches of one conversation plus the exact tokens they hold.

    ``max_kv_size`` bounds each attention layer to a sliding window of that
    many tokens (as ``stream_generate(max_kv_size=...)``); a request must ask
    for the same bound as the cache it uses.
    """

    def __init__(self, model: Model, *, max_kv_size: int | None = None) -> None:
        self.model = model
        self.max_kv_size = max_kv_size
        self.cache: list[Any] = fresh_caches(model, max_kv_size)
        self.tokens: list[int] = []
        #: Checkpoints of the caches at earlier positions (``TakenCheckpoint``s).
        self.checkpoints: list[Any] = []
        self._busy = threading.Lock()

    def reset(self) -> None:
        self.cache = fresh_caches(self.model, self.max_kv_size)
        self.tokens = []
        self.checkpoints = []

    @contextmanager
    def claim(self) -> Iterator[None]:
        """Hold this cache for one generation; refuse if another one holds it."""
        if not self._busy.acquire(blocking=False):
            raise RequestError(
                "This PromptCache is in use by another generation; one conversation's cache "
                "serves one generation at a time.",
                fix="Give each concurrent generation its own PromptCache, or wait for the "
                "other generation to finish.",
            )
        try:
            yield
        finally:
            self._busy.release()

    def check_options(self, *, max_kv_size: int | None) -> None:
        if max_kv_size != self.max_kv_size:
            raise RequestError(
                f"The request asks for max_kv_size={max_kv_size}; this PromptCache was made "
                f"with max_kv_size={self.max_kv_size}.",
                fix="Pass the same max_kv_size to PromptCache(...) and to the request.",
            )

    def record(self, fed: Sequence[int]) -> None:
        """Note tokens fed into the caches by hand (outside a generation)."""
        self.tokens.extend(fed)

    def finish(self, done: Done) -> None:
        """Take in how a generation left the caches (the engine continued them in place)."""
        if done.outcome == "failed":
            self.tokens = []  # the engine started the caches afresh
            self.checkpoints = []
            return
        if done.caches is not None and done.caches is not self.cache:
            self.cache = done.caches
        self.tokens.extend(done.fed)
        self.checkpoints = [*self.checkpoints, *done.checkpoints][-MAX_CHECKPOINTS:]

    def prepare(self, prompt: Sequence[int]) -> list[int]:
        """Make the caches hold a prefix of ``prompt``; return the tokens still to feed.

        At least one token is always left to feed, since the last prompt
        token's logits choose the first new token.
        """
        prompt = list(prompt)
        keep = min(common_prefix(self.tokens, prompt), len(prompt) - 1)
        drop = len(self.tokens) - keep
        if drop > 0:
            if keep > 0 and self._can_trim():
                for c in self.cache:
                    c.trim(drop)
                self.tokens = self.tokens[:keep]
                # Checkpoints past ``keep`` hold the dropped tokens.
                self.checkpoints = [c for c in self.checkpoints if c.position <= keep]
            else:
                keep = self._step_back(keep)
        return prompt[keep:]

    def _step_back(self, keep: int) -> int:
        """Restore the last checkpoint at or before ``keep``; the tokens the caches then hold."""
        for cp in reversed(self.checkpoints):
            if not 0 < cp.position <= keep or self.model.parallel is not None:
                continue
            layers = list(zip(cp.layers, self.cache, cp.kinds, strict=True))
            # A layer without a snapshot trims back, if it is still the kind it was then.
            if not all(
                snap is not None or trims_as(cache, kind)
                for snap, cache, kind in layers
            ):
                continue
            drop = len(self.tokens) - cp.position
            for snap, cache, _ in layers:
                if snap is None:
                    cache.trim(drop)
            self.cache = [cache if snap is None else snap.restore() for snap, cache, _ in layers]
            self.tokens = self.tokens[: cp.position]
            self.checkpoints = [c for c in self.checkpoints if c.position <= cp.position]
            return cp.position
        self.reset()
        return 0

    def _can_trim(self) -> bool:
        """Whether every cache can trim; for a split model, on every rank.

        A pipeline rank holds only its layers' caches, which may all trim
        where another rank's cannot; every rank must keep the same prefix.
        """
        mine = all(c.is_trimmable() for c in self.cache)
        if self.model.parallel is None:
            return mine
        return all(flag == 1.0 for (flag,) in lockstep_of(self.model).gather([float(mine)]))

    @property
    def reused(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        return sum(int(getattr(c, "nbytes", 0)) for c in self.cache)

    def save(self, path: str | Path) -> None:
        """Write the caches and the tokens they hold to a ``.safetensors`` file."""
        save_prompt_cache(
            path,
            self.cache,
            {"tokens": json.dumps(self.tokens), **cache_binding(self.model)},
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
        _check_binding(meta, model, source)
        tokens = _saved_tokens(meta.get("tokens"), source=source, vocab=model.vocab_size)
        check_caches_fit(caches, model, tokens=len(tokens), source=source)
        # Evaluate on this (the loading) thread: the arrays are lazy reads, and
        # a lazy graph can only be evaluated on the thread that built it.
        mx.eval([c.state for c in caches])
        out = cls(model)
        out.cache, out.tokens = caches, tokens
        return out


#: What each binding entry of a saved cache is called in an error.
_BINDING_NAMES = {
    "implementation": "implementation",
    "model": "model directory",
    "artifact_fingerprint": "artifact fingerprint (tensor names, dtypes and shapes)",
    "weights": "weight files (their names, sizes and modification times)",
}


def cache_binding(model: Model) -> dict[str, str]:
    """The metadata that binds a saved cache to the weights that produced it.

    A cache is only meaningful with those weights: the same implementation,
    the same model directory, the same tensor manifest and the same weight
    files (replaced weights of the same shapes would continue the old
    state). A model built outside :func:`mlx_loom.load` has no fingerprint or
    weights identity, written as ``""``.
    """
    return {
        "implementation": model.implementation.id,
        "model": str(model.model_dir.resolve()),
        "artifact_fingerprint": model.artifact_fingerprint or "",
        "weights": model.weights_identity or "",
    }


def _check_binding(meta: dict[str, str], model: Model, source: str) -> None:
    for key, value in cache_binding(model).items():
        saved = meta.get(key)
        if saved == value:
            continue
        what = _BINDING_NAMES[key]
        if saved is None:
            raise CacheError(
                f"{source} does not name the {what} it was saved for (it was written by an "
                "older version, or by hand).",
                fix="Rebuild the cache with this model and save it again.",
            )
        if key == "weights":
            raise CacheError(
                f"{source} was saved with other weights: the {what} in "
                f"{str(model.model_dir)!r} changed since it was saved.",
                fix="Rebuild the cache: the weights it was computed with are gone.",
            )
        raise CacheError(
            f"{source} was saved for {key.replace('_', ' ')} {saved!r}; this model's is {value!r}.",
            fix="Load it with the model it was saved for, or rebuild the cache.",
        )


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
