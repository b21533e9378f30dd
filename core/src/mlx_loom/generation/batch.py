"""``batch_generate``: several prompts at once, on the same engine as every other request.

Each prompt becomes one engine request with the options a single request
takes (sampling, penalties, stop strings, logit bias, ``max_kv_size`` ...),
so each row's tokens are the tokens that prompt gets alone. The engine
decodes them together (up to its ``decode_concurrency``; the rest wait for a
free row) and each row leaves as soon as it finishes. The answer is a
:class:`BatchResponse`, shaped like mlx-lm's (``.texts``) and also a
sequence of per-row :class:`BatchResult` s.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import mlx.core as mx

from ..capabilities import BATCH
from ..engine.params import SamplingParams
from ..engine.request import make_request
from ..errors import RequestError
from ..model import Model
from ..text import Tokenizer
from .stream import DEFAULT_MAX_TOKENS, sampling_params, speculation_for

__all__ = ["BatchResponse", "BatchResult", "BatchStats", "batch_generate", "batch_generate_tokens"]


@dataclass(frozen=True)
class BatchResult:
    """One row's outcome: its tokens, text, why it stopped, and each token's log-probability."""

    tokens: list[int]
    text: str
    finish_reason: str
    logprobs: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class BatchStats:
    """Totals over the batch (speeds in tokens per second, memory in GB)."""

    prompt_tokens: int
    generation_tokens: int
    seconds: float
    peak_memory: float

    @property
    def generation_tps(self) -> float:
        return self.generation_tokens / max(self.seconds, 1e-9)


@dataclass(frozen=True)
class BatchResponse(Sequence[BatchResult]):
    """mlx-lm's ``BatchResponse`` shape (``texts``, ``token_ids``, ``logprobs``, ``stats``),
    and a sequence of the per-row :class:`BatchResult` s, in prompt order."""

    results: list[BatchResult]
    stats: BatchStats

    @property
    def texts(self) -> list[str]:
        return [r.text for r in self.results]

    @property
    def token_ids(self) -> list[list[int]]:
        return [r.tokens for r in self.results]

    @property
    def logprobs(self) -> list[list[float]]:
        return [r.logprobs for r in self.results]

    @property
    def finish_reasons(self) -> list[str]:
        return [r.finish_reason for r in self.results]

    def __len__(self) -> int:
        return len(self.results)

    @overload
    def __getitem__(self, index: int) -> BatchResult: ...

    @overload
    def __getitem__(self, index: slice) -> list[BatchResult]: ...

    def __getitem__(self, index: int | slice) -> BatchResult | list[BatchResult]:
        return self.results[index]

    def __iter__(self) -> Iterator[BatchResult]:
        return iter(self.results)


def _run_rows(
    model: Model,
    tokenizer: Tokenizer | None,
    prompts: Sequence[Any],
    max_tokens: int | Sequence[int],
    options: dict[str, Any],
    adapters: Sequence[str | None] | None = None,
) -> list[tuple[list[int], str, list[float], str, int]]:
    """Submit one request per prompt; collect each row's tokens, reason, logprobs, text,
    prompt length."""
    model.require(BATCH, asked="batched generation")
    if isinstance(prompts, (str, bytes)) or not prompts:
        raise RequestError(
            "batch_generate needs a non-empty list of prompts.",
            fix="Pass a list of prompts (texts or token-id lists).",
        )
    budgets = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
    if len(budgets) != len(prompts):
        raise RequestError(
            f"max_tokens has {len(budgets)} entries for {len(prompts)} prompts.",
            fix="Pass one max_tokens, or one per prompt.",
        )
    names = [None] * len(prompts) if adapters is None else list(adapters)
    if len(names) != len(prompts):
        raise RequestError(
            f"adapters has {len(names)} entries for {len(prompts)} prompts.",
            fix="Pass one adapter name (or None) per prompt.",
        )
    requests = [
        make_request(model, tokenizer, p, max_tokens=m, adapter=a, **options)
        for p, m, a in zip(prompts, budgets, names, strict=True)
    ]
    engine = model.engine
    handles = [engine.submit(r) for r in requests]
    rows = []
    try:
        for handle in handles:
            tokens, logprobs, text, reason, prompt_len = [], [], [], "length", 0
            for event in handle:
                tokens.append(event.token)
                logprobs.append(event.logprob)
                text.append(event.text)
                reason = event.finish_reason or reason
                prompt_len = event.prompt_tokens
            rows.append((tokens, reason, logprobs, "".join(text), prompt_len))
    finally:
        for handle in handles:
            handle.cancel()
    return rows


def batch_generate_tokens(
    model: Model,
    prompts: Sequence[Sequence[int]],
    *,
    max_tokens: int | Sequence[int] = DEFAULT_MAX_TOKENS,
    eos: frozenset[int] = frozenset(),
    prefill_step_size: int | None = None,
    params: SamplingParams | None = None,
) -> list[tuple[list[int], str]]:
    """Token-level ``batch_generate``: each row's tokens and finish reason.

    An EOS token ends its row (``"stop"``) and is not included.
    """
    rows = _run_rows(
        model,
        None,
        prompts,
        max_tokens,
        dict(params=params, prefill_step_size=prefill_step_size, eos=eos),
    )
    out = []
    for tokens, reason, *_ in rows:
        if reason == "stop" and tokens and tokens[-1] in eos:
            tokens = tokens[:-1]
        out.append((tokens, reason))
    return out


def batch_generate(
    model: Model,
    tokenizer: Tokenizer,
    prompts: Sequence[str | Sequence[int]],
    *,
    max_tokens: int | Sequence[int] = DEFAULT_MAX_TOKENS,
    stop: Sequence[str] = (),
    prefill_step_size: int | None = None,
    kv_bits: int | None = None,
    kv_group_size: int | None = None,
    quantized_kv_start: int = 0,
    kv_codec: str | None = None,
    max_kv_size: int | None = None,
    sampler: Callable[[mx.array], mx.array] | None = None,
    logits_processors: Sequence[Callable[[mx.array, mx.array], mx.array]] | None = None,
    draft_model: Model | str | None = None,
    num_draft_tokens: int = 3,
    draft: str | None = None,
    adapters: Sequence[str | None] | None = None,
    verbose: bool = False,
    **sampling: Any,
) -> BatchResponse:
    """Generate for several prompts at once; a :class:`BatchResponse` (one result per prompt).

    Takes what :func:`~mlx_loom.generation.stream_generate` takes, applied to
    every prompt (``max_tokens`` may also be one per prompt). ``adapters``
    names each prompt's registered adapter (``None``: the base model); rows
    with different adapters share the batch. A row's text
    excludes the EOS token and any stop string, exactly as its stream would.
    With ``draft_model`` or ``draft="ngram"`` every row speculates, and the
    speculative rows still decode as one batch (each keeps its own drafts).
    """
    params = sampling_params(sampling)
    spec = speculation_for(draft_model, draft, num_draft_tokens)
    started = time.perf_counter()
    rows = _run_rows(
        model,
        tokenizer,
        prompts,
        max_tokens,
        dict(
            params=params,
            stop=stop,
            prefill_step_size=prefill_step_size,
            kv_bits=kv_bits,
            kv_group_size=kv_group_size,
            quantized_kv_start=quantized_kv_start,
            kv_codec=kv_codec,
            max_kv_size=max_kv_size,
            sampler=sampler,
            logits_processors=logits_processors,
            speculation=spec,
        ),
        adapters,
    )
    eos = tokenizer.eos_token_ids
    results = []
    for tokens, reason, logprobs, text, _ in rows:
        if reason == "stop" and tokens and tokens[-1] in eos:
            tokens, logprobs = tokens[:-1], logprobs[:-1]
        results.append(BatchResult(tokens, text, reason, logprobs))
    stats = BatchStats(
        prompt_tokens=sum(r[4] for r in rows),
        generation_tokens=sum(len(r[0]) for r in rows),
        seconds=time.perf_counter() - started,
        peak_memory=mx.get_peak_memory() / 1e9,
    )
    if verbose:
        print(
            f"Prompt: {stats.prompt_tokens} tokens; generation: {stats.generation_tokens} tokens, "
            f"{stats.generation_tps:.3f} tokens-per-sec; peak memory: {stats.peak_memory:.3f} GB"
        )
    return BatchResponse(results, stats)
