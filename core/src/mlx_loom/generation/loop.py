"""The token-level generation API: ``generate_tokens``, a client of the model's engine.

``generate_tokens`` is the lowest public way in: token ids in, ``(token,
logprobs)`` out, through caches the caller provides (and keeps). It runs on
the engine like every other generation (:mod:`mlx_loom.engine`), as a
request alone in its decode group: chunked prefill of all but the last
prompt token, the KV-quantization check after every forward, logits
processors over the running token history, log-softmax, sample, the next
step queued with ``mx.async_eval`` before the current token is handed out —
mlx-lm's ``generate_step`` order, which the loop-parity tests hold bit-equal.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from ..engine.params import SamplingParams
from ..engine.request import KVQuantization, make_request

if TYPE_CHECKING:
    from ..model import Model

__all__ = ["KVQuantization", "StepLog", "generate_tokens"]


@dataclass
class StepLog:
    """The tokens a generation fed into the caches (beyond what they held), once it ends."""

    fed: list[int] = field(default_factory=list)


def generate_tokens(
    model: Model,
    prompt: Sequence[int],
    cache: list[Any] | None = None,
    *,
    sampler: Callable[[mx.array], mx.array] | None = None,
    processors: Sequence[Callable[[mx.array, mx.array], mx.array]] = (),
    params: SamplingParams | None = None,
    history: Sequence[int] = (),
    max_tokens: int = 256,
    prefill_step_size: int | None = None,
    kv: KVQuantization | None = None,
    max_kv_size: int | None = None,
    log: StepLog | None = None,
) -> Iterator[tuple[int, mx.array]]:
    """Yield ``(token, logprobs[vocab])`` for up to ``max_tokens`` new tokens.

    ``prompt`` is what still has to be fed; ``cache`` (default: fresh
    caches) is continued in place and holds the final state once the
    iterator is exhausted or closed; ``history`` is what it already holds —
    logits processors (penalties) see ``history + prompt + generated``.
    Choose tokens with ``params`` (the built-in sampler and processors) or
    with mlx-lm-style callables ``sampler`` / ``processors``. No EOS is
    applied: the caller stops when it wants. ``log.fed`` receives the tokens
    fed into ``cache``.
    """
    kv = kv or KVQuantization()
    request = make_request(
        model,
        None,
        list(prompt),
        max_tokens=max_tokens,
        params=params,
        prefill_step_size=prefill_step_size,
        kv_bits=kv.bits,
        kv_group_size=kv.group_size,
        quantized_kv_start=kv.start,
        kv_codec=kv.codec,
        max_kv_size=max_kv_size,
        sampler=sampler,
        logits_processors=processors,
        cache=cache,
        history=history,
        logprobs_vector=True,
        eos=frozenset(),
    )
    handle = model.engine.submit(request)
    try:
        for event in handle:
            yield event.token, event.logprobs  # type: ignore[misc]
    finally:
        handle.cancel()
        done = handle.wait()
        if log is not None:
            log.fed.extend(done.fed)
