"""JSON parsing with bounds on size, nesting depth, container count and integer length.

Every JSON document mlx-loom reads — ``config.json``, the tokenizer's JSON
files, safetensors headers and their index, prompt-cache headers, HTTP
request bodies — goes through :func:`parse_json` or :func:`read_json_file`,
so hostile input gets one kind of answer everywhere: a typed error (the
caller's :class:`~mlx_loom.errors.LoomError` subclass) naming the file and
the place in it, never an untyped crash. Why the stdlib parser alone is not
enough (measured on CPython 3.11):

* nesting recurses in C: 100,000 ``[`` raise ``RecursionError`` (and a
  process that raised its recursion limit can overflow the C stack instead);
* a 5,000-digit integer raises a bare ``ValueError`` (CPython's 4,300-digit
  limit on int/str conversion);
* size is unbounded: a JSON file is read whole, and ``[{},{},...]`` turns
  3 bytes of text into a 64-byte dict, about 20x amplification.

So, before ``json.loads`` sees the text, one linear pass (regex and
``bytes.translate``, no Python loop per character) removes the string
literals, measures the deepest nesting and counts the containers, and a scan
for runs of digits (then, only on a long run, one regex) finds integer
literals longer than the limit. Only when a bound is
exceeded does a slower token walk run, to say *where* (a JSON path, line and
column). Each check is far inside what real files need; see :class:`JsonLimits`.
"""

from __future__ import annotations

import functools
import json
import os
import re
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Any

from mlx_loom.errors import LoomError

__all__ = [
    "ARTIFACT_JSON",
    "CONFIG_JSON",
    "REQUEST_JSON",
    "JsonLimits",
    "parse_json",
    "read_json_file",
]


@dataclass(frozen=True, slots=True)
class JsonLimits:
    """Bounds on one JSON document. ``None`` for ``max_bytes`` means "the caller bounded it".

    The defaults hold every real checkpoint file with a wide margin: Hugging
    Face configs and tokenizer files nest 3-5 levels deep, tool schemas in
    chat requests rarely more than 10; the longest integer in the wild is
    transformers' ``model_max_length`` sentinel ``1000000000000000019884624838656``
    (31 digits), and 64-bit values need 20.
    """

    max_bytes: int | None = 64 * 1024 * 1024
    max_depth: int = 64
    max_containers: int = 2_000_000
    max_int_digits: int = 64
    #: JSON may escape half of a UTF-16 surrogate pair (``"\ud800"``); Python
    #: then holds a string no UTF-8 encoder (the tokenizer's included) accepts.
    allow_lone_surrogates: bool = True


#: ``config.json``: configs are kilobytes; 16 MiB bounds the parse at well under 1 GB.
CONFIG_JSON = JsonLimits(max_bytes=16 * 1024 * 1024)
#: Tokenizer configs, the safetensors index, prompt-cache headers. A
#: ``tokenizer_config.json`` listing 250k added tokens is ~40 MB.
ARTIFACT_JSON = JsonLimits()
#: HTTP request bodies (the server bounds the body size before reading it):
#: text a client sends must be valid Unicode.
# Request bodies carry tool definitions whose JSON schemas legitimately nest
# (two JSON levels per schema object); the server's own check on tool depth
# (``serve.tools.MAX_TOOL_DEPTH``) names the tool, so the body bound sits above it.
REQUEST_JSON = JsonLimits(
    max_bytes=None, max_depth=256, max_containers=500_000, allow_lone_surrogates=False
)

# One JSON string literal, escapes included (unrolled so it never backtracks).
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_OPEN, _CLOSE = 0x01, 0xFF  # +1 / -1 as signed bytes
_BRACKETS = bytes.maketrans(b"[{]}", bytes([_OPEN, _OPEN, _CLOSE, _CLOSE]))
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
# Every ASCII digit becomes "0" and every other byte a space, so a run of more
# than N digits is the substring "0" * (N + 1): ``bytes.find`` answers that ~30x
# faster than the integer regex (0.13 s vs 4 s on an 18 MiB body of token ids,
# time the server's parse holds the GIL), and the regex runs only on a hit.
_DIGIT_RUNS = bytes(0x30 if 0x30 <= b <= 0x39 else 0x20 for b in range(256))
# Tokens for the walk that locates a violation: strings, structure, numbers.
_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?|[\[\]{}:,]|-?\d[\d.eE+\-]*', re.DOTALL)
_SHOW_PATH = 8  # path components shown before eliding the middle
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # where a lone surrogate can come from
_SURROGATE = re.compile("[\ud800-\udfff]")


