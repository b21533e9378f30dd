"""Command-line flags: parsing, range checks, and errors that speak in flags.

Two rules shape this module:

* A bad flag value is a usage error (exit 2) found before any model loads,
  printed as one line naming the flag and, on its own line, a fix that names
  the flag again — never a traceback, never a screenful of usage text. The
  ranges mirror what :class:`~mlx_loom.engine.params.SamplingParams` and the cache
  accept, so the engine's own checks stay the backstop, not the first line.
* Errors raised below the CLI speak the Python API (``temperature=0``,
  ``kernel_backend='cpu'``). :func:`speak_flags` rewrites those spellings into
  the flags a person at the terminal can type (``--temp 0``,
  ``--kernel-backend cpu``).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from ..errors import UsageError

#: mlx_loom.cache's KV_BITS and KV_GROUP_SIZES, restated so that building the
#: parser does not import MLX (a test keeps them equal).
KV_BITS = (2, 3, 4, 5, 6, 8)
KV_GROUP_SIZES = (32, 64, 128)

__all__ = [
    "API_FLAGS",
    "FlagType",
    "LoomArgumentParser",
    "choice",
    "finite",
    "integer",
    "speak_flags",
]


class LoomArgumentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line plus a fix, exit code 2.

    argparse's default prints the whole usage block before the error; for a
    command with twenty options that buries the one line that matters.
    """

    def error(self, message: str) -> NoReturn:
        problem, _, fix = message.partition("\nfix: ")
        print(f"{self.prog}: error: {problem}", file=sys.stderr)
        print(f"fix: {fix or f'run `{self.prog} --help` to see the options'}", file=sys.stderr)
        self.exit(2)


@dataclass(frozen=True)
class FlagType:
    """An argparse ``type=`` that parses a number and checks its range.

    ``valid`` says what is accepted in words; ``fix`` is the advice, written
    with the flag (``pass --temp 0 for greedy decoding``). argparse prefixes
    the flag name to the message itself (``argument --temp: ...``).
    """

    kind: type
    check: Callable[[Any], bool]
    valid: str
    fix: str

    def __call__(self, text: str) -> Any:
        try:
            value = self.kind(text)
        except (TypeError, ValueError):
            value = None
        if value is None or not self.check(value):
            raise argparse.ArgumentTypeError(
                f"{text!r} is not valid: it must be {self.valid}\nfix: {self.fix}"
            )
        return value


def integer(flag: str, *, low: int, high: int | None = None, valid: str, fix: str) -> FlagType:
    """An integer in ``[low, high]`` (``high=None``: no upper bound)."""
    return FlagType(
        int, lambda v: v >= low and (high is None or v <= high), valid, fix.format(flag=flag)
    )


def finite(
    flag: str,
    *,
    check: Callable[[float], bool] = lambda v: True,
    valid: str,
    fix: str,
) -> FlagType:
    """A finite float that also passes ``check``."""
    return FlagType(float, lambda v: math.isfinite(v) and check(v), valid, fix.format(flag=flag))


def choice(flag: str, options: tuple[int, ...], *, fix: str) -> FlagType:
    """One of a few integers; the message lists them."""
    listed = ", ".join(map(str, options[:-1])) + f" or {options[-1]}"
    return FlagType(int, lambda v: v in options, f"one of {listed}", fix.format(flag=flag))


# --- the flags several commands share --------------------------------------

