"""The protocol a plugin's graph satisfies.

Its own module, below the host and the model wrapper: the author API
(:mod:`mlx_loom.plugin`) names it, and so does :class:`mlx_loom.model.Model`,
which wraps a graph that satisfies it.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import mlx.core as mx

__all__ = ["CausalLM"]


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
