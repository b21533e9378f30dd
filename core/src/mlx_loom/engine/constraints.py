"""Structured output: a grammar that decides, token by token, what a row may emit.

A request may carry a :class:`Constraint` — a JSON schema, "any JSON object",
a regular expression, a list of choices, or a context-free grammar (Lark, or
llama.cpp's GBNF). The engine gives each constrained row its own
:class:`RowConstraint`, a parser state over that grammar, and before every
sampling step sets the logits of the tokens the grammar forbids to ``-inf``
(:func:`mask_logits`), so greedy and sampled decoding, penalties, logit bias
and logprobs all see only legal tokens. End-of-sequence is legal exactly when
the grammar is complete; a row that runs out of tokens first ends by length.

The grammar engine is llguidance (the one vLLM, SGLang and llama.cpp use): it
compiles JSON schemas, regexes and Lark/GBNF grammars lazily and computes a
token mask in Rust in about 0.1-0.2 ms a row at vocabularies of 2k and 32k
(``benchmarks/structured_bench.py``), with fuel limits that bound both
compiling and every mask step. It refuses schema keywords it cannot enforce
(``uniqueItems``, for one) rather than loosening them; so do we. It needs
only numpy; xgrammar, the other maintained engine, requires torch,
transformers and triton, and reads no Lark — too heavy a dependency for an
MLX core, for no format we lack.

Compiled grammars are cached per (kind, source, tokenizer, EOS set), so a
server answering the same schema many times validates it once.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import llguidance as llg
import mlx.core as mx
import numpy as np

from mlx_loom.errors import ParallelRefused, RequestError

if TYPE_CHECKING:
    from mlx_loom.text import Tokenizer

#: The kinds of constraint a request may carry. ``grammar`` is a Lark grammar
#: or a llama.cpp GBNF grammar (told apart by llguidance: GBNF uses ``::=``).
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")

#: The longest schema, regex, grammar or choice list (as text) a request may carry.
#: Compile time grows about linearly with it (~1 s at this size, measured).
MAX_SOURCE_BYTES = 64 * 1024
#: Wall-clock budget for compiling one constraint (and its first mask); over it,
#: the request is refused (the compile itself is bounded by :data:`PARSER_LIMITS`).
COMPILE_SECONDS = 5.0
#: The most entries a ``choice`` list may hold.
MAX_CHOICES = 4096
#: Compiled grammars kept (least recently used dropped first).
CACHE_ENTRIES = 256

#: llguidance's resource limits, tighter than its defaults where a remote
#: caller controls the grammar: the fuel bounds compile time (about 50k units
#: a millisecond, so ~20 ms of regex analysis) and each mask step's work; the
#: lexer-state cap bounds memory (1-2 kB a state, so ~100 MB).
PARSER_LIMITS = {
    "initial_lexer_fuel": 1_000_000,
    "step_lexer_fuel": 200_000,
    "step_max_items": 50_000,
    "max_lexer_states": 50_000,
    "max_grammar_size": 200_000,
    "max_items_in_row": 2_000,
}


def _limits() -> llg.LLParserLimits:
    limits: dict[str, Any] = {**PARSER_LIMITS, "verbose_errors": False}
    return llg.LLParserLimits(**limits)


@dataclass(frozen=True)
class Constraint:
    """A validated constraint: what was asked, and the grammar that enforces it.

    Plain data (strings), so it crosses threads and processes; the parser
    state lives in each row's :class:`RowConstraint`.
    """

    kind: str
    source: str
    #: llguidance's grammar text (validated against the tokenizer).
    grammar: str


class ConstraintViolation(RequestError):
    """A constrained row reached a point its grammar cannot go on from with this
    tokenizer (text it has no tokens for: llguidance then offers a token that does
    not fit). The row fails alone; the server answers 400."""

    def __init__(self, message: str) -> None:
        super().__init__(
            message,
            fix="Check that the model's tokenizer can write every character the grammar "
            "requires, or simplify the grammar.",
        )


# --- compiling -----------------------------------------------------------------------------


def _source_text(kind: str, spec: Any) -> str:
    """The canonical text of a constraint spec (what the cache keys on)."""
    if kind == "json_object":
        return '{"type": "object"}'
    if kind == "json_schema":
        if isinstance(spec, Mapping):
            return json.dumps(spec, sort_keys=True, separators=(",", ":"))
        if isinstance(spec, str):
            try:
                parsed = json.loads(spec)
            except ValueError as exc:
                raise RequestError(
                    f"The JSON schema is not valid JSON: {exc}.",
                    fix="Pass the schema as a JSON object.",
                ) from None
            return _source_text(kind, parsed)
        if isinstance(spec, bool):
            return json.dumps(spec)
        raise RequestError(
            f"A JSON schema must be an object, not {type(spec).__name__}.",
            fix="Pass the schema as a JSON object.",
        )
    if kind == "choice":
        if not isinstance(spec, Sequence) or isinstance(spec, str) or not spec:
            raise RequestError(
                "choice must be a non-empty list of strings.",
                fix='Pass e.g. "choice": ["yes", "no"].',
            )
        if len(spec) > MAX_CHOICES:
            raise RequestError(
                f"choice lists {len(spec)} options; at most {MAX_CHOICES} are allowed.",
                fix=f"Pass at most {MAX_CHOICES} choices, or a regex or grammar instead.",
            )
        if not all(isinstance(c, str) and c for c in spec):
            raise RequestError(
                "Every choice must be a non-empty string.",
                fix='Pass e.g. "choice": ["yes", "no"].',
            )
        return json.dumps(list(spec))
    if not isinstance(spec, str) or not spec:
        raise RequestError(
            f"A {kind} constraint must be non-empty text.",
            fix=f"Pass the {kind} as a string.",
        )
    return spec


#: JSON is generated compact (``{"a":1}``): with free whitespace a weak or
#: random model can emit blanks until it runs out of tokens.
_JSON_OPTIONS: Any = {"whitespace_flexible": False}


def _grammar(kind: str, source: str) -> str:
    if kind in ("json_schema", "json_object"):
        return str(llg.LLMatcher.grammar_from_json_schema(source, defaults=_JSON_OPTIONS))
    if kind == "grammar":
        # llguidance reads llama.cpp's GBNF ("::=") and Lark alike.
        return str(llg.grammar_from("grammar", source))
    return str(llg.grammar_from(cast(Any, kind), source))


class _TokenizerTable:
    """llguidance's view of each tokenizer (built once: it indexes every token's bytes)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tables: weakref.WeakKeyDictionary[Any, dict[frozenset[int], llg.LLTokenizer]]
        self._tables = weakref.WeakKeyDictionary()

    def get(self, tokenizer: Tokenizer, eos: frozenset[int]) -> llg.LLTokenizer:
        with self._lock:
            per = self._tables.setdefault(tokenizer, {})
            found = per.get(eos)
            if found is None:
                # llguidance's reading of tokenizer.json takes every added token
                # spelled like ``<...>`` for a special token, which no literal can
                # then produce (and its mask and parser disagree about it). Tool-call
                # markers (``</tool_call>``) are such tokens but not special: the
                # byte table is rebuilt with the tokenizer's own special flags.
                read = llg.LLTokenizer(tokenizer.backend.to_str(), eos_token=sorted(eos))
                table = _ByteTable(tokenizer, read, min(eos))
                found = llg.LLTokenizer(
                    llg.TokenizerWrapper(table), eos_token=sorted(eos), slices=None
                )
                per[eos] = found
            return found


