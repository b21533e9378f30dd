"""The sampling parameters of one generation request, validated at the boundary.

A request reaches the engine from the CLI, the Python API or the server as a
loose bag of options. :class:`SamplingParams` is the one place that bag is
checked: every out-of-range value, unknown option name or mistyped value is a
:class:`~mlx_loom.errors.RequestError` whose message names the parameter, the
value found, the valid range, and (on its own ``fix`` line) what to pass
instead. A raw pydantic ``ValidationError`` never escapes this module.

Semantics follow mlx-lm's ``make_sampler`` / ``make_logits_processors`` so that
the same options give the same tokens; where mlx-lm gives a value a surprising
meaning we refuse the value instead (see ``penalty_context_size`` and
``repetition_penalty`` below).
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from mlx_loom.errors import RequestError

#: Most alternatives a request may ask to see per generated token. Matches the
#: OpenAI API's ``top_logprobs`` limit, so the server can pass it through.
MAX_LOGPROBS = 20

#: The largest integer option (``top_k``, ``min_tokens_to_keep``,
#: ``penalty_context_size``): these size or index the engine's int32 arrays
#: (the penalty window is a slice, top-k and min-p partitions), and MLX
#: refuses larger indices with an untyped error in the middle of a step.
MAX_INT_OPTION = 2**31 - 1

#: The largest magnitude of a real-valued option (temperature, the penalties,
#: a ``logit_bias`` value), and the smallest of a positive one (temperature,
#: ``repetition_penalty``). The engine computes in float32, where a value
#: finite in Python overflows (``1e39``) or vanishes (``1e-45``), and these
#: values multiply or add to logits: within [2**-64, 2**64] every product with
#: a logit, and with its reciprocal, stays finite and normal in float32, and
#: no value past them has a different effect (a bias of 2**64 already
#: outweighs any logit; a temperature of 2**-64 already samples greedily).
MAX_REAL_OPTION = 2.0**64
MIN_POSITIVE_OPTION = 2.0**-64


@dataclass(frozen=True)
class _Rule:
    """What a field accepts and what to tell a caller who got it wrong."""

    valid: str
    fix: str


# One entry per field: the valid range as prose, and the fix. Every error
# message about a field is built from its entry, so they cannot drift apart.
_RULES: dict[str, _Rule] = {
    "temperature": _Rule(
        "0 (greedy argmax decoding) or a number in [2**-64, 2**64]",
        "pass temperature=0 for greedy decoding, or a positive value such as 0.7 to sample",
    ),
    "top_p": _Rule(
        "a number in (0, 1] (1 disables nucleus filtering)",
        "pass top_p=1.0 to disable nucleus sampling, or a value such as 0.9",
    ),
    "top_k": _Rule(
        f"an integer in [0, {MAX_INT_OPTION}] (0 disables top-k filtering)",
        "pass top_k=0 to disable top-k filtering, or a positive count such as 40",
    ),
    "min_p": _Rule(
        "a number in [0, 1] (0 disables min-p filtering)",
        "pass min_p=0.0 to disable min-p filtering, or a value such as 0.05",
    ),
    "min_tokens_to_keep": _Rule(
        f"an integer in [1, {MAX_INT_OPTION}]",
        "pass min_tokens_to_keep=1 (the default) or a larger count",
    ),
    "repetition_penalty": _Rule(
        "a number in [2**-64, 2**64], or null (1.0 is neutral, > 1 discourages repeats)",
        "omit repetition_penalty (or pass 1.0) to disable it, or pass a value such as 1.1",
    ),
    "presence_penalty": _Rule(
        "a number in [-2**64, 2**64], or null (0 disables it; positive discourages repeats)",
        "omit presence_penalty to disable it, or pass a finite value such as 0.5",
    ),
    "frequency_penalty": _Rule(
        "a number in [-2**64, 2**64], or null (0 disables it; positive discourages repeats)",
        "omit frequency_penalty to disable it, or pass a finite value such as 0.5",
    ),
    "penalty_context_size": _Rule(
        f"an integer in [1, {MAX_INT_OPTION}] (how many most recent tokens the penalties look at)",
        "pass penalty_context_size=20 (the default) or another positive count",
    ),
    "logit_bias": _Rule(
        "a mapping from token id (integer >= 0, below the vocabulary size) to a bias in "
        "[-2**64, 2**64]",
        "pass logit_bias as {token_id: bias}, e.g. {50256: -100.0} to suppress token 50256",
    ),
    "seed": _Rule(
        f"an integer in [0, {2**64 - 1}], or null for a fresh random seed",
        "pass a non-negative integer seed such as 42, or omit it",
    ),
    "xtc_probability": _Rule(
        "a number in [0, 1] (the chance, per token, that XTC cuts; 0 turns XTC off)",
        "pass xtc_probability=0 to turn XTC off, or a value such as 0.5",
    ),
    "xtc_threshold": _Rule(
        "a number in [0, 0.5] (tokens at least this likely are cut, but for the least likely "
        "of them)",
        "pass xtc_threshold=0.1 (the default) or another value in [0, 0.5]",
    ),
    "xtc_special_tokens": _Rule(
        "a list of token ids (integers >= 0) XTC never cuts",
        "pass token ids such as the tokenizer's EOS ids, or omit it (the doors fill it in)",
    ),
    "logprobs": _Rule(
        f"an integer in [0, {MAX_LOGPROBS}] (how many top alternatives to report per token)",
        f"pass logprobs=0 to report none, or a count up to {MAX_LOGPROBS}",
    ),
}

# Names other APIs use for our options: an unknown option that is one of these
# is answered with the name we use (mlx-lm says ``temp``, OpenAI
# ``top_logprobs``; mlx-lm has one context size per penalty, we have one).
_ALIASES: dict[str, str] = {
    "temp": "temperature",
    "top_logprobs": "logprobs",
    "repetition_context_size": "penalty_context_size",
    "presence_context_size": "penalty_context_size",
    "frequency_context_size": "penalty_context_size",
    "random_seed": "seed",
    "max_new_tokens": "max_tokens",  # transformers' name; max_tokens is a generate() option
}


def _finite(name: str, value: float) -> None:
    """``value`` must be finite and, in the float32 the engine computes in, not overflow."""
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite")
    if abs(value) > MAX_REAL_OPTION:
        raise ValueError(f"{name} must be at most 2**64 in magnitude (the engine uses float32)")


def _positive(name: str, value: float) -> None:
    """A positive factor: finite, and not so small that float32 loses it or its reciprocal."""
    _finite(name, value)
    if value < MIN_POSITIVE_OPTION:
        raise ValueError(
            f"{name} must be at least 2**-64 (smaller values vanish in the engine's float32)"
        )


def _bounded_int(name: str, value: int, low: int) -> None:
    if not low <= value <= MAX_INT_OPTION:
        raise ValueError(f"{name} must be in [{low}, {MAX_INT_OPTION}]")


class SamplingParams(BaseModel):
    """How the next token is chosen, and what is reported about the choice.

    Construct with :meth:`parse` (or the constructor; both raise
    :class:`RequestError`, never a pydantic error; pydantic's own
    ``model_validate`` bypasses that conversion, so boundaries should not use
    it). The model is frozen: a request's parameters do not change while it
    runs.

    Filters apply in mlx-lm's order — top-p, then min-p, then XTC, then
    top-k — to the log-probabilities, and sampling draws from the survivors at
    ``temperature``. XTC ("exclude top choices", mlx-lm's names and rule):
    with probability ``xtc_probability`` per token, every token at least
    ``xtc_threshold`` likely is removed except the least likely of them, so
    the reply leaves its most predictable path; ``xtc_special_tokens`` (EOS,
    newline: ``make_request`` fills them from the tokenizer when left out)
    are never removed. Penalties and ``logit_bias`` act on the logits before
    that, in mlx-lm's order: bias, repetition, presence, frequency.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    min_tokens_to_keep: int = 1
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    penalty_context_size: int = 20
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    logprobs: int = 0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    xtc_special_tokens: tuple[int, ...] | None = None

    def __init__(self, **data: Any) -> None:
        _reject_unknown_options(data)
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise _to_request_error(exc) from None

    @classmethod
    def parse(cls, **options: Any) -> SamplingParams:
        """Build from request options; ``None`` for a defaulted option means "not given".

        JSON clients send ``null`` for options they leave unset; treating that
        as the default keeps ``{"temperature": null}`` from being an error while
        still refusing every value that is actually wrong.
        """
        given = {
            name: value
            for name, value in options.items()
            if value is not None or name not in cls.model_fields or _nullable(name)
        }
        return cls(**given)

    # --- field checks (each raises ValueError; __init__ turns it into RequestError)

    @field_validator(
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "min_tokens_to_keep",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "penalty_context_size",
        "seed",
        "logprobs",
        "xtc_probability",
        "xtc_threshold",
        mode="before",
    )
    @classmethod
    def _no_bools(cls, value: Any) -> Any:
        # pydantic's lax mode reads True as 1; a boolean here is always a mistake.
        if isinstance(value, bool):
            raise ValueError("a boolean is not a number")
        return value

    @field_validator("temperature")
    @classmethod
    def _check_temperature(cls, value: float) -> float:
        # 0 is greedy; a positive temperature is used as 1/temperature in float32,
        # where 1e-45 became infinity and sampled at random instead of greedily.
        if value < 0:
            raise ValueError("temperature must be >= 0")
        if value != 0:
            _positive("temperature", value)
        return value

    @field_validator("top_p")
    @classmethod
    def _check_top_p(cls, value: float) -> float:
        if not 0.0 < value <= 1.0:  # also false for NaN
            raise ValueError("top_p must be in (0, 1]")
        return value

    @field_validator("top_k")
    @classmethod
    def _check_top_k(cls, value: int) -> int:
        _bounded_int("top_k", value, 0)
        return value

    @field_validator("min_p")
    @classmethod
    def _check_min_p(cls, value: float) -> float:
        if not 0.0 <= value <= 1.0:
            raise ValueError("min_p must be in [0, 1]")
        return value

    @field_validator("min_tokens_to_keep")
    @classmethod
    def _check_min_tokens_to_keep(cls, value: int) -> int:
        _bounded_int("min_tokens_to_keep", value, 1)
        return value

    @field_validator("repetition_penalty")
    @classmethod
    def _check_repetition_penalty(cls, value: float | None) -> float | None:
        # The penalty divides positive logits and multiplies negative ones:
        # 0 divides by zero and a negative value flips signs. (mlx-lm treats 0
        # as "off"; we refuse it rather than give 0 a meaning opposite to its
        # arithmetic.)
        if value is not None:
            _finite("repetition_penalty", value)
            if value <= 0:
                raise ValueError("repetition_penalty must be > 0")
            _positive("repetition_penalty", value)
        return value

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _check_additive_penalty(cls, value: float | None, info: Any) -> float | None:
        # Additive penalties are meaningful at any sign (negative encourages
        # repeats, as in the OpenAI API); only non-finite values are nonsense.
        if value is not None:
            _finite(info.field_name, value)
        return value

    @field_validator("penalty_context_size")
    @classmethod
    def _check_penalty_context_size(cls, value: int) -> int:
        # mlx-lm slices ``tokens[-size:]``, so its size 0 silently means "the
        # whole history"; we refuse 0 rather than inherit that surprise.
        _bounded_int("penalty_context_size", value, 1)
        return value

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[int, float] | None) -> dict[int, float] | None:
        if value is None:
            return None
        for token, bias in value.items():
            if token < 0:
                raise ValueError(f"token id {token} is negative")
            if not math.isfinite(bias):
                raise ValueError(f"bias {bias} for token {token} is not finite")
            if abs(bias) > MAX_REAL_OPTION:
                raise ValueError(f"bias {bias} for token {token} is past 2**64 in magnitude")
        return value

    @field_validator("seed")
    @classmethod
    def _check_seed(cls, value: int | None) -> int | None:
        # mx.random.key takes an unsigned 64-bit seed.
        if value is not None and not 0 <= value < 2**64:
            raise ValueError("seed must fit in an unsigned 64-bit integer")
        return value

    @field_validator("logprobs")
    @classmethod
    def _check_logprobs(cls, value: int) -> int:
        if not 0 <= value <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}]")
        return value

    @field_validator("xtc_probability")
    @classmethod
    def _check_xtc_probability(cls, value: float) -> float:
        if not 0.0 <= value <= 1.0:  # also false for NaN
            raise ValueError("xtc_probability must be in [0, 1]")
        return value

    @field_validator("xtc_threshold")
    @classmethod
    def _check_xtc_threshold(cls, value: float) -> float:
        # Above 0.5 at most one token can reach the threshold, and XTC always
        # keeps the least likely of those that do: it would never cut.
        if not 0.0 <= value <= 0.5:
            raise ValueError("xtc_threshold must be in [0, 0.5]")
        return value

    @field_validator("xtc_special_tokens")
    @classmethod
    def _check_xtc_special_tokens(cls, value: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if value is not None:
            for token in value:
                if token < 0:
                    raise ValueError(f"token id {token} is negative")
                _bounded_int("an xtc_special_tokens id", token, 0)
            value = tuple(sorted(set(value)))
        return value

    # --- derived facts the sampler reads

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax (temperature 0)."""
        return self.temperature == 0.0

    def validate_logit_bias(self, vocab_size: int) -> None:
        """Refuse ``logit_bias`` token ids the model's vocabulary does not have.

        Called once the model is known (the parameters are parsed before it
        is). Out-of-range ids would otherwise be an indexing error deep inside
        the first decode step, or worse, clamp silently on some backends.
        """
        if not self.logit_bias:
            return
        bad = sorted(token for token in self.logit_bias if token >= vocab_size)
        if bad:
            shown = ", ".join(str(token) for token in bad[:5])
            more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
            raise RequestError(
                f"logit_bias names token id(s) {shown}{more}, outside this model's "
                f"vocabulary: valid token ids are 0..{vocab_size - 1} "
                f"(vocab_size={vocab_size}).",
                fix="remove those entries from logit_bias, or use token ids from this "
                "model's tokenizer",
                param="logit_bias",
            )


def _nullable(name: str) -> bool:
    return SamplingParams.model_fields[name].default is None


def _reject_unknown_options(data: dict[str, Any]) -> None:
    """An unknown option is an error naming the closest option we do have.

    Checked before pydantic so the answer can suggest a name; silently
    ignoring a misspelt ``top_P`` would sample with the wrong distribution.
    """
    for name in data:
        if name in _RULES:
            continue
        suggestion = _ALIASES.get(name) or _ALIASES.get(name.lower())
        if suggestion is None:
            close = difflib.get_close_matches(name.lower(), _RULES, n=1, cutoff=0.5)
            suggestion = close[0] if close else None
        valid = ", ".join(_RULES)
        if suggestion is not None:
            raise RequestError(
                f"unknown sampling option {name!r}; did you mean {suggestion!r}? "
                f"Valid options: {valid}.",
                fix=f"rename {name!r} to {suggestion!r}",
                param=name,
                code="unknown_parameter",
            )
        raise RequestError(
            f"unknown sampling option {name!r}. Valid options: {valid}.",
            fix=f"remove {name!r} or use one of the valid options",
            param=name,
            code="unknown_parameter",
        )


def _to_request_error(exc: ValidationError) -> RequestError:
    """Turn pydantic's first complaint into a message that names field, value, range, fix."""
    err = exc.errors(include_url=False)[0]
    loc = err["loc"]
    field = str(loc[0])
    rule = _RULES[field]
    reason = err["msg"].removeprefix("Value error, ")
    if len(loc) > 1:
        # A logit_bias entry: say which entry (key or value) was wrong.
        if loc[-1] == "[key]":
            found = f"{field} key {err['input']!r}"
        else:
            found = f"{field}[{loc[1]!r}]={err['input']!r}"
    else:
        found = f"{field}={err['input']!r}"
    return RequestError(
        f"invalid sampling parameter: {found}: {reason}. Valid: {rule.valid}.",
        fix=rule.fix,
        param=field,
    )
