"""The protocol a plugin's graph satisfies.

Its own module, below the host and the model wrapper: the author API
(:mod:`mlx_loom.plugin`) names it, and so does :class:`mlx_loom.model.Model`,
which wraps a graph that satisfies it.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import mlx.core as mx

__all__ = ["CausalLM", "MultiTokenPredictor"]


@runtime_checkable
class CausalLM(Protocol):
    """What a family graph provides.

    ``__call__`` takes int32 token ids ``[B, L]`` and a list of per-layer
    caches (or ``None`` for a cache-less forward) and returns logits
    ``[B, L, vocab]``. ``make_cache`` returns fresh single-row caches, one per
    layer that needs one, in the order ``__call__`` consumes them.
    """

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None) -> mx.array: ...

    def make_cache(self) -> list[Any]: ...


@runtime_checkable
class MultiTokenPredictor(Protocol):
    """A graph that may draft with its own multi-token-prediction (MTP) head.

    The head reads the model's hidden state at position ``t`` and the token at
    ``t + 1`` and predicts ``t + 2``; applied to its own output it drafts
    further (:mod:`mlx_loom.engine.mtp`). ``mtp_refusal()`` says why this
    graph cannot draft (``None``: it can; the other methods are called only
    then). ``forward_hidden`` is ``__call__`` that also returns the hidden
    states ``[B, L, D]`` the head reads, with the same logits. ``mtp_forward``
    takes hidden states ``[B, L, D]`` and tokens ``[B, L]`` (the token after
    each state), appends them to the head's caches (``make_mtp_cache()``,
    trimmable) and returns the logits of the last position ``[B, V]`` (only
    they draft: the vocabulary projection is the head's largest product) and
    its own hidden states ``[B, L, D]``.
    """

    def mtp_refusal(self) -> str | None: ...

    def forward_hidden(
        self, inputs: mx.array, cache: list[Any] | None = None
    ) -> tuple[mx.array, mx.array]: ...

    def make_mtp_cache(self) -> list[Any]: ...

    def mtp_forward(
        self, hidden: mx.array, tokens: mx.array, cache: list[Any]
    ) -> tuple[mx.array, mx.array]: ...