class _ByteTable:
    """The token table llguidance builds from: each token's bytes, the ids that are
    special (the tokenizer's own flag), and the tokenizer's encoder."""

    def __init__(self, tokenizer: Tokenizer, read: llg.LLTokenizer, eos: int) -> None:
        self.eos_token_id = eos
        self.bos_token_id = None
        self.tokens = [read.decode_bytes([i]) for i in range(read.vocab_size)]
        self.special_token_ids = sorted(tokenizer.special_token_ids)
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)


_TOKENIZERS = _TokenizerTable()
#: Compiles run here, so a caller waits at most COMPILE_SECONDS (llguidance
#: releases the GIL while it works; an abandoned compile ends by its fuel).
_COMPILER = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar")
#: llguidance's own thread pool, for the masks of a batch's rows at once.
_EXECUTOR = llg.LLExecutor()


def _check(grammar: str, lltok: llg.LLTokenizer) -> str:
    """What is wrong with ``grammar`` ("" when nothing): validated, then a matcher built
    and its first mask computed, so lazily built parts fail here, not mid-decode."""
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(
        grammar, lltok, limits=_limits()
    )
    if is_error:
        return messages[0].strip() if messages else "rejected by the grammar compiler"
    matcher = llg.LLMatcher(lltok, grammar, limits=_limits(), log_level=0)
    if not matcher.is_error():
        mask = allocate_masks(1, lltok.vocab_size)
        matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        forced = matcher.compute_ff_bytes()
        written = lltok.decode_bytes(matcher.compute_ff_tokens())
        if not forced.startswith(written):
            # The tokenizer drops characters it has no token for: no output can follow.
            text = forced.decode("utf-8", "replace")
            return f"the output must start with {text!r}, which this tokenizer cannot write"
    return _error(matcher)
