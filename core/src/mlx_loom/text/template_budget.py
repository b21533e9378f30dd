"""Bounded chat templates: every render runs under a time budget and size budgets.

A chat template is code from the model artifact. The sandbox
(:mod:`mlx_loom.text.chat_template`) stops it from reaching Python internals;
this module stops it from taking unbounded time or memory, which the stock
jinja2 sandbox does not: ``{{ 'a' * 10**10 }}`` allocates 10 GB,
``{% set e = 10**8 %}{{ (7**e) % 10 }}`` computes a 280-million-bit integer
for minutes, and ``{{ 'a ' * 50000000 }}`` renders 100 MB that then abort the
tokenizer.

The budget (:class:`TemplateBudget`): ``timeout_s`` of wall time and
``max_output_chars`` of rendered text. Derived from the latter, no single
string or list the template builds may be longer than ``max_output_chars``,
and all it builds together may not exceed :data:`CREATED_FACTOR` times that.

How it is enforced, in the template's own thread, without a second process:

* **Operations that grow data are checked before they run.** ``*``, ``**``,
  ``+`` and ``%`` are intercepted (jinja's ``intercepted_binops``): string and
  list repetition and concatenation are sized first, integer products and
  powers are refused past :data:`MAX_INT_BITS`; ``%``, ``str.format`` and the
  ``format`` filter refuse field widths past :data:`MAX_FIELD_WIDTH`; every
  filter and method that can grow its input (``center``, ``indent``,
  ``replace``, ``join``, ``batch``, ``wordwrap``, ``str.translate`` ...) has
  its result size computed from its arguments before it is called.
* **No C-level walk over template-built data without a bounded look first.**
  A template can build ``[a, a]`` of ``[b, b]`` of ... 40 levels deep from a
  short source: 2**40 leaves in 80 list objects. ``str()``, ``==``, ``in``,
  hashing, sorting or serialising that runs in C for hours, where no time
  check can reach. So before any value is printed, compared, concatenated,
  used as a key, or handed to a filter, test or non-template function, its
  *expanded* size is measured by an iterative Python walk that stops as soon
  as it passes ``max_output_chars``, measuring each distinct container once.
  Comparisons, ``~``, loop iterables and dict literals with computed keys are
  compiled into checked calls for this purpose (a code generator subclass,
  jinja's documented hook for changing what templates compile to).
* **The deadline is checked everywhere control passes**: each loop
  iteration (loop iterables are wrapped), call, filter, test, operator,
  comparison and output piece. Between two checks runs one
  operation whose size was bounded above, so the overrun past ``timeout_s``
  is bounded too — a Python-level filter over the largest allowed list can
  take about a second. Templates cannot loop without a loop, and macro
  recursion ends at Python's recursion limit (a typed error).
* The output is counted as it streams; the source is capped at
  :data:`MAX_TEMPLATE_CHARS` before it is compiled.

Why in the rendering thread and not in a worker process that could be killed
mid-operation: a process per loaded model, a round trip per render, and a
dependency on being allowed to start processes, against a guarantee the
checks above already give — no operation can start that is larger than the
budget, so none can run for long or allocate much. What a worker would add is
a hard bound on the overrun of the time budget; here that overrun is bounded
by the size of one operation.

Measured overhead on real published templates (Llama 3, Qwen 2.5/3, Gemma,
Mistral, Phi-3 and others, 40-message conversations): see
``docs/limits.md`` and ``benchmarks/templates.py``.

Tuning: per call (``template_budget=`` on the tokenizer's chat methods), in
the CLI and server (``--template-timeout``, ``--template-max-output``), or
for the process (:data:`ENV_TIMEOUT`, :data:`ENV_MAX_OUTPUT`).
"""

from __future__ import annotations

import contextvars
import functools
import math
import operator
import os
import re
import string
import time
import types
from collections.abc import Callable, Iterable, Iterator, Mapping, MappingView
from typing import Any, cast

import jinja2
import jinja2.nodes as nodes
import jinja2.runtime
import jinja2.utils
from jinja2.compiler import CodeGenerator, Frame
from jinja2.sandbox import (
    ImmutableSandboxedEnvironment,
    SandboxedEscapeFormatter,
    SandboxedFormatter,
)
from markupsafe import Markup
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mlx_loom.errors import RequestError, TemplateBudgetExceeded

__all__ = [
    "CREATED_FACTOR",
    "DEFAULT_MAX_OUTPUT_CHARS",
    "DEFAULT_TIMEOUT_S",
    "ENV_MAX_OUTPUT",
    "ENV_TIMEOUT",
    "MAX_FIELD_WIDTH",
    "MAX_INT_BITS",
    "MAX_TEMPLATE_CHARS",
    "BudgetedSandbox",
    "TemplateBudget",
    "check_source",
    "compile_within",
    "render_within",
]