@functools.lru_cache(maxsize=8)
def _long_int(digits: int) -> re.Pattern[str]:
    # An integer literal (no fraction, no exponent) of more than ``digits`` digits.
    return re.compile(r"(?<![\d.eE+\-])-?\d{" + str(digits + 1) + r",}(?![\d.eE])")


def parse_json(
    data: str | bytes,
    *,
    source: str,
    error: Callable[..., LoomError],
    fix: str,
    limits: JsonLimits = ARTIFACT_JSON,
    object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None,
) -> Any:
    """Parse ``data`` within ``limits``; any failure is ``error(message, fix=fix)``.

    ``source`` names the document in messages (a file path, "the request
    body"). ``error`` is the caller's typed error class (``ConfigError``,
    ``TokenizerError`` ...). ``object_pairs_hook`` is passed to ``json.loads``
    (exceptions it raises propagate unchanged).
    """
    if isinstance(data, bytes):
        if limits.max_bytes is not None and len(data) > limits.max_bytes:
            raise error(
                f"{source} is {len(data)} bytes; the limit for this JSON is "
                f"{limits.max_bytes} bytes",
                fix=fix,
            )
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise error(f"{source} is not valid UTF-8 (byte {err.start})", fix=fix) from None
    else:
        text = data
        if limits.max_bytes is not None and len(text) > limits.max_bytes:
            raise error(
                f"{source} is {len(text)} characters; the limit for this JSON is "
                f"{limits.max_bytes} bytes",
                fix=fix,
            )
    _check_shape(text, source=source, error=error, fix=fix, limits=limits)
    try:
        value = json.loads(text, object_pairs_hook=object_pairs_hook)
    except json.JSONDecodeError as err:
        raise error(
            f"{source} is not valid JSON: {err.msg} (line {err.lineno}, column {err.colno})",
            fix=fix,
        ) from None
    except (RecursionError, ValueError) as err:  # backstops; the checks above come first
        raise error(f"{source} could not be parsed as JSON: {err}", fix=fix) from None
    if not limits.allow_lone_surrogates and _SURROGATE_ESCAPE.search(text):
        where = _find_surrogate(value)
        if where is not None:
            raise error(
                f"{source}: the string at {where or '<root>'} holds a lone UTF-16 surrogate "
                "escape, which is not valid Unicode",
                fix=fix,
            )
    return value


def read_json_file(
    path: str | os.PathLike[str],
    *,
    error: Callable[..., LoomError],
    fix: str,
    limits: JsonLimits = ARTIFACT_JSON,
    object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None,
) -> Any:
    """Read and parse one JSON file; its size is checked before a byte is read."""
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if limits.max_bytes is not None and size > limits.max_bytes:
                raise error(
                    f"{path} is {size} bytes; the limit for this file is {limits.max_bytes} bytes",
                    fix=fix,
                )
            # Read what fstat reported (plus one byte, to notice a file growing
            # past the limit meanwhile): read(n) allocates n bytes up front.
            want = size if limits.max_bytes is None else min(size, limits.max_bytes)
            data = fh.read(want + 1)
    except FileNotFoundError:
        raise
    except OSError as err:
        raise error(f"{path} cannot be read: {err.strerror or err}", fix=fix) from None
    return parse_json(
        data,
        source=str(path),
        error=error,
        fix=fix,
        limits=limits,
        object_pairs_hook=object_pairs_hook,
    )


