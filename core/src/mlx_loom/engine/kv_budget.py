"""The KV byte budget: how many bytes of caches the running requests may hold.

Counting rows (``decode_concurrency``) bounds memory only for one prompt
length; a server that takes both 100-token chats and 30,000-token
documents needs a bound in bytes. With ``EngineSettings.max_kv_bytes`` set,
each request *reserves* the bytes its caches reach at their fullest — the
prompt (with any history it continues) plus every token it may generate
(``Request.limit``), plus a speculative request's draft window — before it
may start, and gives them back when it leaves. A request whose reservation
does not fit beside the running ones waits at the head of the queue (the
queue stays first come, first served, so a long request is never starved by
short ones behind it); one that could not fit even alone is failed with
:class:`~mlx_loom.errors.KVBudgetExceeded` (the server's 503 with ``Retry-After``).

How the bytes are known without any family-specific code: the model runs
forwards of that many tokens, in chunks of the request's prefill step as the
engine feeds them, on fresh caches, and nothing is evaluated (the probe
:mod:`mlx_loom.cache.geometry` also uses). MLX is lazy, so the forwards fix
every cache array's shape and dtype — a sliding window keeps its size plus
the chunk it was last handed, recurrent state stays constant, the full
cache rounds up to its allocation step — at the cost of building graphs and
no tensor data. Token counts are rounded up to :data:`PROBE_GRANULE` so one
probe serves many requests (a reservation errs upward, by less than that
many tokens).

What the budget does not count: the prefix store (``prompt_cache_bytes``
bounds it), a draft model's own caches, and the left padding a batch of
rows of different lengths carries. A request in a KV codec (``kv_bits``)
reserves its plain size, which is more than it will hold.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

import mlx.core as mx

from mlx_loom.engine.caches import fresh_caches
from mlx_loom.errors import CapabilityRefused, KVBudgetExceeded

if TYPE_CHECKING:
    from mlx_loom.engine.request import Request
    from mlx_loom.model import Model

#: Token counts are probed in multiples of this (the full cache's allocation step).
PROBE_GRANULE = 256
#: Probes remembered per engine (token count x max_kv_size x prefill step).
PROBES_KEPT = 64


def tokens_held(request: Request) -> int:
    """The most tokens the request's caches hold: history, prompt, output, draft window."""
    held = len(request.history) if request.cache is not None else 0
    held += len(request.prompt) + request.limit
    if request.speculation is not None:
        held += request.speculation.num_draft
    return held


def check_kv_budget(model: Model, max_bytes: int | None) -> None:
    """Refuse a byte budget for a model split across ranks.

    Each rank holds its own part of every cache (a pipeline rank only its
    layers), so each would measure a different cost, admit differently, and
    the ranks, which must run the same rows in every step, would part.
    """
    if max_bytes is not None and model.parallel is not None:
        raise CapabilityRefused(
            "A KV byte budget (max_kv_bytes) is not supported for a model split across ranks.",
            fix="Drop --max-kv-bytes for a split model; bound it by --decode-concurrency.",
        )


class KVBudget:
    """Reservations against ``max_kv_bytes`` for one engine (engine thread only)."""

    def __init__(self, model: Model, max_bytes: int | None) -> None:
        self.model = model
        self.max_bytes = max_bytes
        #: Bytes reserved by the requests running now (prefilling or decoding).
        self.reserved = 0
        self._probes: OrderedDict[tuple[int, int | None, int], int] = OrderedDict()

    def cost(self, request: Request, step: int) -> int:
        """Bytes ``request``'s caches reach at their fullest, prefilled ``step`` tokens
        at a time (0 without a budget)."""
        if self.max_bytes is None:
            return 0
        return self.probe(tokens_held(request), request.max_kv_size, step)

    def probe(self, tokens: int, max_kv_size: int | None, step: int) -> int:
        """Bytes of fresh caches fed ``tokens`` tokens (rounded up to the granule),
        ``step`` at a time."""
        n = -(-tokens // PROBE_GRANULE) * PROBE_GRANULE
        key = (n, max_kv_size, step)
        if key in self._probes:
            self._probes.move_to_end(key)
            return self._probes[key]
        caches = fresh_caches(self.model, max_kv_size)
        for start in range(0, n, step):
            # Lazy: builds the graph (shapes and dtypes), computes nothing.
            chunk = mx.zeros((1, min(step, n - start)), dtype=mx.int32)
            self.model.forward(chunk, caches)
        nbytes = sum(int(c.nbytes) for c in caches)
        self._probes[key] = nbytes
        if len(self._probes) > PROBES_KEPT:
            self._probes.popitem(last=False)
        return nbytes

    def check_alone(self, cost: int) -> None:
        """Refuse a request that could never run, however long it waited."""
        if self.max_bytes is not None and cost > self.max_bytes:
            raise KVBudgetExceeded(
                f"This request's KV caches would take {cost:,} bytes at their fullest (prompt "
                f"plus max_tokens), more than the server's whole KV budget of "
                f"{self.max_bytes:,} bytes (max_kv_bytes).",
                fix="Send a shorter prompt or a smaller max_tokens, or raise --max-kv-bytes.",
            )

    def fits(self, cost: int) -> bool:
        """Whether ``cost`` more bytes fit beside the reservations held now."""
        return self.max_bytes is None or self.reserved + cost <= self.max_bytes