DEFAULT_TIMEOUT_S = 1.0
#: 2 Mi characters: about 500k tokens of ordinary text, past the context of
#: most models. The rendered text goes to the tokenizer next, which needs
#: ~250-550 bytes and ~6 us per token (measured: 1M tokens took 560 MB and 7 s
#: here), so this also bounds what a template can make the tokenizer do.
DEFAULT_MAX_OUTPUT_CHARS = 2 * 1024 * 1024
#: All strings and lists a render builds together, as a multiple of
#: ``max_output_chars``. Real templates build a few times their output (each
#: message is trimmed, concatenated, printed).
CREATED_FACTOR = 16
#: Largest integer (in bits) a product or power may produce: 2**65536 is far
#: beyond any arithmetic a prompt needs; multiplying two such numbers is
#: microseconds, while 7**(10**8) is minutes.
MAX_INT_BITS = 65536
#: Largest width or precision in one format field (``%5d``, ``{:>5}``,
#: ``|center(5)`` ...).
MAX_FIELD_WIDTH = 10_000
#: Largest template source compiled. Published chat templates are 0.1-40 KB.
MAX_TEMPLATE_CHARS = 1024 * 1024
#: Filters that run a Python loop per character or per item take at most this
#: much input, so one call (between two deadline checks) stays well under a
#: second: measured ~1 us per item for ``sort`` with its key function.
MAX_SLOW_FILTER_CHARS = 256 * 1024
MAX_SLOW_FILTER_ITEMS = 100_000
_SLOW_CHAR_FILTERS = frozenset({"wordwrap", "urlize", "pprint", "truncate"})
_GROWING_FILTERS = frozenset(
    {"center", "indent", "replace", "format", "join", "batch", "slice", "wordwrap"}
    | {"truncate", "tojson"}
)
_SLOW_ITEM_FILTERS = frozenset(
    {
        "sort",
        "dictsort",
        "unique",
        "groupby",
        "min",
        "max",
        "map",
        "select",
        "reject",
        "selectattr",
        "rejectattr",
        "sum",
        "batch",
        "slice",
        "xmlattr",
        "urlencode",
        "pprint",
    }
)

#: Filters and tests whose work on a container is shallow (its length, a
#: reference to one part, a copy of its references): they need no look at
#: what the container holds. Every other filter and test may write out,
#: compare, hash or sort its input in C, so its container arguments are
#: measured first.
_SHALLOW_FILTERS = frozenset(
    {"length", "count", "first", "last", "default", "d", "list", "reverse", "batch", "slice"}
    | {"items", "attr", "random", "select", "reject", "selectattr", "rejectattr", "map"}
)
_DEEP_TESTS = frozenset(
    {"eq", "equalto", "==", "ne", "!=", "lt", "lessthan", "<", "le", "<=", "gt"}
    | {"greaterthan", ">", "ge", ">=", "in"}
)
#: Methods of a list or tuple that compare its items (``index``, ``count``).
_DEEP_SEQUENCE_METHODS = frozenset({"index", "count"})

ENV_TIMEOUT = "MLX_LOOM_TEMPLATE_TIMEOUT"
ENV_MAX_OUTPUT = "MLX_LOOM_TEMPLATE_MAX_OUTPUT"

_TICK_EVERY = 1024  # walk steps and loop items between deadline checks
_JINJA_KWARGS = frozenset({"_loop_vars", "_block_vars"})


class TemplateBudget(BaseModel):
    """How much one chat-template render may take: wall time and output size."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    timeout_s: float = Field(DEFAULT_TIMEOUT_S, gt=0, le=3600, allow_inf_nan=False)
    max_output_chars: int = Field(DEFAULT_MAX_OUTPUT_CHARS, ge=1, le=1 << 31)

    @property
    def max_created_chars(self) -> int:
        return CREATED_FACTOR * self.max_output_chars

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TemplateBudget:
        """The defaults, overridden by :data:`ENV_TIMEOUT` / :data:`ENV_MAX_OUTPUT` when set."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name, field, cast in (
            (ENV_TIMEOUT, "timeout_s", float),
            (ENV_MAX_OUTPUT, "max_output_chars", int),
        ):
            raw = env.get(name)
            if raw is None or raw == "":
                continue
            try:
                values[field] = cast(raw)
            except ValueError:
                raise RequestError(
                    f"{name}={raw!r} is not a number",
                    fix=f"set {name} to a positive number, or unset it",
                ) from None
        return cls.checked(
            values, names={"timeout_s": ENV_TIMEOUT, "max_output_chars": ENV_MAX_OUTPUT}
        )

    def replaced(self, values: Mapping[str, Any], *, names: Mapping[str, str]) -> TemplateBudget:
        """This budget with ``values`` (``None`` entries ignored) replacing its fields."""
        given = {k: v for k, v in values.items() if v is not None}
        return self.checked({**self.model_dump(), **given}, names=names) if given else self

    @classmethod
    def checked(cls, values: Mapping[str, Any], *, names: Mapping[str, str]) -> TemplateBudget:
        """Build a budget from user input; ``names`` says what each field was called there.

        A bad value is a :class:`~mlx_loom.errors.RequestError` naming it.
        """
        try:
            return cls(**values)
        except ValidationError as err:
            item = err.errors()[0]
            field = str(item["loc"][0]) if item["loc"] else ""
            raise RequestError(
                f"{names.get(field, field)}={item.get('input')!r} is invalid for the chat-template "
                f"budget: {item['msg']}",
                fix="give the template time in seconds (more than 0, at most 3600) and its "
                "output budget in characters (at least 1)",
            ) from None