_CACHE: OrderedDict[tuple[Any, ...], Constraint] = OrderedDict()
_CACHE_LOCK = threading.Lock()


def compile_constraint(
    kind: str, spec: Any, tokenizer: Tokenizer | None, eos: Iterable[int] | None = None
) -> Constraint:
    """Validate ``spec`` as a ``kind`` constraint for ``tokenizer``; the :class:`Constraint`.

    Raises :class:`~mlx_loom.errors.RequestError` naming the problem for a
    malformed spec, a schema feature the engine cannot enforce, or a grammar
    over the compile budget (:data:`PARSER_LIMITS`). Cached per spec.
    """
    if kind not in KINDS:
        raise RequestError(
            f"Unknown constraint kind {kind!r}.",
            fix=f"Use one of: {', '.join(KINDS)}.",
        )
    if tokenizer is None:
        raise RequestError(
            "Structured output needs the model's tokenizer (the grammar reads token text).",
            fix="Pass the tokenizer with the request.",
        )
    eos_set = frozenset(eos if eos is not None else tokenizer.eos_token_ids)
    if not eos_set:
        raise RequestError(
            "Structured output needs an end-of-sequence token to end a completed output, "
            "and this request has none.",
            fix="Pass eos token ids, or use a tokenizer that declares its eos_token.",
        )
    source = _source_text(kind, spec)
    if len(source.encode("utf-8", "replace")) > MAX_SOURCE_BYTES:
        raise RequestError(
            f"The {kind} is {len(source)} characters long; at most {MAX_SOURCE_BYTES} bytes "
            "are allowed.",
            fix="Shorten the schema or grammar.",
        )
    key = (kind, source, id(tokenizer), eos_set)
    with _CACHE_LOCK:
        hit = _CACHE.get(key)
        if hit is not None:
            _CACHE.move_to_end(key)
            return hit
    try:
        grammar = _grammar(kind, source)
    except ValueError as exc:
        raise RequestError(
            f"The {kind} is invalid: {exc}", fix=f"Correct the {kind}."
        ) from None
    lltok = _TOKENIZERS.get(tokenizer, eos_set)
    work = _COMPILER.submit(_check, grammar, lltok)
    try:
        problem = work.result(timeout=COMPILE_SECONDS)
    except concurrent.futures.TimeoutError:
        raise RequestError(
            f"Compiling the {kind} took longer than its budget ({COMPILE_SECONDS:g} s).",
            fix=f"Simplify the {kind} (fewer alternatives, less nesting, smaller repeats).",
        ) from None
    if problem:
        raise RequestError(
            f"The {kind} cannot be enforced: {problem}",
            fix=f"Correct the {kind}, or drop the features named (they are refused, "
            "never silently loosened).",
        )
    constraint = Constraint(kind, source, grammar)
    with _CACHE_LOCK:
        _CACHE[key] = constraint
        while len(_CACHE) > CACHE_ENTRIES:
            _CACHE.popitem(last=False)
    return constraint


def _error(matcher: llg.LLMatcher) -> str:
    """The matcher's error, without llguidance's placeholder for withheld detail."""
    return str(matcher.get_error()).replace("<non-verbose/>", "").strip()