MAX_TOKENS = integer(
    "--max-tokens",
    low=1,
    valid="an integer >= 1",
    fix="pass a positive count, e.g. {flag} 64",
)
TEMP = finite(
    "--temp",
    check=lambda v: v >= 0,
    valid="a finite number >= 0 (0 means greedy decoding)",
    fix="pass {flag} 0 for greedy decoding, or a positive value such as {flag} 0.7 to sample",
)
TOP_P = finite(
    "--top-p",
    check=lambda v: 0 < v <= 1,
    valid="a number in (0, 1] (1 turns nucleus sampling off)",
    fix="pass {flag} 1.0 to turn nucleus sampling off, or a value such as {flag} 0.9",
)
TOP_K = integer(
    "--top-k",
    low=0,
    valid="an integer >= 0 (0 turns top-k filtering off)",
    fix="pass {flag} 0 to turn top-k filtering off, or a count such as {flag} 40",
)
MIN_P = finite(
    "--min-p",
    check=lambda v: 0 <= v <= 1,
    valid="a number in [0, 1] (0 turns min-p filtering off)",
    fix="pass {flag} 0 to turn min-p filtering off, or a value such as {flag} 0.05",
)
REPETITION_PENALTY = finite(
    "--repetition-penalty",
    check=lambda v: v > 0,
    valid="a finite number > 0 (1.0 is neutral; above 1 discourages repeats)",
    fix="omit {flag} to turn it off, or pass a value such as {flag} 1.1",
)
PRESENCE_PENALTY = finite(
    "--presence-penalty",
    valid="a finite number (0 turns it off; positive discourages repeats)",
    fix="omit {flag} to turn it off, or pass a value such as {flag} 0.5",
)
FREQUENCY_PENALTY = finite(
    "--frequency-penalty",
    valid="a finite number (0 turns it off; positive discourages repeats)",
    fix="omit {flag} to turn it off, or pass a value such as {flag} 0.5",
)
XTC_PROBABILITY = finite(
    "--xtc-probability",
    check=lambda v: 0 <= v <= 1,
    valid="a number in [0, 1] (0 turns XTC off)",
    fix="pass {flag} 0 to turn XTC off, or a value such as {flag} 0.5",
)
XTC_THRESHOLD = finite(
    "--xtc-threshold",
    check=lambda v: 0 <= v <= 0.5,
    valid="a number in [0, 0.5]",
    fix="pass {flag} 0.1 (the default) or another value in [0, 0.5]",
)
SEED = integer(
    "--seed",
    low=0,
    high=2**64 - 1,
    valid=f"an integer in [0, {2**64 - 1}]",
    fix="pass a non-negative integer, e.g. {flag} 42",
)
KV_BITS_FLAG = choice(
    "--kv-bits", KV_BITS, fix="pass {flag} 4 or {flag} 8 (the usual choices), or omit it"
)
KV_CODEC = FlagType(
    str,
    lambda v: bool(re.fullmatch(r"[a-z0-9][a-z0-9_.-]{0,63}", v)),
    "a codec name such as affine or turboquant",
    "pass --kv-codec turboquant (with --kv-bits 3 or 4) or --kv-codec affine, or omit it",
)
KV_GROUP_SIZE = choice(
    "--kv-group-size",
    KV_GROUP_SIZES,
    fix="pass {flag} 32, 64 or 128 (one that divides the model's head dimension), or omit it",
)
QUANTIZED_KV_START = integer(
    "--quantized-kv-start",
    low=0,
    valid="an integer >= 0 (tokens in the cache before it is quantized)",
    fix="pass {flag} 0 to quantize from the start, or a token count such as {flag} 512",
)
PREFILL_STEP_SIZE = integer(
    "--prefill-step-size",
    low=1,
    valid="an integer >= 1 (prompt tokens per prefill forward)",
    fix="pass a positive count, e.g. {flag} 2048 (the default)",
)
NUM_DRAFT_TOKENS = integer(
    "--num-draft-tokens",
    low=1,
    high=32,
    valid="an integer from 1 to 32",
    fix="pass a positive count, e.g. {flag} 3 (the default)",
)
MAX_KV_SIZE = integer(
    "--max-kv-size",
    low=1,
    valid="an integer >= 1 (tokens the conversation may occupy)",
    fix="pass a positive token count no larger than the model's context, e.g. {flag} 4096",
)
KV_WINDOW = integer(
    "--max-kv-size",
    low=1,
    valid="an integer >= 1 (tokens each attention layer keeps)",
    fix="pass a positive token count, e.g. {flag} 4096, or omit it to keep the whole context",
)
PORT = integer(
    "--port",
    low=0,
    high=65535,
    valid="a TCP port in [0, 65535] (0 picks a free one)",
    fix="pass a port such as {flag} 8080, or {flag} 0 to pick a free one",
)
MAX_TOKENS_LIMIT = integer(
    "--max-tokens-limit",
    low=1,
    valid="an integer >= 1",
    fix="pass a positive count, e.g. {flag} 4096 (the default)",
)


# --- API spellings -> flags --------------------------------------------------

#: Python-API parameter names and the flag that sets each on the command line.
API_FLAGS: dict[str, str] = {
    "max_tokens": "--max-tokens",
    "temperature": "--temp",
    "temp": "--temp",
    "top_p": "--top-p",
    "top_k": "--top-k",
    "min_p": "--min-p",
    "repetition_penalty": "--repetition-penalty",
    "presence_penalty": "--presence-penalty",
    "frequency_penalty": "--frequency-penalty",
    "seed": "--seed",
    "xtc_probability": "--xtc-probability",
    "xtc_threshold": "--xtc-threshold",
    "stop": "--stop",
    "kv_bits": "--kv-bits",
    "kv_group_size": "--kv-group-size",
    "kv_codec": "--kv-codec",
    "kv_dtype": "--kv-dtype",
    "quantized_kv_start": "--quantized-kv-start",
    "prefill_step_size": "--prefill-step-size",
    "draft_model": "--draft-model",
    "draft": "--draft",
    "num_draft_tokens": "--num-draft-tokens",
    "kernel_backend": "--kernel-backend",
    "compute_dtype": "--compute-dtype",
    "cpu_kernels": "--cpu-kernels",
    "max_kv_size": "--max-kv-size",
    "max_tokens_limit": "--max-tokens-limit",
    "adapter_path": "--adapter-path",
}

_NAMES = "|".join(sorted(map(re.escape, API_FLAGS), key=len, reverse=True))
# ``name=value``: the value is a quoted string or runs to whitespace, a comma,
# a closing parenthesis or a sentence-ending period.
_ASSIGNMENT = re.compile(rf"\b({_NAMES})=('[^']*'|\"[^\"]*\"|[^\s,;)]+?)(?=[\s,;)]|\.?$|\.\s)")
# A bare snake_case name (an underscore makes it an identifier, not a word).
_IDENTIFIER = re.compile(rf"(?<![\w-])({'|'.join(n for n in API_FLAGS if '_' in n)})(?![\w=])")


def speak_flags(text: str) -> str:
    """Rewrite Python-API spellings in ``text`` as the CLI flags that set them.

    ``kernel_backend='cpu'`` becomes ``--kernel-backend cpu`` and a bare
    ``repetition_penalty`` becomes ``--repetition-penalty``; plain words such
    as "temperature" or "seed" are left alone unless written ``name=value``.
    """

    def assignment(match: re.Match[str]) -> str:
        value = match[2]
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        return f"{API_FLAGS[match[1]]} {value}"

    text = _ASSIGNMENT.sub(assignment, text)
    return _IDENTIFIER.sub(lambda m: API_FLAGS[m[1]], text)


def usage_error(flag: str, problem: str, fix: str) -> UsageError:
    """A flag value that only turned out wrong once the model was known."""
    return UsageError(f"argument {flag}: {problem}", fix=fix)