def _budget_fix(what: str) -> str:
    return (
        f"if the template is genuine, raise {what} (API: template_budget=TemplateBudget(...); "
        f"CLI and server: --template-timeout / --template-max-output; or {ENV_TIMEOUT} / "
        f"{ENV_MAX_OUTPUT}); otherwise replace the model's chat template, or pass "
        "--no-chat-template"
    )


class _Meter:
    """The accounting of one render: its deadline and what it has built so far."""

    __slots__ = ("budget", "deadline", "created", "ticks")

    def __init__(self, budget: TemplateBudget) -> None:
        self.budget = budget
        self.deadline = time.monotonic() + budget.timeout_s
        self.created = 0
        self.ticks = 0

    def tick(self) -> None:
        # Every hook ticks; the clock is read on every 8th. Each operation in
        # between is bounded in size, so this costs little precision.
        self.ticks += 1
        if self.ticks & 7 == 0 and time.monotonic() > self.deadline:
            raise TemplateBudgetExceeded(
                f"the chat template ran past its time budget of {self.budget.timeout_s:g} s",
                fix=_budget_fix("the time budget"),
            )

    def value(self, size: int, what: str) -> None:
        """Refuse one string or list of ``size`` characters or items before it is built."""
        limit = self.budget.max_output_chars
        if size > limit:
            raise TemplateBudgetExceeded(
                f"the chat template's {what} would be {size} characters or items long; "
                f"the limit is {limit} (its output budget)",
                fix=_budget_fix("the output budget"),
            )

    def built(self, result: Any) -> Any:
        """Count what an operation returned toward everything built; return it."""
        kind = type(result)
        if kind is str or kind is list or kind is tuple or kind is dict or kind is bytes:
            size = len(result)
        elif kind in _NUMBERS or result is None:
            return result
        else:
            size = _flat_size(result)
        if size:
            self.created += size
            if self.created > self.budget.max_created_chars:
                raise TemplateBudgetExceeded(
                    f"the chat template built more than {self.budget.max_created_chars} "
                    f"characters or items in all ({CREATED_FACTOR}x its output budget)",
                    fix=_budget_fix("the output budget"),
                )
        return result


_DEFAULT_BUDGET = TemplateBudget()
_ACTIVE: contextvars.ContextVar[_Meter | None] = contextvars.ContextVar(
    "mlx_loom_template_meter", default=None
)


def _meter() -> _Meter:
    """The meter of the render in progress.

    Outside :func:`render_within` (jinja folding constants while compiling, a
    caller rendering the template directly) each check gets a fresh meter with
    the default budget: the size checks hold, the deadline cannot.
    """
    meter = _ACTIVE.get()
    return meter if meter is not None else _Meter(_DEFAULT_BUDGET)


# --- sizes ---------------------------------------------------------------------


_LEAF_TYPES = frozenset({str, int, float, bool, type(None), bytes})
_NUMBERS = frozenset({int, float, bool})


def _flat_size(value: Any) -> int:
    if isinstance(value, (str, bytes, list, tuple, dict)):
        return len(value)
    return 0


def _is_container(value: Any) -> bool:
    return type(value) not in _LEAF_TYPES and isinstance(value, _CONTAINER_TYPES)


def _bounded_list(iterable: Any, meter: _Meter, what: str) -> list[Any]:
    """``list(iterable)``, refusing more items than the output budget allows."""
    out = []
    limit = meter.budget.max_output_chars
    for i, item in enumerate(iterable):
        if i >= limit:
            meter.value(i + 1, what)
        if i % _TICK_EVERY == 0:
            meter.tick()
        out.append(item)
    return out


_FIXED_SIZES: dict[type, int] = {type(None): 5, bool: 5, float: 24}
_CONTAINER_TYPES = (list, tuple, dict, MappingView, jinja2.utils.Namespace)


def _leaf_size(item: Any) -> int:
    if isinstance(item, str):
        return len(item) + 2
    if isinstance(item, bool) or item is None:
        return 5
    if isinstance(item, int):
        return item.bit_length() // 3 + 2
    if isinstance(item, bytes):
        return 4 * len(item) + 3
    return 8


def _kind(value: Any) -> str:
    names: dict[type, str] = {str: "string", bytes: "bytes", list: "list", tuple: "tuple"}
    return names.get(type(value), type(value).__name__)