# --- a row's parser state ------------------------------------------------------------------


class RowConstraint:
    """One row's parser state over its constraint (engine thread only)."""

    def __init__(self, constraint: Constraint, tokenizer: Tokenizer, eos: frozenset[int]) -> None:
        self.constraint = constraint
        self.tokenizer = _TOKENIZERS.get(tokenizer, eos)
        # Errors are read from the matcher and raised here (log_level 0: nothing on stderr).
        self.matcher = llg.LLMatcher(
            self.tokenizer, constraint.grammar, limits=_limits(), log_level=0
        )
        if self.matcher.is_error():
            raise RequestError(
                f"The {constraint.kind} cannot be enforced: {_error(self.matcher)}",
                fix=f"Correct the {constraint.kind}.",
            )
        self.words = (self.tokenizer.vocab_size + 31) // 32
        self.eos = eos
        #: Set once an end-of-sequence token ended the output.
        self.ended = False

    def advance(self, tokens: Sequence[int]) -> None:
        """Move past ``tokens`` (each one the grammar allowed).

        An end-of-sequence token on a complete grammar ends the output: it
        is not fed to the parser (a stopped parser takes no more tokens).
        """
        for token in tokens:
            if token in self.eos and self.matcher.is_accepting():
                self.ended = True
                continue
            if self.ended or not self.matcher.consume_token(token):
                raise ConstraintViolation(
                    f"token {token} broke the {self.constraint.kind} constraint: "
                    f"{_error(self.matcher) or 'the output was already complete'}"
                )

    def legal_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens``, in order, the grammar allows from here."""
        if not tokens:
            return 0
        return int(self.matcher.validate_tokens(list(tokens)))

    def fill(self, bitmask: np.ndarray, index: int) -> None:
        """Write this row's next-token mask into ``bitmask[index]`` (one bit per token)."""
        row = bitmask[index, : self.words]  # a row of a C-contiguous array: contiguous
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.size * row.itemsize)
        bitmask[index, self.words :] = 0  # ids past the tokenizer's vocabulary
        if self.matcher.is_error():
            raise ConstraintViolation(_error(self.matcher))

    def masks_along(self, drafts: Sequence[int]) -> np.ndarray:
        """Masks ``[len(drafts) + 1, words]``: here, and after each draft in turn.

        The drafts must be legal (:meth:`legal_prefix`); the state is rolled
        back afterwards.
        """
        out = allocate_masks(len(drafts) + 1, self.words * 32)
        self.fill(out, 0)
        for i, token in enumerate(drafts):
            self.advance([token])
            self.fill(out, i + 1)
        if drafts:
            self.matcher.rollback(len(drafts))
        return out


