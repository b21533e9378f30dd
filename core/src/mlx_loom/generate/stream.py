"""``stream_generate`` and ``generate``: text in, streamed text out.

Shaped like mlx-lm's functions of the same names. Every request parameter is
validated before any forward runs, so a bad request never wastes a prefill.
The stream never emits broken UTF-8 (the detokenizer holds partial
characters back) and never emits any part of a stop string (text that could
still become one is held back until it is disambiguated).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from ..cache import validate_kv_quantization
from ..errors import RequestError
from ..host import KV_QUANTIZATION
from ..model import Model
from ..text import StopStrings, Tokenizer
from .loop import KVQuantization, StepLog, generate_tokens
from .params import SamplingParams
from .prompt_cache import PromptCache
from .sampling import logprobs_top_k, make_logits_processors, make_sampler
from .speculative import speculative_generate_tokens

DEFAULT_MAX_TOKENS = 256
DEFAULT_PREFILL_STEP = 2048


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


def encode_prompt(tokenizer: Tokenizer, prompt: str | Sequence[int]) -> list[int]:
    """Token ids for ``prompt``; refuse an empty one."""
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError(
                "The prompt is empty.", fix="Pass a non-empty prompt (text or token ids)."
            )
        bos = tokenizer.bos_token
        add_special = bos is None or not prompt.startswith(bos)
        ids = tokenizer.encode(prompt, add_special_tokens=add_special)
    else:
        ids = [int(t) for t in prompt]
    if not ids:
        raise RequestError(
            "The prompt encodes to no tokens.", fix="Pass a non-empty prompt (text or token ids)."
        )
    return ids


def _check_request(
    model: Model,
    prompt_ids: Sequence[int],
    *,
    max_tokens: int,
    prefill_step_size: int,
    kv_bits: int | None,
    kv_group_size: int,
    quantized_kv_start: int,
    params: SamplingParams,
) -> None:
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise RequestError(
            f"max_tokens={max_tokens!r} is invalid; it must be an int >= 1.",
            fix="Pass a positive max_tokens.",
        )
    if (
        isinstance(prefill_step_size, bool)
        or not isinstance(prefill_step_size, int)
        or prefill_step_size < 1
    ):
        raise RequestError(
            f"prefill_step_size={prefill_step_size!r} is invalid; it must be an int >= 1.",
            fix="Pass a positive prefill_step_size (default 2048).",
        )
    validate_kv_quantization(
        kv_bits=kv_bits, kv_group_size=kv_group_size, quantized_kv_start=quantized_kv_start
    )
    if kv_bits is not None:
        model.require(KV_QUANTIZATION, asked=f"kv_bits={kv_bits}")
    vocab = model.vocab_size
    if vocab is not None:
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(
                f"The prompt holds token id(s) {bad[:5]} outside the vocabulary (size {vocab}).",
                fix="Encode the prompt with this model's tokenizer.",
            )
        params.validate_logit_bias(vocab)
    limit = model.context_length
    if limit is not None and len(prompt_ids) > limit:
        raise RequestError(
            f"The prompt is {len(prompt_ids)} tokens long; the model's context "
            f"(max_position_embeddings) is {limit} tokens.",
            fix="Shorten the prompt.",
        )


def stream_generate(
    model: Model,
    tokenizer: Tokenizer,
    prompt: str | Sequence[int],
    *,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    stop: Sequence[str] = (),
    prompt_cache: PromptCache | None = None,
    prefill_step_size: int = DEFAULT_PREFILL_STEP,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = 0,
    draft_model: Model | None = None,
    num_draft_tokens: int = 3,
    **sampling: Any,
) -> Iterator[GenerationResponse]:
    """Generate from ``prompt``, yielding a :class:`GenerationResponse` per token.

    ``sampling`` takes the :class:`SamplingParams` fields (``temperature``
    (or ``temp``), ``top_p``, ``top_k``, ``min_p``, penalties, ``logit_bias``,
    ``seed``, ``logprobs``). Pass a :class:`PromptCache` to reuse the longest
    usable prefix of an earlier call's caches. ``draft_model`` turns on
    speculative decoding (``num_draft_tokens`` proposals per step; the draft
    must share the tokenizer). The last response carries
    ``finish_reason``: ``"stop"`` (EOS or a stop string) or ``"length"``.
    """
    if "temp" in sampling:
        sampling["temperature"] = sampling.pop("temp")
    params = SamplingParams.parse(**sampling)
    prompt_ids = encode_prompt(tokenizer, prompt)
    _check_request(
        model,
        prompt_ids,
        max_tokens=max_tokens,
        prefill_step_size=prefill_step_size,
        kv_bits=kv_bits,
        kv_group_size=kv_group_size,
        quantized_kv_start=quantized_kv_start,
        params=params,
    )
    log = StepLog()
    if draft_model is not None:
        if (
            prompt_cache is not None
            or kv_bits is not None
            or params.logprobs
            or (
                params.repetition_penalty
                or params.presence_penalty
                or params.frequency_penalty
                or params.logit_bias
            )
        ):
            raise RequestError(
                "Speculative decoding does not combine with prompt caches, KV quantization, "
                "logprobs, penalties or logit bias yet.",
                fix="Drop draft_model, or drop those options.",
            )
        to_feed, cached = prompt_ids, 0
        tokens = (
            (t, lp, d)
            for t, lp, d in speculative_generate_tokens(
                model,
                draft_model,
                prompt_ids,
                num_draft=num_draft_tokens,
                max_tokens=max_tokens,
                sampler=make_sampler(params),
                prefill_step_size=prefill_step_size,
            )
        )
    else:
        if prompt_cache is None:
            prompt_cache = PromptCache(model)
        elif prompt_cache.model is not model:
            raise RequestError(
                "The prompt cache was made for another model.",
                fix="Use a PromptCache created for this model.",
            )
        to_feed = prompt_cache.prepare(prompt_ids)
        cached = len(prompt_cache.tokens)
        tokens = (
            (t, lp, False)
            for t, lp in generate_tokens(
                model,
                to_feed,
                prompt_cache.cache,
                sampler=make_sampler(params),
                processors=make_logits_processors(params),
                history=prompt_cache.tokens[:],
                max_tokens=max_tokens,
                prefill_step_size=prefill_step_size,
                kv=KVQuantization(kv_bits, kv_group_size, quantized_kv_start),
                log=log,
            )
        )
    detok = tokenizer.detokenizer()
    stops = StopStrings(stop)
    eos = tokenizer.eos_token_ids
    start = time.perf_counter()
    prompt_tps = gen_start = 0.0
    n = 0
    try:
        for n, (token, logprobs, from_draft) in enumerate(tokens, start=1):
            if n == 1:
                gen_start = time.perf_counter()
                prompt_tps = len(to_feed) / max(gen_start - start, 1e-9)
            finish = None
            if token in eos:
                finish = "stop"
                detok.finalize()
            else:
                detok.add_token(token)
                if n == max_tokens:
                    detok.finalize()
                    finish = "length"
            check = stops.feed(detok.last_segment)
            text, hit = check.emit, check.stop
            if hit is not None:
                finish = "stop"
            elif finish is not None:
                text += stops.flush()
            response = _response(
                text,
                token,
                logprobs,
                params.logprobs,
                n,
                len(prompt_ids),
                prompt_tps,
                gen_start,
                cached,
                finish,
                hit,
            )
            response.from_draft = from_draft
            yield response
            if finish is not None:
                break
    finally:
        tokens.close()
        if prompt_cache is not None:
            prompt_cache.record(log.fed)


def _response(
    text: str,
    token: int,
    logprobs: mx.array,
    top_k: int,
    n: int,
    prompt_tokens: int,
    prompt_tps: float,
    gen_start: float,
    cached: int,
    finish: str | None,
    stop: str | None,
) -> GenerationResponse:
    top: list[tuple[int, float]] = []
    if top_k:
        ids, values = logprobs_top_k(logprobs[None], top_k)
        top = list(zip(ids[0].tolist(), values[0].tolist(), strict=True))
    elapsed = max(time.perf_counter() - gen_start, 1e-9)
    return GenerationResponse(
        text=text,
        token=token,
        logprob=logprobs[token].item(),
        logprobs=logprobs,
        top_logprobs=top,
        prompt_tokens=prompt_tokens,
        prompt_tps=prompt_tps,
        generation_tokens=n,
        generation_tps=n / elapsed,
        peak_memory=mx.get_peak_memory() / 1e9,
        cached_tokens=cached,
        finish_reason=finish,
        stop=stop,
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
