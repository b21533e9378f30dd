"""``stream_generate`` and ``generate``: text in, streamed text out, through the engine.

Shaped like mlx-lm's functions of the same names (and accepting its
``sampler=``, ``logits_processors=`` and ``max_kv_size=``). Every request
parameter is validated on the calling thread before anything is queued, so a
bad request never wastes a prefill. The request then runs on the model's
engine (:mod:`mlx_loom.engine`), alone or batched with whatever else runs on
that model, with the same tokens either way. The stream never emits broken
UTF-8 (the detokenizer holds partial characters back) and never emits any
part of a stop string (text that could still become one is held back until
it is disambiguated). Generation stops at the model's context
(``finish_reason="length"``); a prompt that fills the context is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from ..engine.constraints import from_options
from ..engine.params import SamplingParams
from ..engine.request import encode_prompt, make_request, speculation
from ..errors import RequestError
from ..model import Model
from ..text import Tokenizer
from .prompt_cache import PromptCache

DEFAULT_MAX_TOKENS = 256

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "GenerationResponse",
    "encode_prompt",
    "generate",
    "sampling_params",
    "stream_generate",
]


@dataclass
class GenerationResponse:
    """One streamed piece of a generation.

    ``text`` is the new text (possibly empty while a character or a possible
    stop string is held back). ``logprobs`` is the full log-probability vector
    the token was sampled from; ``top_logprobs`` the requested alternatives.
    Speeds are tokens per second; ``peak_memory`` is in GB.
    """

    text: str
    token: int
    logprob: float
    logprobs: mx.array
    top_logprobs: list[tuple[int, float]]
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float
    cached_tokens: int = 0
    from_draft: bool = False
    finish_reason: str | None = None
    stop: str | None = field(default=None)


def sampling_params(sampling: dict[str, Any]) -> SamplingParams:
    """:class:`SamplingParams` from keyword options (``temp`` is mlx-lm's ``temperature``)."""
    if "temp" in sampling:
        sampling = dict(sampling)
        sampling["temperature"] = sampling.pop("temp")
    return SamplingParams.parse(**sampling)


def stream_generate(
    model: Model,
    tokenizer: Tokenizer,
    prompt: str | Sequence[int],
    *,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    stop: Sequence[str] = (),
    prompt_cache: PromptCache | None = None,
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
    adapter: str | None = None,
    response_format: Any = None,
    grammar: str | None = None,
    **sampling: Any,
) -> Generator[GenerationResponse, None, None]:
    """Generate from ``prompt``, yielding a :class:`GenerationResponse` per token.

    ``sampling`` takes the :class:`SamplingParams` fields (``temperature``
    (or ``temp``), ``top_p``, ``top_k``, ``min_p``, penalties, ``logit_bias``,
    ``seed``, ``logprobs``); ``sampler`` and ``logits_processors`` take
    mlx-lm-style callables instead (processors run after the built-in
    penalties; with ``sampler``, ``seed`` seeds MLX's generator, which
    mlx-lm's samplers draw from). ``max_kv_size`` bounds each attention layer's cache to a
    sliding window of that many tokens. Pass a :class:`PromptCache` to reuse
    the longest usable prefix of an earlier call's caches (one generation at
    a time per cache). ``draft_model`` (a loaded model sharing the tokenizer)
    or ``draft="ngram"`` (prompt lookup, no second model) or ``draft="mtp"``
    (the model's own multi-token-prediction head, where the checkpoint ships
    one) turns on speculative
    decoding with ``num_draft_tokens`` proposals per step; it combines with
    every other option but ``adapter``, and greedy output is the same as
    without it. ``adapter`` names one of the adapters registered on the model
    (:class:`~mlx_loom.adapters.AdapterSet`) to run this request with, batched
    with requests that use others. ``response_format`` (OpenAI's shape:
    ``{"type": "json_schema", "json_schema": {"schema": ...}}`` or
    ``{"type": "json_object"}``) or ``grammar`` (Lark or GBNF text)
    constrains the output during decoding. The last response carries
    ``finish_reason``: ``"stop"`` (EOS or a stop string) or ``"length"``
    (``max_tokens``, or the context).
    """
    params = sampling_params(sampling)
    ids = encode_prompt(tokenizer, prompt)
    options: dict[str, Any] = dict(
        max_tokens=max_tokens,
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
        logprobs_vector=True,
        adapter=adapter,
        constraint=from_options(tokenizer, response_format=response_format, grammar=grammar),
    )
    options["speculation"] = speculation_for(draft_model, draft, num_draft_tokens)
    if prompt_cache is None:
        request = make_request(model, tokenizer, ids, **options)
        handle = model.engine.submit(request)
        try:
            yield from _responses(handle)
        finally:
            handle.cancel()
        return
    if prompt_cache.model is not model:
        raise RequestError(
            "The prompt cache was made for another model.",
            fix="Use a PromptCache created for this model.",
        )
    with prompt_cache.claim():
        prompt_cache.check_options(max_kv_size=max_kv_size)
        make_request(model, tokenizer, ids, **options)  # validate before touching the cache
        to_feed = prompt_cache.prepare(ids)
        request = make_request(
            model,
            tokenizer,
            to_feed,
            cache=prompt_cache.cache,
            history=list(prompt_cache.tokens),
            checkpoints=True,
            **options,
        )
        handle = model.engine.submit(request)
        try:
            yield from _responses(handle)
        finally:
            handle.cancel()
            done = handle.wait()
            prompt_cache.finish(done)


def speculation_for(draft_model: Any, draft: str | None, num_draft_tokens: int) -> Any:
    """The request's :class:`~mlx_loom.engine.Speculation` from the API's keywords."""
    if draft is not None and draft_model is not None:
        raise RequestError(
            "Both draft_model= and draft= were given; a request has one drafter.",
            fix="Pass draft_model=<a loaded model> or draft='ngram', not both.",
        )
    return speculation(draft_model if draft is None else draft, num_draft_tokens)


def _responses(handle: Any) -> Iterator[GenerationResponse]:
    for event in handle:
        yield GenerationResponse(
            text=event.text,
            token=event.token,
            logprob=event.logprob,
            logprobs=event.logprobs,
            top_logprobs=event.top_logprobs,
            prompt_tokens=event.prompt_tokens,
            prompt_tps=event.prompt_tps,
            generation_tokens=event.generation_tokens,
            generation_tps=event.generation_tps,
            peak_memory=event.peak_memory,
            cached_tokens=event.cached_tokens,
            from_draft=event.from_draft,
            finish_reason=event.finish_reason,
            stop=event.stop,
        )


def generate(
    model: Model,
    tokenizer: Tokenizer,
    prompt: str | Sequence[int],
    *,
    verbose: bool = False,
    **options: Any,
) -> str:
    """Generate and return the whole text (``verbose`` prints it as it streams)."""
    text = []
    last: GenerationResponse | None = None
    for last in stream_generate(model, tokenizer, prompt, **options):
        if verbose:
            print(last.text, end="", flush=True)
        text.append(last.text)
    if verbose and last is not None:
        print()
        print(f"Prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.3f} tokens-per-sec")
        print(
            f"Generation: {last.generation_tokens} tokens, {last.generation_tps:.3f} tokens-per-sec"
        )
        print(f"Peak memory: {last.peak_memory:.3f} GB")
    return "".join(text)