def allocate_masks(rows: int, vocab: int) -> np.ndarray:
    """A bitmask ``[rows, ceil(vocab/32)]`` with every token allowed."""
    return np.full((rows, (vocab + 31) // 32), -1, dtype=np.int32)


def mask_logits(logits: mx.array, bitmask: np.ndarray) -> mx.array:
    """``logits`` ``[B, V]`` with each token a row's bitmask forbids set to ``-inf``.

    Token ids past the bitmask's width (a model whose embedding is wider than
    its tokenizer) are forbidden; a mask row of all ones leaves its row's
    logits unchanged (the same values, bit for bit).
    """
    V = logits.shape[-1]
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=-1, bitorder="little").astype(bool)
    if allowed.shape[-1] < V:
        allowed = np.pad(allowed, ((0, 0), (0, V - allowed.shape[-1])))
    allowed = allowed[:, :V]
    return mx.where(mx.array(allowed), logits, mx.array(-float("inf"), logits.dtype))


def constrain_rows(
    constraints: Sequence[RowConstraint | None],
    fed: Sequence[int | None],
    logits: mx.array,
    failed: dict[int, BaseException],
) -> mx.array:
    """One decode step's masks: advance each constrained row past its newest token
    (``fed[j]``; ``None``: none was generated yet), then mask its logits row.

    A row whose parser fails is recorded in ``failed`` (it leaves alone) and
    keeps its unmasked logits for this step; unconstrained rows are untouched.
    """
    width = max([logits.shape[-1], *(c.words * 32 for c in constraints if c is not None)])
    bitmask = allocate_masks(len(constraints), width)
    live: list[int] = []
    for j, c in enumerate(constraints):
        if c is None:
            continue
        token = fed[j]
        try:
            if token is not None:
                c.advance([token])
            live.append(j)
        except BaseException as err:  # this row's grammar failed: it alone leaves
            failed[j] = err
    words = {constraints[j].words for j in live}  # type: ignore[union-attr]
    if len(live) > 1 and len(words) == 1:
        # Several rows: their masks are computed in parallel, on llguidance's threads.
        (n,) = words
        part = allocate_masks(len(live), n * 32)
        pairs = [(constraints[j].matcher, i) for i, j in enumerate(live)]  # type: ignore[union-attr]
        _EXECUTOR.unsafe_compute_mask_ptr(pairs, part.ctypes.data, n * 4, len(live))
        bitmask[live, :n] = part
        bitmask[live, n:] = 0
        for j in live:
            matcher = constraints[j].matcher  # type: ignore[union-attr]
            if matcher.is_error():
                failed[j] = ConstraintViolation(_error(matcher))
                bitmask[j] = -1
    else:
        for j in live:
            try:
                constraints[j].fill(bitmask, j)  # type: ignore[union-attr]
            except BaseException as err:
                failed[j] = err
                bitmask[j] = -1
    return mask_logits(logits, bitmask)


def check_constraint(model: Any, constraint: Any, tokenizer: Tokenizer | None) -> None:
    """A request's ``constraint=`` must be a compiled :class:`Constraint` the engine can run."""
    if not isinstance(constraint, Constraint):
        raise RequestError(
            f"constraint={constraint!r} is not a compiled constraint.",
            fix="Build it with mlx_loom.engine.constraints.compile_constraint(kind, spec, "
            "tokenizer), or pass response_format= / grammar= to generate().",
        )
    if tokenizer is None:
        raise RequestError(
            "Structured output needs the model's tokenizer (the grammar reads token text).",
            fix="Pass the tokenizer with the request.",
        )
    if getattr(model, "parallel", None) is not None:
        raise ParallelRefused(
            "Structured output is not supported for a model split across ranks yet: the "
            "other ranks rebuild each request from a plain description without its grammar.",
            fix="Run the model in one process, or drop the constraint.",
        )


def from_response_format(
    response_format: Any, tokenizer: Tokenizer | None, eos: Iterable[int] | None = None
) -> Constraint | None:
    """The constraint an OpenAI ``response_format`` asks for (``None``: plain text).

    ``{"type": "json_schema", "json_schema": {"schema": {...}, "strict": ...}}``,
    ``{"type": "json_object"}`` or ``{"type": "text"}``. The schema is
    enforced whether or not ``strict`` is set: a schema the engine cannot
    enforce is refused either way, never loosened.
    """
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise RequestError(
            f"response_format must be an object, not {type(response_format).__name__}.",
            fix='Pass {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}, '
            '{"type": "json_object"} or {"type": "text"}.',
        )
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return compile_constraint("json_object", None, tokenizer, eos)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping) or "schema" not in spec:
            raise RequestError(
                'response_format of type "json_schema" needs json_schema.schema.',
                fix='Pass {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}.',
            )
        return compile_constraint("json_schema", spec["schema"], tokenizer, eos)
    raise RequestError(
        f"response_format type {kind!r} is not supported.",
        fix='Use "json_schema", "json_object" or "text".',
    )


def from_options(
    tokenizer: Tokenizer | None,
    *,
    response_format: Any = None,
    grammar: str | None = None,
    eos: Iterable[int] | None = None,
) -> Constraint | None:
    """The Python API's constraint: ``response_format=`` (OpenAI's shape) or ``grammar=``
    (Lark or GBNF text) — at most one."""
    if response_format is not None and grammar is not None:
        raise RequestError(
            "Both response_format= and grammar= were given; a request has one constraint.",
            fix="Pass one of them.",
        )
    if grammar is not None:
        return compile_constraint("grammar", grammar, tokenizer, eos)
    return from_response_format(response_format, tokenizer, eos)
