"""Batched generation: several prompts of different lengths decoded together.

Prompts are left-padded to a common length; each layer's cache is created
as the batch counterpart of the model's own cache kind (``empty_batch``) with
the per-row padding, so pad positions are masked out of attention (and never
enter a recurrent state). Rows that finish — EOS or their token budget — are
filtered out of the caches, so the remaining rows stop paying for them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from ..errors import RequestError
from ..host import BATCH
from ..model import Model
from ..text import Tokenizer
from .params import SamplingParams
from .sampling import logprobs_from_logits, make_logits_processors, make_sampler
from .stream import DEFAULT_MAX_TOKENS, DEFAULT_PREFILL_STEP, _check_request, encode_prompt


@dataclass(frozen=True)
class BatchResult:
    """One row's outcome: its tokens, text and why it stopped."""

    tokens: list[int]
    text: str
    finish_reason: str


def make_batch_cache(model: Model, left_padding: Sequence[int]) -> list[Any]:
    """Fresh batch caches for ``model`` with the given per-row left padding."""
    caches = []
    for cache in model.make_cache():
        make = getattr(cache, "empty_batch", None)
        if make is None:
            raise RequestError(
                f"{type(cache).__name__} caches cannot hold a batch.",
                fix="Generate the prompts one at a time.",
            )
        caches.append(make(list(left_padding)))
    return caches


def batch_generate_tokens(
    model: Model,
    prompts: Sequence[Sequence[int]],
    *,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    eos: frozenset[int] = frozenset(),
    prefill_step_size: int = DEFAULT_PREFILL_STEP,
    params: SamplingParams | None = None,
) -> list[tuple[list[int], str]]:
    """Decode all ``prompts`` together; return each row's tokens and finish reason."""
    model.require(BATCH, asked="batched generation")
    params = params or SamplingParams()
    if params.repetition_penalty or params.presence_penalty or params.frequency_penalty:
        raise RequestError(
            "Penalties are not supported in batched generation yet.",
            fix="Generate these prompts one at a time to use penalties.",
        )
    sampler = make_sampler(params)
    lengths = [len(p) for p in prompts]
    width = max(lengths)
    padding = [width - n for n in lengths]
    cache = make_batch_cache(model, padding)
    inputs = mx.array(
        [[0] * pad + list(p) for p, pad in zip(prompts, padding, strict=True)], mx.int32
    )

    while inputs.shape[1] > 1:
        n = min(prefill_step_size, inputs.shape[1] - 1)
        model(inputs[:, :n], cache)
        mx.eval([c.state for c in cache])
        inputs = inputs[:, n:]

    rows = list(range(len(prompts)))  # original index of each live row
    out: list[list[int]] = [[] for _ in prompts]
    reasons = ["length"] * len(prompts)
    # Penalties are refused above, so at most the logit bias remains; it does
    # not read the token history.
    processors = make_logits_processors(params)
    no_history = mx.array([], mx.uint32)
    while rows:
        logits = model(inputs, cache)[:, -1, :]
        for processor in processors:
            logits = processor(no_history, logits)
        tokens = sampler(logprobs_from_logits(logits)).tolist()
        keep = []
        for i, (row, token) in enumerate(zip(rows, tokens, strict=True)):
            if token in eos:
                reasons[row] = "stop"
                continue
            out[row].append(token)
            if len(out[row]) < max_tokens:
                keep.append(i)
        if not keep:
            break
        if len(keep) < len(rows):
            for c in cache:
                c.filter(keep)
            rows = [rows[i] for i in keep]
            tokens = [tokens[i] for i in keep]
        inputs = mx.array(tokens, mx.int32)[:, None]
    return [(out[i], reasons[i]) for i in range(len(prompts))]


def batch_generate(
    model: Model,
    tokenizer: Tokenizer,
    prompts: Sequence[str | Sequence[int]],
    *,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    prefill_step_size: int = DEFAULT_PREFILL_STEP,
    **sampling: Any,
) -> list[BatchResult]:
    """Generate for several prompts at once; one :class:`BatchResult` per prompt."""
    if not prompts:
        raise RequestError("No prompts were given.", fix="Pass at least one prompt.")
    if "temp" in sampling:
        sampling["temperature"] = sampling.pop("temp")
    params = SamplingParams.parse(**sampling)
    ids = [encode_prompt(tokenizer, p) for p in prompts]
    for row in ids:
        _check_request(
            model,
            row,
            max_tokens=max_tokens,
            prefill_step_size=prefill_step_size,
            kv_bits=None,
            kv_group_size=64,
            quantized_kv_start=0,
            params=params,
        )
    results = batch_generate_tokens(
        model,
        ids,
        max_tokens=max_tokens,
        eos=tokenizer.eos_token_ids,
        prefill_step_size=prefill_step_size,
        params=params,
    )
    return [BatchResult(t, tokenizer.decode(t), r) for t, r in results]