def _parts(item: Any, meter: _Meter, what: str) -> tuple[int, list[Any]]:
    """A container's size without its container parts, and those parts.

    Every part writes out to at least 2 characters, so a container with more
    than a third of the limit in parts is refused before they are looked at.
    The loop over the parts is the hot path of every look: one type test each.
    """
    if isinstance(item, (list, tuple)):
        meter.value(3 * len(item) + 2, what)
        size, parts = len(item) + 2, item
    elif isinstance(item, dict):
        meter.value(6 * len(item) + 2, what)
        size, parts = 2 * len(item) + 2, [*item.keys(), *item.values()]
    elif isinstance(item, MappingView):
        size, parts = 2, _bounded_list(item, meter, what)
    else:  # a Namespace
        size, parts = 14, [object.__getattribute__(item, "_Namespace__attrs")]
    containers = []
    for i, part in enumerate(parts):
        kind = type(part)
        if kind is str:
            size += len(part) + 2
        elif kind is int:
            size += part.bit_length() // 3 + 2
        elif kind in _FIXED_SIZES:
            size += _FIXED_SIZES[kind]
        elif isinstance(part, _CONTAINER_TYPES):
            containers.append(part)
        else:
            size += _leaf_size(part)
        if i & 0xFFFF == 0xFFFF:
            meter.tick()
            meter.value(size, what)
    meter.value(size, what)
    return size, containers


def _expanded_size(value: Any, meter: _Meter, what: str) -> int:
    """The size of ``value`` written out, shared parts counted each time they appear.

    Computed bottom-up with each distinct container measured once, so
    ``[a, a]`` of ``[b, b]`` ... 40 levels deep costs 40 steps, not 2**40,
    and is refused at once. Iterative (depth costs no recursion). A value
    that contains itself (only a namespace can) is refused.
    """
    if not isinstance(value, _CONTAINER_TYPES):
        return _leaf_size(value)
    limit = meter.budget.max_output_chars
    done: dict[int, int] = {}  # id -> expanded size
    open_: dict[int, tuple[int, list[Any]]] = {}  # id -> (own size, container parts)
    keep: list[Any] = []  # holds every measured container, so no id is reused meanwhile
    stack = [value]
    while stack:
        node = stack[-1]
        key = id(node)
        if key in done:
            stack.pop()
        elif key in open_:  # every container part is measured now
            stack.pop()
            size, containers = open_.pop(key)
            for part in containers:
                size += done[id(part)]
                if size > limit:
                    meter.value(size, what)
            done[key] = size
            if len(done) % _TICK_EVERY == 0:
                meter.tick()
        else:
            size, containers = _parts(node, meter, what)
            open_[key] = (size, containers)
            keep.append(node)
            for part in containers:
                if id(part) in open_:  # an ancestor: the value contains itself
                    meter.value(limit + 1, what + " (it contains itself)")
                if id(part) not in done:
                    stack.append(part)
    return done[id(value)]


def _look(values: Iterable[Any], meter: _Meter, what: str) -> None:
    for value in values:
        if _is_container(value):
            _expanded_size(value, meter, what)


def _int_bits(value: Any) -> int:
    return abs(value).bit_length() if isinstance(value, int) else 0