def _check_shape(
    text: str, *, source: str, error: Callable[..., LoomError], fix: str, limits: JsonLimits
) -> None:
    """Refuse nesting, container counts and integer literals past ``limits``."""
    skeleton = _STRING.sub("", text)
    raw = skeleton.encode("utf-8", "ignore")
    brackets = raw.translate(_BRACKETS, _NOT_BRACKETS)
    depth = max(accumulate(array("b", brackets)), default=0)
    if depth > limits.max_depth:
        where, tok = _locate(text, lambda kind, tok, d: kind == "open" and d > limits.max_depth)
        # Not found: the count was thrown off by an unterminated string, so the
        # text is malformed and json.loads reports where.
        if tok:
            raise error(
                f"{source}: JSON nesting{where} is deeper than the limit of "
                f"{limits.max_depth} levels",
                fix=fix,
            )
    containers = brackets.count(_OPEN)
    if containers > limits.max_containers:
        raise error(
            f"{source} holds {containers} JSON arrays/objects; the limit is "
            f"{limits.max_containers}",
            fix=fix,
        )
    long_run = b"0" * (limits.max_int_digits + 1)
    if long_run in raw.translate(_DIGIT_RUNS) and _long_int(limits.max_int_digits).search(skeleton):

        def too_long(kind: str, tok: str, d: int) -> bool:
            digits = tok.lstrip("-")
            return kind == "number" and digits.isdigit() and len(digits) > limits.max_int_digits

        where, tok = _locate(text, too_long)
        if tok:
            raise error(
                f"{source}: an integer{where} has {len(tok.lstrip('-'))} digits; the limit is "
                f"{limits.max_int_digits}",
                fix=fix,
            )


def _locate(text: str, hit: Callable[[str, str, int], bool]) -> tuple[str, str]:
    """Walk the tokens of ``text`` to the first one ``hit`` accepts: ``(where it is, token)``.

    Only runs once a bound is known to be exceeded, and stops at the first
    offending token, so its Python loop is bounded by the offending prefix.
    """
    # Each frame: [container, key or index, expecting a key?]
    stack: list[list[Any]] = []
    pending_key: str | None = None
    for match in _TOKEN.finditer(text):
        tok = match.group()
        first = tok[0]
        if first in "[{":
            stack.append(["{" if first == "{" else "[", 0 if first == "[" else None, first == "{"])
            if hit("open", tok, len(stack)):
                return _where(text, match.start(), stack[:-1]), tok
        elif first in "]}":
            if stack:
                stack.pop()
        elif first == ",":
            if stack:
                top = stack[-1]
                if top[0] == "[":
                    top[1] += 1
                else:
                    top[2] = True
        elif first == ":":
            if stack and stack[-1][0] == "{":
                stack[-1][1], stack[-1][2] = pending_key, False
        elif first == '"':
            if stack and stack[-1][0] == "{" and stack[-1][2]:
                pending_key = _string_value(tok)
        else:
            if hit("number", tok, len(stack)):
                return _where(text, match.start(), stack), tok
    return "", ""


def _find_surrogate(value: Any) -> str | None:
    """The path of the first string (value or key) holding a lone surrogate, or ``None``.

    Only runs when the text has a surrogate escape; a valid pair decodes to
    one character and is not found.
    """
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, str):
            if _SURROGATE.search(node):
                return path
        elif isinstance(node, dict):
            for key, item in node.items():
                if _SURROGATE.search(key):
                    return f"{path}.{key!a}".lstrip(".")
                stack.append((item, f"{path}.{key}".lstrip(".")))
        elif isinstance(node, list):
            stack.extend((item, f"{path}[{i}]") for i, item in enumerate(node))
    return None


def _string_value(tok: str) -> str:
    try:
        value = json.loads(tok)
    except ValueError:
        return tok.strip('"')
    return value if isinstance(value, str) else tok


def _where(text: str, offset: int, stack: list[list[Any]]) -> str:
    line = text.count("\n", 0, offset) + 1
    column = offset - (text.rfind("\n", 0, offset) + 1) + 1
    parts = []
    for container, key, _ in stack:
        if container == "[":
            parts.append(f"[{key}]")
        elif key is not None:
            parts.append(f".{key}" if re.fullmatch(r"[A-Za-z_][\w\-]*", key) else f"[{key!r}]")
    if len(parts) > _SHOW_PATH:
        parts = [*parts[: _SHOW_PATH - 2], f"...({len(parts) - _SHOW_PATH} more)", *parts[-2:]]
    path = "".join(parts).lstrip(".")
    at = f" at {path}" if path else ""
    return f"{at} (line {line}, column {column})"
