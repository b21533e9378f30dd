"""A generation request as the engine receives it: validated, plain data.

Everything a request carries is either plain Python (token ids, numbers,
strings, a frozen :class:`~mlx_loom.generate.SamplingParams`) or an object
the engine only calls on its own thread (the tokenizer, user callables). No
request holds an MLX graph built on another thread: MLX graphs are bound to
the streams of the thread that built them, so the engine builds every array a
request needs (sampler keys, penalty windows) itself.

:func:`make_request` is the one place a request's options are checked. It
runs on the caller's thread before anything is queued, so a bad request
fails at once with a :class:`~mlx_loom.errors.RequestError` (or a refusal)
and never costs a forward.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from mlx_loom.cache import maybe_quantize_kv_cache, resolve_kv_codec, validate_kv_quantization
from mlx_loom.capabilities import KV_QUANTIZATION, SPECULATIVE
from mlx_loom.engine.caches import fresh_caches
from mlx_loom.engine.params import SamplingParams
from mlx_loom.errors import AdapterError, ParallelRefused, RequestError
from mlx_loom.text import StopStrings

if TYPE_CHECKING:
    from mlx_loom.model import Model
    from mlx_loom.text import Tokenizer

#: The most draft tokens one verify window may hold.
MAX_DRAFT = 32

#: ``sampler(logprobs [1, V]) -> token [1]`` (mlx-lm's sampler signature).
SamplerFn = Callable[[mx.array], mx.array]
#: ``processor(tokens_so_far [T], logits [1, V]) -> logits [1, V]`` (mlx-lm's).
ProcessorFn = Callable[[mx.array, mx.array], mx.array]


@dataclass(frozen=True)
class KVQuantization:
    """When and how to switch KV caches to a codec's storage.

    ``codec`` names the codec (``None``: affine, mlx-lm's ``kv_bits``);
    ``bits`` is the resolved width (``None``: no KV quantization). ``kinds``
    is the model's cache-kind table, where plugin codecs come from.
    """

    bits: int | None = None
    group_size: int = 64
    start: int = 0
    codec: str | None = None
    kinds: Mapping[str, type] | None = field(default=None, compare=False, repr=False)

    def apply(self, cache: list[Any]) -> None:
        if self.bits is None:  # runs after every forward: the common case costs nothing
            return
        if not any(_convertible(c) for c in cache):  # every cache converted already
            return
        maybe_quantize_kv_cache(
            cache,
            kv_bits=self.bits,
            kv_group_size=self.group_size,
            quantized_kv_start=self.start,
            kv_codec=self.codec,
            kinds=self.kinds,
        )


def _convertible(cache: Any) -> bool:
    """A plain KV cache a codec may still take (not recurrent state, not already coded)."""
    return hasattr(cache, "to_quantized") and not isinstance(getattr(cache, "codec", None), str)


#: The drafting modes a request may ask for by name.
DRAFT_MODES = ("ngram",)


@dataclass(frozen=True)
class Speculation:
    """Speculative decoding for one request: who drafts, and how far ahead.

    ``draft`` is a draft model sharing the target's tokenizer, or ``None``
    for prompt lookup: drafts are the tokens that followed the latest earlier
    occurrence of the sequence's last ``ngram_max`` .. ``ngram_min`` tokens
    (vLLM's ``ngram`` method; no second model needed).
    """

    draft: Model | None = None
    num_draft: int = 3
    ngram_max: int = 3
    ngram_min: int = 1

    @property
    def mode(self) -> str:
        return "model" if self.draft is not None else "ngram"


def speculation(draft_model: Model | str | None, num_draft_tokens: int = 3) -> Speculation | None:
    """The :class:`Speculation` a door's options ask for (``None``: no speculation).

    ``draft_model`` is a loaded draft :class:`~mlx_loom.model.Model` or the
    name of a drafting mode (``"ngram"``).
    """
    if draft_model is None:
        return None
    if isinstance(draft_model, str):
        if draft_model not in DRAFT_MODES:
            raise RequestError(
                f"draft={draft_model!r} is not a drafting mode (known: {', '.join(DRAFT_MODES)}).",
                fix="Pass draft='ngram' for prompt-lookup drafting, or a loaded draft model.",
            )
        return Speculation(None, num_draft_tokens)
    return Speculation(draft_model, num_draft_tokens)


@dataclass(frozen=True, eq=False)
class Request:
    """One validated generation request (build it with :func:`make_request`).

    ``cache`` (with ``history``, the tokens it already holds) is a caller-owned
    list of per-layer caches the engine continues in place; ``None`` means the
    engine provides the caches (from its prefix store, or fresh).
    ``limit`` is ``max_tokens`` capped by the room the context leaves.
    """

    prompt: tuple[int, ...]
    max_tokens: int
    limit: int
    params: SamplingParams
    stop: tuple[str, ...] = ()
    tokenizer: Tokenizer | None = None
    eos: frozenset[int] = frozenset()
    prefill_step_size: int | None = None
    kv: KVQuantization = KVQuantization()
    max_kv_size: int | None = None
    sampler: SamplerFn | None = None
    logits_processors: tuple[ProcessorFn, ...] = ()
    cache: list[Any] | None = field(default=None, repr=False)
    history: tuple[int, ...] = ()
    logprobs_vector: bool = False
    speculation: Speculation | None = None
    #: The name of one of the model's registered adapters
    #: (:class:`~mlx_loom.adapters.AdapterSet`) this request runs with;
    #: ``None``: the base model.
    adapter: str | None = None


def encode_prompt(tokenizer: Tokenizer | None, prompt: str | Sequence[int]) -> list[int]:
    """Token ids for ``prompt``; refuse an empty one."""
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError(
                "The prompt is empty.", fix="Pass a non-empty prompt (text or token ids)."
            )
        if tokenizer is None:
            raise RequestError(
                "A text prompt needs a tokenizer.", fix="Pass token ids, or the model's tokenizer."
            )
        ids = tokenizer.encode_prompt(prompt)  # BOS unless the text starts with it
    else:
        try:
            ids = [_token_id(t) for t in prompt]
        except (TypeError, ValueError):
            raise RequestError(
                "The prompt must be text or a sequence of integer token ids.",
                fix="Pass a string, or a list of ints from this model's tokenizer.",
            ) from None
    if not ids:
        raise RequestError(
            "The prompt encodes to no tokens.", fix="Pass a non-empty prompt (text or token ids)."
        )
    return ids


def _token_id(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, mx.array) and value.ndim == 0:
            return int(value.item())
        raise TypeError(value)
    return int(value)


def _positive_int(name: str, value: Any, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RequestError(f"{name}={value!r} is invalid; it must be an int >= 1.", fix=fix)
    return value


def context_room(model: Model, prompt_len: int) -> int | None:
    """How many tokens may follow a prompt of ``prompt_len`` (``None``: no known bound).

    The context (``max_position_embeddings``) bounds the whole sequence,
    prompt and generated tokens together, as in the OpenAI API and vLLM. A
    prompt that fills the context leaves no room and is refused.
    """
    limit = model.context_length
    if limit is None:
        return None
    if prompt_len >= limit:
        raise RequestError(
            f"The prompt is {prompt_len} tokens long; the model's context "
            f"(max_position_embeddings) is {limit} tokens, which leaves no room for a new token.",
            fix=f"Shorten the prompt to fewer than {limit} tokens.",
        )
    return limit - prompt_len


def make_request(
    model: Model,
    tokenizer: Tokenizer | None,
    prompt: str | Sequence[int],
    *,
    max_tokens: int = 256,
    params: SamplingParams | None = None,
    stop: Sequence[str] = (),
    prefill_step_size: int | None = None,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = 0,
    kv_codec: str | None = None,
    max_kv_size: int | None = None,
    sampler: SamplerFn | None = None,
    logits_processors: Sequence[ProcessorFn] | None = None,
    cache: list[Any] | None = None,
    history: Sequence[int] = (),
    logprobs_vector: bool = False,
    speculation: Speculation | None = None,
    eos: frozenset[int] | None = None,
    adapter: str | None = None,
) -> Request:
    """Check every option of a request against ``model``; return the :class:`Request`.

    Raises :class:`~mlx_loom.errors.RequestError` for a bad value and a
    :class:`~mlx_loom.errors.Refusal` for what the model cannot do, before
    any work is queued.
    """
    params = params if params is not None else SamplingParams()
    ids = encode_prompt(tokenizer, prompt)
    _positive_int("max_tokens", max_tokens, "Pass a positive max_tokens.")
    if prefill_step_size is not None:
        _positive_int(
            "prefill_step_size", prefill_step_size, "Pass a positive prefill_step_size (2048)."
        )
    kinds = model.binding.cache_kinds
    validate_kv_quantization(
        kv_bits=kv_bits,
        kv_group_size=kv_group_size,
        quantized_kv_start=quantized_kv_start,
        kv_codec=kv_codec,
        kinds=kinds,
    )
    codec, kv_bits = resolve_kv_codec(kv_codec, kv_bits, kinds=kinds)
    if kv_bits is not None:
        asked = f"kv_bits={kv_bits}" + (f", kv_codec={kv_codec!r}" if kv_codec else "")
        model.require(KV_QUANTIZATION, asked=asked)
    if max_kv_size is not None:
        _positive_int(
            "max_kv_size", max_kv_size, "Pass the most tokens each attention layer may keep."
        )
    if codec is not None and codec.name != "affine":
        codec.check_storable(fresh_caches(model, max_kv_size))
    vocab = model.vocab_size
    if vocab is not None:
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(
                f"The prompt holds token id(s) {bad[:5]} outside the vocabulary (size {vocab}).",
                fix="Encode the prompt with this model's tokenizer.",
            )
        params.validate_logit_bias(vocab)
    room = context_room(model, len(ids) + len(history))
    limit = max_tokens if room is None else min(max_tokens, room)
    StopStrings(stop)  # refuses empty stop strings, by name
    if stop and tokenizer is None:
        raise RequestError(
            "Stop strings need the tokenizer, to see the text being generated.",
            fix="Pass the model's tokenizer, or stop on token ids (eos) instead.",
        )
    if sampler is not None:
        if not callable(sampler):
            raise RequestError(
                f"sampler={sampler!r} is not callable.",
                fix="Pass a function logprobs [1, vocab] -> token [1], as mlx-lm's samplers are.",
            )
        moved = [
            name
            for name in ("temperature", "top_p", "top_k", "min_p", "min_tokens_to_keep")
            if getattr(params, name) != SamplingParams.model_fields[name].default
        ]
        if moved:
            raise RequestError(
                f"Both sampler= and {', '.join(moved)} were given; a custom sampler decides "
                "the token itself, so those settings would be ignored.",
                fix=f"Drop {', '.join(moved)}, or drop sampler= and use the built-in sampler.",
            )
    processors = tuple(logits_processors or ())
    for i, proc in enumerate(processors):
        if not callable(proc):
            raise RequestError(
                f"logits_processors[{i}]={proc!r} is not callable.",
                fix="Pass functions (tokens, logits) -> logits, as mlx-lm's processors are.",
            )
    if speculation is not None:
        _check_speculation(model, speculation, sampler=sampler)
    if adapter is not None:
        _check_adapter(model, adapter, speculation)
    return Request(
        prompt=tuple(ids),
        max_tokens=max_tokens,
        limit=limit,
        params=params,
        stop=tuple(stop),
        tokenizer=tokenizer,
        eos=eos if eos is not None else (tokenizer.eos_token_ids if tokenizer else frozenset()),
        prefill_step_size=prefill_step_size,
        kv=KVQuantization(
            kv_bits,
            kv_group_size,
            quantized_kv_start,
            codec=None if codec is None or codec.name == "affine" else codec.name,
            kinds=kinds,
        ),
        max_kv_size=max_kv_size,
        sampler=sampler,
        logits_processors=processors,
        cache=cache,
        history=tuple(history),
        logprobs_vector=logprobs_vector,
        speculation=speculation,
        adapter=adapter,
    )


def _check_adapter(model: Model, adapter: Any, speculation: Speculation | None) -> None:
    """``adapter`` must name one of the model's registered adapters (it never loads one)."""
    adapters = model.adapter_set
    if adapters is None:
        raise AdapterError(
            f"The request asks for adapter {adapter!r}, but this model has no adapters registered.",
            fix="Register adapters on the model first (mlx_loom.adapters.AdapterSet, or "
            "`loom serve --adapter NAME=PATH`), or drop adapter=.",
        )
    if not isinstance(adapter, str):
        raise RequestError(
            f"adapter={adapter!r} is not an adapter name.",
            fix=f"Pass one of {list(adapters.names)}, or None for the base model.",
        )
    adapters.slot(adapter)  # an unknown name is refused, naming the registered ones
    if speculation is not None:
        raise RequestError(
            "Speculative decoding does not combine with a per-request adapter yet: the "
            "speculative decode step runs the base model.",
            fix="Drop draft_model, or drop adapter=.",
        )


def _check_speculation(
    model: Model,
    spec: Speculation,
    *,
    sampler: SamplerFn | None,
) -> None:
    model.require(SPECULATIVE, asked="speculative decoding")
    if getattr(model, "parallel", None) is not None:
        # The other ranks rebuild each request from a plain description; a
        # drafter (and its own model) is not part of it, so they would diverge.
        raise ParallelRefused(
            "Speculative decoding is not supported for a model split across ranks "
            f"(--parallel {model.parallel.mode}).",
            fix="Drop the draft (draft_model / --draft-model / --draft), or run the model in "
            "one process.",
        )
    if spec.draft is not None:
        spec.draft.require(SPECULATIVE, asked="speculative decoding (draft model)")
        if model.vocab_size != spec.draft.vocab_size:
            raise RequestError(
                f"The draft model's vocabulary ({spec.draft.vocab_size}) differs from the "
                f"model's ({model.vocab_size}).",
                fix="Use a draft model that shares the main model's tokenizer.",
            )
    n = spec.num_draft
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_DRAFT:
        raise RequestError(
            f"num_draft_tokens={n!r} is invalid; it must be an int from 1 to {MAX_DRAFT}.",
            fix=f"Pass num_draft_tokens between 1 and {MAX_DRAFT} (3 is a good start).",
        )
    for name in ("ngram_max", "ngram_min"):
        v = getattr(spec, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise RequestError(
                f"{name}={v!r} is invalid; it must be an int >= 1.",
                fix="Pass n-gram sizes such as ngram_max=3, ngram_min=1.",
            )
    if spec.ngram_min > spec.ngram_max:
        raise RequestError(
            f"ngram_min={spec.ngram_min} is larger than ngram_max={spec.ngram_max}.",
            fix="Pass ngram_min <= ngram_max.",
        )
    if sampler is not None:
        raise RequestError(
            "Speculative decoding does not combine with a custom sampler=: accepting or "
            "rejecting a draft needs the distribution the token is drawn from, which a custom "
            "sampler does not expose.",
            fix="Use the built-in sampling settings (temperature, top_p, top_k, min_p), or "
            "drop the draft.",
        )