def _count(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value


# --- operators -------------------------------------------------------------------


def _check_mul(left: Any, right: Any, meter: _Meter) -> None:
    for seq, n in ((left, right), (right, left)):
        count = _count(n)
        if isinstance(seq, (str, bytes, list, tuple)) and count is not None:
            size = len(seq) * max(count, 0)
            if size > meter.budget.max_output_chars:
                meter.value(size, f"{_kind(seq)} made by repetition")
            return
    if isinstance(left, int) and isinstance(right, int):
        bits = _int_bits(left) + _int_bits(right)
        if bits > MAX_INT_BITS:
            _too_big_int(bits)


def _check_pow(base: Any, exp: Any, meter: _Meter) -> None:
    if isinstance(base, int) and isinstance(exp, int) and exp > 0 and abs(base) > 1:
        bits = exp * math.log2(abs(base))
        if bits > MAX_INT_BITS:
            _too_big_int(int(bits))


def _too_big_int(bits: int) -> None:
    raise TemplateBudgetExceeded(
        f"the chat template tried to compute an integer of about {bits} bits; "
        f"the limit is {MAX_INT_BITS}",
        fix="no prompt needs integers this large: replace the model's chat template, or pass "
        "--no-chat-template",
    )


def _check_add(left: Any, right: Any, meter: _Meter) -> None:
    if type(left) in _NUMBERS:
        return
    for family in (str, bytes, list, tuple):
        if isinstance(left, family) and isinstance(right, family):
            size = len(left) + len(right)
            if size > meter.budget.max_output_chars:
                meter.value(size, f"{_kind(left)} made by concatenation")
            return


# ``%`` conversion specs: an optional ``(key)``, flags, width and precision
# (numbers or ``*``), a conversion.
_PERCENT_SPEC = re.compile(r"%(?:\(([^)]*)\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?[a-zA-Z%]")


def _check_percent(fmt: Any, args: Any, meter: _Meter) -> None:
    """``fmt % args`` sized before it runs: the text, each field's width, each value written.

    Fields take their values as Python does — ``%(key)s`` from a mapping,
    otherwise the next argument (a ``*`` width or precision takes one too) —
    and write at most the value's size padded to the width. Widths past
    :data:`MAX_FIELD_WIDTH` are refused outright.
    """
    if not isinstance(fmt, str):
        return
    named = args if isinstance(args, dict) else None
    values = args if isinstance(args, tuple) else (args,)
    _look(values, meter, "formatted value")
    position = 0

    def take() -> Any:
        nonlocal position
        value = values[position] if position < len(values) else None
        position += 1
        return value

    size = len(fmt)
    for match in _PERCENT_SPEC.finditer(fmt):
        if match.group().endswith("%"):
            continue  # a literal percent sign
        key, *numbers = match.groups()
        for part in numbers:
            if part == "*":
                width = _count(take()) or 0
            elif part is not None:
                width = int(part) if len(part) < 10 else MAX_FIELD_WIDTH + 1
            else:
                continue
            _check_width(abs(width))
            size += abs(width)
        value = named.get(key) if named is not None and key is not None else take()
        size += _expanded_size(value, meter, "formatted value")
        if size > meter.budget.max_output_chars:
            meter.value(size, "formatted string")


def _check_width(width: int) -> None:
    if width > MAX_FIELD_WIDTH:
        raise TemplateBudgetExceeded(
            f"the chat template asked for a field {width} characters wide; the limit is "
            f"{MAX_FIELD_WIDTH}",
            fix="replace the model's chat template, or pass --no-chat-template",
        )


_BINOP_CHECKS: dict[str, Callable[[Any, Any, _Meter], None]] = {
    "*": _check_mul,
    "**": _check_pow,
    "+": _check_add,
    "%": _check_percent,
}


# --- filters and methods -----------------------------------------------------------


def _str_arg(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _width_result(value: Any, width: Any, meter: _Meter, what: str) -> None:
    count = _count(width)
    if count is not None:
        meter.value(max(count, len(_str_arg(value))), what)


def _check_replace(value: Any, old: Any = None, new: Any = None, count: Any = -1) -> int | None:
    """The length of ``value.replace(old, new, count)``, without building it.

    ``None`` when it cannot be longer than ``value`` (or the arguments are not strings).
    """
    if not isinstance(value, str) or not isinstance(old, str) or not isinstance(new, str):
        return None
    if old and len(new) <= len(old):
        return None  # cannot grow
    hits = len(value) + 1 if old == "" else value.count(old)
    if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
        hits = min(hits, count)
    return len(value) + hits * (len(new) - len(old))


def _check_join_parts(parts: Any, sep: Any, meter: _Meter) -> None:
    if isinstance(parts, (list, tuple)):
        size = sum(len(p) if isinstance(p, str) else 8 for p in parts)
        size += max(len(parts) - 1, 0) * len(_str_arg(sep))
        meter.value(size, "joined string")


def _slow_input(value: Any, name: str) -> None:
    """Refuse more input than a filter that loops in Python can take between two checks."""
    if name in _SLOW_CHAR_FILTERS and isinstance(value, str):
        size, limit, unit = len(value), MAX_SLOW_FILTER_CHARS, "characters"
    elif name in _SLOW_ITEM_FILTERS and isinstance(value, (list, tuple, dict, str)):
        size, limit, unit = len(value), MAX_SLOW_FILTER_ITEMS, "items"
    else:
        return
    if size > limit:
        raise TemplateBudgetExceeded(
            f"the chat template passed {size} {unit} to the {name!r} filter; it takes at "
            f"most {limit}",
            fix="replace the model's chat template, or pass --no-chat-template",
        )


def _pre_filter(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], meter: _Meter) -> None:
    """Size checks for filters whose result can outgrow their input."""
    value = args[0] if args else None
    rest = args[1:]
    _slow_input(value, name)

    def arg(i: int, key: str, default: Any = None) -> Any:
        return rest[i] if len(rest) > i else kwargs.get(key, default)

    if name == "center":
        _check_width(_count(arg(0, "width", 80)) or 0)
        _width_result(value, arg(0, "width", 80), meter, "centred string")
    elif name == "indent":
        width = arg(0, "width", 4)
        pad = len(width) if isinstance(width, str) else (_count(width) or 0)
        _check_width(pad)
        lines = _str_arg(value).count("\n") + 1
        meter.value(len(_str_arg(value)) + lines * pad, "indented string")
    elif name == "replace":
        size = _check_replace(value, arg(0, "old"), arg(1, "new"), arg(2, "count", -1))
        if size is not None:
            meter.value(size, "string after replacement")
    elif name == "format":
        _check_percent(value, tuple(rest) or kwargs, meter)
    elif name == "join":
        _check_join_parts(value, arg(0, "d", ""), meter)
    elif name in ("batch", "slice"):
        count = _count(arg(0, "linecount" if name == "batch" else "slices"))
        if count is not None:
            meter.value(count, f"list from the {name!r} filter")
    elif name in ("wordwrap", "truncate"):
        if name == "wordwrap":
            wrap = arg(2, "wrapstring") or "\n"
            meter.value(len(_str_arg(value)) * (1 + len(_str_arg(wrap))), "wrapped string")
        if name == "truncate":
            meter.value(
                len(_str_arg(value)) + len(_str_arg(arg(2, "end", "..."))), "truncated string"
            )
    elif name == "tojson":
        indent = _count(arg(0, "indent"))
        if indent is not None:
            _check_width(indent)


def _pre_str_method(method: str, s: str, args: tuple[Any, ...], meter: _Meter) -> None:
    """Size checks for the ``str`` methods that can outgrow the string."""
    if method in ("center", "ljust", "rjust", "zfill") and args:
        count = _count(args[0])
        if count is not None:
            _check_width(count)
    elif method == "expandtabs":
        size = _count(args[0]) if args else 8
        meter.value(len(s) * max(size or 0, 1), "string with tabs expanded")
    elif method == "replace":
        size = _check_replace(s, *args[:3])
        if size is not None:
            meter.value(size, "string after replacement")
    elif method == "join" and args:
        _check_join_parts(args[0], s, meter)
    elif method == "translate" and args and isinstance(args[0], dict):
        widest = max((len(v) for v in args[0].values() if isinstance(v, str)), default=1)
        meter.value(len(s) * max(widest, 1), "translated string")


class _BoundedFormatterMixin:
    """``str.format`` fields: widths bounded, the total size counted as fields are written."""

    _meter_ref: _Meter
    _written: int

    def format_field(self, value: Any, format_spec: str) -> Any:
        for digits in re.findall(r"\d+", format_spec):
            _check_width(int(digits) if len(digits) < 10 else MAX_FIELD_WIDTH + 1)
        if _is_container(value):
            _expanded_size(value, self._meter_ref, "formatted value")
        out = super().format_field(value, format_spec)  # type: ignore[misc]
        self._written += len(out)
        self._meter_ref.value(self._written, "formatted string")
        return out


class _BoundedFormatter(_BoundedFormatterMixin, SandboxedFormatter):
    pass


class _BoundedEscapeFormatter(_BoundedFormatterMixin, SandboxedEscapeFormatter):
    pass


# --- compare, dict literals, loops, concatenation (compiled into calls) ------------------

_COMPARE: dict[str, Callable[[Any, Any], Any]] = {
    "eq": operator.eq,
    "ne": operator.ne,
    "gt": operator.gt,
    "gteq": operator.ge,
    "lt": operator.lt,
    "lteq": operator.le,
    "in": lambda a, b: a in b,
    "notin": lambda a, b: a not in b,
}


def _compare(first: Any, *ops_and_values: Any) -> bool:
    """``first op1 v1 op2 v2 ...``, chained like Python (operands already evaluated).

    Containers are looked at first: ``==``, ``<`` and ``in`` walk them in C.
    """
    meter = _meter()
    meter.tick()
    if len(ops_and_values) == 2:  # one comparison: the common case
        op, right = ops_and_values
        if type(first) not in _LEAF_TYPES or type(right) not in _LEAF_TYPES:
            _look((first, right), meter, "compared value")
        return _COMPARE[op](first, right)
    if type(first) not in _LEAF_TYPES:
        _look((first,), meter, "compared value")
    left = first
    for i in range(0, len(ops_and_values), 2):
        op, right = ops_and_values[i], ops_and_values[i + 1]
        if type(right) not in _LEAF_TYPES:
            _look((right,), meter, "compared value")
        if not _COMPARE[op](left, right):
            return False
        left = right
    return True


def _dict(*pairs: tuple[Any, Any]) -> dict[Any, Any]:
    return dict(pairs)


# What the call hook says it measured (compiled calls), and calls that need no look:
# iterating does not write anything out.
_dict._loom_what = "dictionary key"  # type: ignore[attr-defined]


def _iterate(iterable: Any) -> Iterator[Any]:
    meter = _meter()
    meter.tick()
    for i, item in enumerate(iterable):
        if i % 64 == 0:
            meter.tick()
        yield item


_iterate._loom_look = False  # type: ignore[attr-defined]


def _concat(parts: tuple[Any, ...]) -> str:
    meter = _meter()
    meter.tick()
    _look(parts, meter, "concatenated value")
    size = sum(len(p) if isinstance(p, str) else 0 for p in parts)
    meter.value(size, "concatenated string")
    return meter.built("".join([str(p) for p in parts]))


class _BudgetCodeGenerator(CodeGenerator):
    """Compiles comparisons, ``~``, loop iterables and computed-key dicts into checked calls.

    Comparisons and ``~`` are frequent, so they become direct calls of our own
    functions (``environment.budget_compare(a, "eq", b)``), which tick and
    look at container operands themselves. Loop iterables and dict literals
    with computed keys become ordinary template calls, through the sandbox's
    ``call`` hook. Either way nothing is compared, hashed, iterated or
    stringified before the checks.
    """

    def _call(self, name: str, args: list[nodes.Expr], lineno: int) -> nodes.Call:
        call = nodes.Call(nodes.EnvironmentAttribute(name), args, [], None, None)
        call.set_lineno(lineno)
        return call

    def visit_Compare(self, node: nodes.Compare, frame: Frame) -> None:  # noqa: N802
        self.write("environment.budget_compare(")
        self.visit(node.expr, frame)
        for operand in node.ops:
            self.write(f", {operand.op!r}, ")
            self.visit(operand.expr, frame)
        self.write(")")

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:  # noqa: N802
        self.write("environment.budget_concat((")
        for child in node.nodes:
            self.visit(child, frame)
            self.write(", ")
        self.write("))")

    def visit_Dict(self, node: nodes.Dict, frame: Frame) -> None:  # noqa: N802
        if all(isinstance(pair.key, nodes.Const) for pair in node.items):
            super().visit_Dict(node, frame)
            return
        pairs: list[nodes.Expr] = [
            cast(nodes.Expr, nodes.Tuple([pair.key, pair.value], "load")) for pair in node.items
        ]
        self.visit(self._call("budget_dict", pairs, node.lineno), frame)

    def visit_For(self, node: nodes.For, frame: Frame) -> None:  # noqa: N802
        node.iter = self._call("budget_iterate", [cast(nodes.Expr, node.iter)], node.lineno)
        super().visit_For(node, frame)


# --- the environment --------------------------------------------------------------------


class BudgetedSandbox(ImmutableSandboxedEnvironment):
    """A sandboxed environment whose renders are bounded by the active :class:`TemplateBudget`.

    Render with :func:`render_within`; a plain ``template.render()`` is
    bounded by the defaults.
    """

    code_generator_class = _BudgetCodeGenerator
    intercepted_binops = frozenset(_BINOP_CHECKS)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.finalize = _finalize
        self.globals.pop("lipsum", None)  # lipsum(10**9) builds text in a Python loop
        self.budget_compare = _compare
        self.budget_dict = _dict
        self.budget_iterate = _iterate
        self.budget_concat = _concat
        self.filters = _Wrapped(cast(Mapping[str, Callable[..., Any]], self.filters), kind="filter")
        self.tests = _Wrapped(cast(Mapping[str, Callable[..., Any]], self.tests), kind="test")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        meter = _meter()
        meter.tick()
        _BINOP_CHECKS[operator](left, right, meter)
        return meter.built(self.binop_table[operator](left, right))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        meter = _meter()
        meter.tick()
        kind = type(__obj)
        if kind is types.BuiltinMethodType:  # a method of a str, list, dict ...
            if args:
                _look(args, meter, "call argument")
            owner = __obj.__self__
            if isinstance(owner, str):
                if __obj.__name__ == "join" and args and not isinstance(args[0], (list, tuple)):
                    args = (_bounded_list(args[0], meter, "joined list"), *args[1:])
                    _look(args[:1], meter, "call argument")
                _pre_str_method(__obj.__name__, owner, args, meter)
            elif isinstance(owner, (list, tuple)) and __obj.__name__ in _DEEP_SEQUENCE_METHODS:
                _expanded_size(owner, meter, "value whose method it calls")
        elif kind is not jinja2.runtime.Macro and getattr(__obj, "_loom_look", True):
            what = getattr(__obj, "_loom_what", "call argument")
            if args:
                _look(args, meter, what)
            if kwargs:  # jinja adds _loop_vars/_block_vars inside loops: not arguments
                _look((v for k, v in kwargs.items() if k not in _JINJA_KWARGS), meter, what)
        return meter.built(super().call(__context, __obj, *args, **kwargs))

    # Attribute and item access are O(1) and need no deadline check (work that
    # could run long needs a loop or a call, and those check); only a tuple key
    # can make Python hash a large shared structure.

    def getitem(self, obj: Any, argument: Any) -> Any:
        if isinstance(argument, tuple):
            _expanded_size(argument, _meter(), "dictionary key")
        return super().getitem(obj, argument)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        if not isinstance(value, (types.MethodType, types.BuiltinMethodType)) or (
            value.__name__ not in ("format", "format_map")
        ):
            return None
        owner = value.__self__
        if not isinstance(owner, str):
            return None
        is_map = value.__name__ == "format_map"
        env = self

        def bounded_format(*args: Any, **kwargs: Any) -> str:
            meter = _meter()
            meter.tick()
            if is_map:
                if kwargs or len(args) != 1:
                    raise TypeError("format_map() takes exactly one positional argument")
                kwargs = args[0]
                args = ()
            if isinstance(owner, Markup):
                formatter: string.Formatter = _BoundedEscapeFormatter(env, escape=owner.escape)
            else:
                formatter = _BoundedFormatter(env)
            formatter._meter_ref, formatter._written = meter, 0  # type: ignore[attr-defined]
            return meter.built(type(owner)(formatter.vformat(owner, args, kwargs)))

        return functools.update_wrapper(bounded_format, value)


class _Wrapped(dict):
    """The filter (or test) table, each entry wrapped with the deadline and size checks.

    A dict subclass so jinja's own lookups and ``environment.filters[name] = f``
    keep working; entries added later are wrapped as they are set.
    """

    def __init__(self, table: Mapping[str, Callable[..., Any]], *, kind: str) -> None:
        super().__init__()
        self.kind = kind
        for name, fn in table.items():
            self[name] = fn

    def __setitem__(self, name: str, fn: Callable[..., Any]) -> None:
        super().__setitem__(name, _wrap(name, fn, self.kind))

    def update(self, *args: Any, **kwargs: Any) -> None:
        for name, fn in dict(*args, **kwargs).items():
            self[name] = fn

    def setdefault(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:  # type: ignore[override]
        if name not in self:
            self[name] = fn
        return self[name]


def _wrap(name: str, fn: Callable[..., Any], kind: str) -> Callable[..., Any]:
    if getattr(fn, "_loom_budgeted", False):
        return fn
    passes_arg = getattr(fn, "jinja_pass_arg", None) is not None
    shallow = name in _SHALLOW_FILTERS if kind == "filter" else name not in _DEEP_TESTS
    checked = kind == "filter" and (
        name in _GROWING_FILTERS or name in _SLOW_CHAR_FILTERS or name in _SLOW_ITEM_FILTERS
    )
    what_input, what_arg = f"input to the {name!r} {kind}", f"argument to the {name!r} {kind}"

    @functools.wraps(fn)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        meter = _meter()
        meter.tick()
        plain = args[1:] if passes_arg else args  # drop the context jinja passes first
        if name == "join" and plain and not isinstance(plain[0], (str, list, tuple)):
            # join stringifies in C: make the parts a list, then size them
            plain = (_bounded_list(plain[0], meter, "joined list"), *plain[1:])
            args = (*args[: len(args) - len(plain)], *plain)
        if not shallow:
            _look(plain, meter, what_input)
            if kwargs:
                _look(kwargs.values(), meter, what_arg)
        if checked:
            _pre_filter(name, plain, kwargs, meter)
        return meter.built(fn(*args, **kwargs))

    bounded._loom_budgeted = True  # type: ignore[attr-defined]
    return bounded


def _finalize(value: Any) -> Any:
    """Every ``{{ ... }}`` value passes here before jinja turns it into text."""
    meter = _meter()
    meter.tick()
    if _is_container(value):
        _expanded_size(value, meter, "printed value")
    return value


# --- entry points ---------------------------------------------------------------------------


def check_source(source: str, origin: str) -> None:
    """Refuse a template source too large to compile within any reasonable time."""
    if len(source) > MAX_TEMPLATE_CHARS:
        raise TemplateBudgetExceeded(
            f"the chat template from {origin} is {len(source)} characters; the limit is "
            f"{MAX_TEMPLATE_CHARS}",
            fix="replace the model's chat template, or pass --no-chat-template",
        )


def compile_within(env: jinja2.Environment, source: str, budget: TemplateBudget) -> jinja2.Template:
    """``env.from_string(source)`` with ``budget`` active: jinja folds constants while compiling."""
    token = _ACTIVE.set(_Meter(budget))
    try:
        return env.from_string(source)
    finally:
        _ACTIVE.reset(token)


def render_within(
    template: jinja2.Template, budget: TemplateBudget, variables: dict[str, Any]
) -> str:
    """Render ``template`` with ``variables`` under ``budget``.

    Raises :class:`~mlx_loom.errors.TemplateBudgetExceeded` when it runs out.
    """
    meter = _Meter(budget)
    token = _ACTIVE.set(meter)
    try:
        pieces: list[str] = []
        size = 0
        for piece in template.generate(**variables):
            size += len(piece)
            if size > budget.max_output_chars:
                raise TemplateBudgetExceeded(
                    f"the chat template's output passed its budget of "
                    f"{budget.max_output_chars} characters",
                    fix=_budget_fix("the output budget"),
                )
            pieces.append(piece)
            meter.tick()
        return "".join(pieces)
    finally:
        _ACTIVE.reset(token)
