"""A generation request as the engine receives it: validated, plain data.

Everything a request carries is either plain Python (token ids, numbers,
strings, a frozen :class:`~mlx_loom.engine.params.SamplingParams`) or an object
the engine only calls on its own thread (the tokenizer, user callables). No
request holds an MLX graph built on another thread: MLX graphs are bound to
the streams of the thread that built them, so the engine builds every array a
request needs (sampler keys, penalty windows) itself.

:func:`make_request` is the one place a request's options are checked. It
runs on the caller's thread before anything is queued, so a bad request
fails at once with a :class:`~mlx_loom.errors.RequestError` (or a refusal)
and never costs a forward. Each error names the request field at fault
(``param``) and a one-word ``code``, which is all a front end needs to
answer in its own format: the server checks only what its wire format adds
(JSON shape, its own limits, chat templates) and maps these errors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx

from mlx_loom.cache import maybe_quantize_kv_cache, resolve_kv_codec, validate_kv_quantization
from mlx_loom.cache.convert import convertible
from mlx_loom.capabilities import KV_QUANTIZATION, SPECULATIVE
from mlx_loom.engine.caches import fresh_caches
from mlx_loom.engine.constraints import Constraint, check_constraint
from mlx_loom.engine.kv_groups import kv_group_size_for
from mlx_loom.engine.params import MAX_INT_OPTION, SamplingParams
from mlx_loom.errors import AdapterError, CapabilityRefused, ParallelRefused, RequestError
from mlx_loom.text import StopStrings

if TYPE_CHECKING:
    from mlx_loom.model import Model
    from mlx_loom.text import Tokenizer

#: The most draft tokens one verify window may hold.
MAX_DRAFT = 32

#: The bounds of a request's integer fields, ``name: (least, most)`` (``None``:
#: unbounded), each checked by :func:`_int_field`. Every bound on such a field
#: is declared here, and listed in ``docs/limits.md``.
INT_BOUNDS: dict[str, tuple[int, int | None]] = {
    # Counts the engine keeps in int32 arrays (as the sampling counts are).
    "max_tokens": (1, MAX_INT_OPTION),
    "prefill_step_size": (1, MAX_INT_OPTION),
    "max_kv_size": (1, MAX_INT_OPTION),
    "num_draft_tokens": (1, MAX_DRAFT),
    "ngram_max": (1, MAX_INT_OPTION),
    "ngram_min": (1, MAX_INT_OPTION),
}

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
        if not any(convertible(c) for c in cache):  # every cache converted already
            return
        maybe_quantize_kv_cache(
            cache,
            kv_bits=self.bits,
            kv_group_size=self.group_size,
            quantized_kv_start=self.start,
            kv_codec=self.codec,
            kinds=self.kinds,
        )


#: The drafting modes a request may ask for by name.
DRAFT_MODES = ("ngram", "mtp")


@dataclass(frozen=True)
class Speculation:
    """Speculative decoding for one request: who drafts, and how far ahead.

    ``draft`` is a draft model sharing the target's tokenizer; with ``mtp``
    the model drafts with its own multi-token-prediction head
    (:mod:`mlx_loom.engine.mtp`); with neither, prompt lookup: drafts are the
    tokens that followed the latest earlier occurrence of the sequence's last
    ``ngram_max`` .. ``ngram_min`` tokens (vLLM's ``ngram`` method; no second
    model needed).
    """

    draft: Model | None = None
    num_draft: int = 3
    ngram_max: int = 3
    ngram_min: int = 1
    mtp: bool = False

    @property
    def mode(self) -> str:
        if self.draft is not None:
            return "model"
        return "mtp" if self.mtp else "ngram"


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
                fix="Pass draft='ngram' for prompt-lookup drafting, draft='mtp' for the "
                "model's own multi-token-prediction head, or a loaded draft model.",
                param="draft",
            )
        return Speculation(None, num_draft_tokens, mtp=draft_model == "mtp")
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
    #: Structured output: the grammar every generated token must follow
    #: (:mod:`mlx_loom.engine.constraints`); ``None``: unconstrained.
    constraint: Constraint | None = None
    #: Keep checkpoints of caches that cannot trim at the turn boundaries of
    #: this prompt and hand them back in :class:`~mlx_loom.engine.Done`
    #: (a :class:`~mlx_loom.generation.PromptCache` asks, to step back a turn).
    checkpoints: bool = False


def encode_prompt(tokenizer: Tokenizer | None, prompt: str | Sequence[int]) -> list[int]:
    """Token ids for ``prompt``; refuse an empty one."""
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError(
                "The prompt is empty.",
                fix="Pass a non-empty prompt (text or token ids).",
                param="prompt",
                code="empty_prompt",
            )
        if tokenizer is None:
            raise RequestError(
                "A text prompt needs a tokenizer.",
                fix="Pass token ids, or the model's tokenizer.",
                param="prompt",
            )
        ids = tokenizer.encode_prompt(prompt)  # BOS unless the text starts with it
    else:
        try:
            ids = [_token_id(t) for t in prompt]
        except (TypeError, ValueError):
            raise RequestError(
                "The prompt must be text or a sequence of integer token ids.",
                fix="Pass a string, or a list of ints from this model's tokenizer.",
                param="prompt",
            ) from None
    if not ids:
        raise RequestError(
            "The prompt encodes to no tokens.",
            fix="Pass a non-empty prompt (text or token ids).",
            param="prompt",
            code="empty_prompt",
        )
    return ids


def _token_id(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, mx.array) and value.ndim == 0:
            return int(cast(int, value.item()))
        raise TypeError(value)
    return int(value)


def _int_field(name: str, value: Any, fix: str) -> int:
    """``value`` if it is an int within the bounds :data:`INT_BOUNDS` declares for ``name``."""
    least, most = INT_BOUNDS[name]
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < least
        or (most is not None and value > most)
    ):
        valid = f">= {least}" if most is None else f"from {least} to {most}"
        raise RequestError(
            f"{name}={value!r} is invalid; it must be an int {valid}.", fix=fix, param=name
        )
    return value


@contextmanager
def _about(param: str) -> Iterator[None]:
    """Name ``param`` in a :class:`RequestError` raised inside that names no field yet."""
    try:
        yield
    except RequestError as err:
        if err.param is None:
            err.param = param
        raise


def _check_vocabulary(ids: Sequence[int], vocab: int) -> None:
    # min/max first: a Python scan of a huge prompt holds the GIL (~0.2 s for
    # 700k ids), stalling every other thread; the builtins take ~10 ms.
    if min(ids) >= 0 and max(ids) < vocab:
        return
    bad = [t for t in ids if not 0 <= t < vocab]
    raise RequestError(
        f"The prompt holds token id(s) {bad[:5]} outside the vocabulary (size {vocab}).",
        fix="Encode the prompt with this model's tokenizer.",
        param="prompt",
        code="invalid_token",
    )


def kv_quantization(
    model: Model,
    *,
    kv_bits: int | None = None,
    kv_group_size: int | None = None,
    quantized_kv_start: int = 0,
    kv_codec: str | None = None,
    max_kv_size: int | None = None,
) -> KVQuantization:
    """The checked :class:`KVQuantization` these options ask of ``model``.

    Part of :func:`make_request`; a front end that fixes these options for
    every request (``loom serve --kv-bits``) calls it once at start-up so a
    bad value fails there, not on the first request.
    """
    kinds = model.binding.cache_kinds
    kv_group_size = kv_group_size_for(model, kv_group_size, kv_bits=kv_bits, kv_codec=kv_codec)
    validate_kv_quantization(
        kv_bits=kv_bits,
        kv_group_size=kv_group_size,
        quantized_kv_start=quantized_kv_start,
        kv_codec=kv_codec,
        kinds=kinds,
    )
    codec, bits = resolve_kv_codec(kv_codec, kv_bits, kinds=kinds)
    if bits is not None:
        asked = f"kv_bits={bits}" + (f", kv_codec={kv_codec!r}" if kv_codec else "")
        model.require(KV_QUANTIZATION, asked=asked)
    if codec is not None and codec.name != "affine":
        codec.check_storable(fresh_caches(model, max_kv_size))
    return KVQuantization(
        bits,
        kv_group_size,
        quantized_kv_start,
        codec=None if codec is None or codec.name == "affine" else codec.name,
        kinds=kinds,
    )


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
            param="prompt",
            code="context_length_exceeded",
        )
    return limit - prompt_len


def _with_xtc_special_tokens(
    params: SamplingParams, tokenizer: Any, eos: frozenset[int], vocab: int | None
) -> SamplingParams:
    """``params`` with the tokens XTC never cuts: the caller's, else EOS and newline.

    mlx-lm's doors protect the same tokens: cutting EOS when it is the likely
    choice would make a reply run on, and cutting the newline would glue lines.
    Ids outside the vocabulary are refused here, where the vocabulary is known.
    """
    if params.xtc_probability == 0 or params.greedy:
        return params
    special = params.xtc_special_tokens
    if special is None:
        newline = tokenizer.encode("\n", add_special_tokens=False) if tokenizer else []
        special = tuple(sorted({*eos, *newline}))
        params = params.model_copy(update={"xtc_special_tokens": special})
    if vocab is not None:
        bad = [t for t in special if t >= vocab]
        if bad:
            raise RequestError(
                f"xtc_special_tokens names token id(s) {bad[:5]} outside this model's "
                f"vocabulary (0..{vocab - 1}).",
                fix="Pass token ids from this model's tokenizer.",
                param="xtc_special_tokens",
            )
    return params


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
    kv_group_size: int | None = None,
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
    constraint: Constraint | None = None,
    checkpoints: bool = False,
) -> Request:
    """Check every option of a request against ``model``; return the :class:`Request`.

    Raises :class:`~mlx_loom.errors.RequestError` for a bad value and a
    :class:`~mlx_loom.errors.Refusal` for what the model cannot do, before
    any work is queued. ``kv_group_size=None`` picks one that fits the
    model's heads (:mod:`mlx_loom.engine.kv_groups`).
    """
    params = params if params is not None else SamplingParams()
    ids = encode_prompt(tokenizer, prompt)
    _int_field("max_tokens", max_tokens, "Pass a positive max_tokens.")
    if prefill_step_size is not None:
        _int_field(
            "prefill_step_size", prefill_step_size, "Pass a positive prefill_step_size (2048)."
        )
    if max_kv_size is not None:
        _int_field(
            "max_kv_size", max_kv_size, "Pass the most tokens each attention layer may keep."
        )
    kv = kv_quantization(
        model,
        kv_bits=kv_bits,
        kv_group_size=kv_group_size,
        quantized_kv_start=quantized_kv_start,
        kv_codec=kv_codec,
        max_kv_size=max_kv_size,
    )
    vocab = model.vocab_size
    if vocab is not None:
        _check_vocabulary(ids, vocab)
        params.validate_logit_bias(vocab)
    room = context_room(model, len(ids) + len(history))
    limit = max_tokens if room is None else min(max_tokens, room)
    with _about("stop"):
        StopStrings(stop)  # refuses empty stop strings, by name
    if stop and tokenizer is None:
        raise RequestError(
            "Stop strings need the tokenizer, to see the text being generated.",
            fix="Pass the model's tokenizer, or stop on token ids (eos) instead.",
            param="stop",
        )
    if sampler is not None:
        if not callable(sampler):
            raise RequestError(
                f"sampler={sampler!r} is not callable.",
                fix="Pass a function logprobs [1, vocab] -> token [1], as mlx-lm's samplers are.",
                param="sampler",
            )
        moved = [
            name
            for name in (
                "temperature",
                "top_p",
                "top_k",
                "min_p",
                "min_tokens_to_keep",
                "xtc_probability",
            )
            if getattr(params, name) != SamplingParams.model_fields[name].default
        ]
        if moved:
            raise RequestError(
                f"Both sampler= and {', '.join(moved)} were given; a custom sampler decides "
                "the token itself, so those settings would be ignored.",
                fix=f"Drop {', '.join(moved)}, or drop sampler= and use the built-in sampler.",
                param="sampler",
            )
    processors = tuple(logits_processors or ())
    for i, proc in enumerate(processors):
        if not callable(proc):
            raise RequestError(
                f"logits_processors[{i}]={proc!r} is not callable.",
                fix="Pass functions (tokens, logits) -> logits, as mlx-lm's processors are.",
                param=f"logits_processors[{i}]",
            )
    if speculation is not None:
        _check_speculation(model, speculation, sampler=sampler)
        if params.xtc_probability > 0 and not params.greedy:
            raise RequestError(
                "Speculative decoding does not combine with XTC: its accept/reject rule "
                "needs the distribution each token is drawn from, and XTC cuts it at random.",
                fix="Drop xtc_probability, or turn speculation off for this request.",
                param="xtc_probability",
            )
    eos = eos if eos is not None else (tokenizer.eos_token_ids if tokenizer else frozenset())
    params = _with_xtc_special_tokens(params, tokenizer, eos, vocab)
    if adapter is not None:
        _check_adapter(model, adapter, speculation)
    if constraint is not None:
        check_constraint(model, constraint, tokenizer)
    return Request(
        prompt=tuple(ids),
        max_tokens=max_tokens,
        limit=limit,
        params=params,
        stop=tuple(stop),
        tokenizer=tokenizer,
        eos=eos,
        prefill_step_size=prefill_step_size,
        kv=kv,
        max_kv_size=max_kv_size,
        sampler=sampler,
        logits_processors=processors,
        cache=cache,
        history=tuple(history),
        logprobs_vector=logprobs_vector,
        speculation=speculation,
        adapter=adapter,
        constraint=constraint,
        checkpoints=bool(checkpoints),
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
            param="adapter",
        )
    adapters.slot(adapter)  # an unknown name is refused, naming the registered ones
    if speculation is not None:
        raise RequestError(
            "Speculative decoding does not combine with a per-request adapter yet: the "
            "speculative decode step runs the base model.",
            fix="Drop draft_model, or drop adapter=.",
            param="adapter",
        )


def _check_speculation(
    model: Model,
    spec: Speculation,
    *,
    sampler: SamplerFn | None,
) -> None:
    model.require(SPECULATIVE, asked="speculative decoding")
    parallel = getattr(model, "parallel", None)
    if parallel is not None:
        # The other ranks rebuild each request from a plain description; a
        # drafter (and its own model) is not part of it, so they would diverge.
        raise ParallelRefused(
            "Speculative decoding is not supported for a model split across ranks "
            f"(--parallel {parallel.mode}).",
            fix="Drop the draft (draft_model / --draft-model / --draft), or run the model in "
            "one process.",
        )
    if spec.mtp:
        if spec.draft is not None:
            raise RequestError(
                "A request drafts with a draft model or with the model's MTP head, not both.",
                fix="Pass draft='mtp' without a draft model, or the draft model alone.",
                param="draft",
            )
        why = model.mtp_refusal()
        if why is not None:
            raise CapabilityRefused(
                f"draft='mtp' drafts with the model's multi-token-prediction head, but {why}.",
                fix="Use a checkpoint that ships its mtp.* weights (as published, or converted "
                "with loom convert), or draft with 'ngram' or a draft model instead.",
            )
    if spec.draft is not None:
        spec.draft.require(SPECULATIVE, asked="speculative decoding (draft model)")
        if model.vocab_size != spec.draft.vocab_size:
            raise RequestError(
                f"The draft model's vocabulary ({spec.draft.vocab_size}) differs from the "
                f"model's ({model.vocab_size}).",
                fix="Use a draft model that shares the main model's tokenizer.",
                param="draft",
            )
    _int_field(
        "num_draft_tokens",
        spec.num_draft,
        f"Pass num_draft_tokens between 1 and {MAX_DRAFT} (3 is a good start).",
    )
    for name in ("ngram_max", "ngram_min"):
        _int_field(name, getattr(spec, name), "Pass n-gram sizes such as ngram_max=3, ngram_min=1.")
    if spec.ngram_min > spec.ngram_max:
        raise RequestError(
            f"ngram_min={spec.ngram_min} is larger than ngram_max={spec.ngram_max}.",
            fix="Pass ngram_min <= ngram_max.",
            param="ngram_min",
        )
    if sampler is not None:
        raise RequestError(
            "Speculative decoding does not combine with a custom sampler=: accepting or "
            "rejecting a draft needs the distribution the token is drawn from, which a custom "
            "sampler does not expose.",
            fix="Use the built-in sampling settings (temperature, top_p, top_k, min_p), or "
            "drop the draft.",
            param="sampler",
        )
