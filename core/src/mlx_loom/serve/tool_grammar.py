"""Grammars for forced tool calls: the model's own call format, arguments valid by schema.

With ``tool_choice: "required"`` or a named function the prompt already
ends with the format's start marker (and, for a name, the opening of the
call: :func:`mlx_loom.serve.tools.prompt_suffix`). The grammar here is the
rest of the call, in the format the model was trained on, written so that
the format's own parser (:mod:`mlx_loom.text.tool_calls`) reads it and the
arguments, once coerced to the schema's types, validate. One call per reply.

* JSON formats — ``json_tools`` (Hermes, Qwen), ``mistral`` (either
  spelling) and ``harmony`` (gpt-oss; the call's role header is in the
  prompt, the JSON arguments end the reply) — hold the arguments with
  llguidance's JSON-schema compiler.
* Text formats — ``qwen3_coder`` and ``minicpm5`` (XML parameters),
  ``gemma4`` (``key:<|"|>text<|"|>``) and ``pythonic`` (``f(key="text")``) —
  write each parameter in the format's own notation, typed by its schema:
  a string (with ``minLength``/``maxLength``) that cannot hold the text
  that would end it early (``</parameter>``, ``<|"|>``, the end marker), an
  integer, a number, a boolean, ``null``, an ``enum`` or ``const``; object and
  array values are JSON, held to their schema. A schema keyword such a value
  cannot carry (a string ``pattern``, a number's bounds) is refused, never
  loosened.

A format without a grammar here (a plugin's) is refused for forced calls
(422 naming the format) rather than left unconstrained.
"""
from __future__ import annotations

import json
import keyword
import re
import unicodedata
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import CapabilityRefused, RequestError
from ..text import Tokenizer
from .tools import ChatFormat, ToolPlan

#: Compact JSON inside a call (``%json`` in a Lark grammar): free whitespace
#: lets a weak model pad forever.
_COMPACT = {"whitespace_flexible": False}


def _lit(text: str) -> str:
    """A Lark string literal for ``text``."""
    return json.dumps(text, ensure_ascii=False)


def _json_rule(schema: Mapping[str, Any]) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": _COMPACT}, ensure_ascii=False)


def _parameters(tool: Mapping[str, Any]) -> dict[str, Any]:
    """The tool's parameters schema. A forced call writes the declared parameters only
    (no ``additionalProperties`` unless the schema asks for them): stricter, still valid,
    and a weak model cannot pad the call with invented keys."""
    params = tool["function"].get("parameters")
    params = dict(params) if isinstance(params, Mapping) else {"type": "object"}
    if "properties" in params:
        params.setdefault("additionalProperties", False)
    return params


# --- json_tools: <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call> -------------


def _call_head(name: str) -> str:
    """``{"name":"f","arguments":`` (compact, as the JSON formats' calls begin)."""
    return _lit('{"name":' + json.dumps(name, ensure_ascii=False) + ',"arguments":')


def _json_tools(tools: dict[str, dict[str, Any]], named: str | None, template: str) -> str:
    g = _Grammar()
    end = _lit("}\n</tool_call>")
    if named is not None:  # the prompt ends with '\n{"name": "f", "arguments": '
        return g.text(f"{_json_arguments(g, 'json_tools', named, tools[named])} {end}")
    alts = [
        f"({_call_head(name)} {_json_arguments(g, 'json_tools', name, params)})"
        for name, params in tools.items()
    ]
    return g.text(f"{_lit(chr(10))} ({' | '.join(alts)}) {end}")


# --- text formats: each parameter in the format's notation, typed by its schema -------------

_INTEGER = r"-?(0|[1-9][0-9]{0,17})"
#: Exponents of two digits at most: ``1e999`` reads as infinity, which no JSON carries.
_NUMBER = r"-?(0|[1-9][0-9]{0,17})(\.[0-9]{1,17})?([eE][-+]?[0-9]{1,2})?"
#: Keywords that only describe a value (nothing to enforce).
_DESCRIPTIVE = {"type", "description", "title", "default", "examples", "$comment"}
#: Object keywords a parameter list honours (extra parameters are never written).
_OBJECT_KEYS = _DESCRIPTIVE | {"properties", "required", "additionalProperties", "$schema"}
_SCALARS = ("string", "integer", "number", "boolean", "null")
#: The longest string bound a text value takes (the regex grows with it).
MAX_STRING_BOUND = 10_000
#: How deeply typed objects and arrays may nest in one parameter.
MAX_NESTING = 16


@dataclass(frozen=True)
class _Style:
    """How a text format writes one parameter value (see the format's parser)."""

    name: str
    #: A regex for one character a string value may hold.
    chars: str
    #: Texts a string value may not contain (they would end it, or the call, early).
    forbid: tuple[str, ...]
    #: The string value's quotes (``""`` for the XML formats' bare text).
    quote: str = ""
    #: Written before and after every value (the XML formats' layout and closing tag).
    before: str = ""
    after: str = ""
    #: The parser trims a value: a string may not start or end with whitespace.
    strip: bool = False
    #: Objects and arrays are written in this notation, not as JSON (Python literals).
    literal_nesting: bool = False
    #: A JSON format: a value this style cannot type is left to the JSON-schema compiler.
    json: bool = False

    def constant(self, value: Any, where: str) -> str:
        """The text of one ``enum``/``const`` member, or a refusal."""
        if not isinstance(value, str):  # JSON text: read as JSON, Gemma or Python data
            text = json.dumps(value, ensure_ascii=False)
            self._check_text(text, where)
            return text
        if self.json or self.name == "pythonic":  # (JSON escapes read the same in Python)
            text = json.dumps(value, ensure_ascii=False)
        elif self.name == "gemma4":  # its parser also reads a JSON string exactly
            quote = '<|"|>'
            if quote in value:
                text = json.dumps(value, ensure_ascii=False)
            else:
                self._check_text(value, where)  # the quote is not in it; the end marker?
                return quote + value + quote
        else:
            text = value
            if not re.fullmatch(f"(?:{self.chars})*", text, re.DOTALL) or (
                self.strip and text != text.strip()
            ):
                raise RequestError(
                    f"{where}: the value {value!r} cannot be written verbatim in the "
                    f"{self.name} tool-call format.",
                    fix="Use plain enum values, or tool_choice 'auto'.",
                )
        self._check_text(text, where)
        return text

    def _check_text(self, text: str, where: str) -> None:
        for marker in self.forbid:
            if marker in text:
                raise RequestError(
                    f"{where}: a value holds {marker!r}, which ends it early in the "
                    f"{self.name} tool-call format.",
                    fix="Use other enum values, or tool_choice 'auto'.",
                )


_STYLES = {
    "qwen3_coder": _Style(
        "qwen3_coder", r"(?s:.)", ("</parameter>", "</function>", "</tool_call>"),
        before="\n", after="\n</parameter>\n",
    ),
    "minicpm5": _Style("minicpm5", r"[^<&\x00-\x1f]", ("</param>",), after="</param>", strip=True),
    "gemma4": _Style("gemma4", r"(?s:.)", ('<|"|>', "<tool_call|>"), quote='<|"|>'),
    "pythonic": _Style(
        "pythonic", r'[^"\\\x00-\x1f]', ("<|tool_call_end|>",), quote='"', literal_nesting=True
    ),
}


#: One character of a JSON string as written: plain, or an escape (no lone surrogates,
#: which no UTF-8 reply can carry).
_JSON_CHAR = (
    r'[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u([0-9a-cA-CefEF][0-9a-fA-F]{3}|[dD][0-7][0-9a-fA-F]{2})'
)
_JSON_STYLES = {
    "json_tools": _Style("json_tools", _JSON_CHAR, ("</tool_call>",), quote='"', json=True),
    "mistral": _Style("mistral", _JSON_CHAR, ("[TOOL_CALLS]",), quote='"', json=True),
    "harmony": _Style("harmony", _JSON_CHAR, ("<|call|>",), quote='"', json=True),
}


def _json_arguments(g: _Grammar, fmt: str, tool: str, schema: Mapping[str, Any]) -> str:
    """A JSON format's arguments object, parameter by parameter: strings that cannot
    spell the format's end marker, finite numbers; whatever else the schema says is
    the JSON-schema compiler's (a schema not shaped as plain properties, whole)."""
    style = _JSON_STYLES[fmt]
    try:
        props, required = _properties(schema, tool)
    except RequestError:
        return _json_rule(schema)
    items = []
    for name, sub in props.items():
        key = json.dumps(name, ensure_ascii=False) + ":"
        style._check_text(key, _where(tool, name))
        items.append((f"{_lit(key)} {_value(g, style, sub, tool, name, 0)}", name in required))
    body = g.sequence(items, '","') if items else '""'
    return f'"{{" {body} "}}"'


def _rx(pattern: str) -> str:
    """A Lark regex literal."""
    return "/" + pattern.replace("/", "\\/") + "/"


def _escape(text: str) -> str:
    """``text`` as a regex matching it literally (every non-alphanumeric as ``\\x{..}``)."""
    return "".join(c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):x}}}" for c in text)


class _Grammar:
    """One Lark grammar being written: tokens and rules get fresh names."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def token(self, body: str) -> str:
        name = f"T{len(self.lines)}"
        self.lines.append(f"{name}: {body}")
        return name

    def rule(self, body: str) -> str:
        name = f"r{len(self.lines)}"
        self.lines.append(f"{name}: {body}")
        return name

    def text(self, start: str) -> str:
        return "\n".join([f"start: {start}", *self.lines]) + "\n"

    def sequence(self, items: list[tuple[str, bool]], sep: str) -> str:
        """The items in order, each required one present, ``sep`` between those written."""
        after = first = '""'
        for item, required in reversed(items):
            rest = after
            after = self.rule(f"{sep} {item} {rest}" if required else f"({sep} {item})? {rest}")
            first = self.rule(
                f"{item} {rest}" if required else f"{item} {rest} | {first}"
            )
        return first


def _where(tool: str, path: str) -> str:
    return f"tool {tool!r}, parameter {path!r}"


def _value(g: _Grammar, style: _Style, schema: Any, tool: str, path: str, depth: int) -> str:
    """A Lark expression for one value, with the style's layout around it; or a refusal."""
    where = _where(tool, path)
    if depth > MAX_NESTING:
        raise RequestError(
            f"{where}: nested deeper than {MAX_NESTING} levels.", fix="Flatten the schema."
        )
    if not isinstance(schema, Mapping):
        schema = {}
    before = _lit(style.before) if style.before else ""
    after = _lit(style.after) if style.after else ""
    if "enum" in schema or "const" in schema:
        members = schema["enum"] if "enum" in schema else [schema["const"]]
        if not isinstance(members, list) or not members:
            raise RequestError(f"{where}: enum must be a non-empty list.", fix="Fix the schema.")
        texts = dict.fromkeys(style.constant(m, where) for m in members)
        alts = " | ".join(_lit(style.before + t + style.after) for t in texts)
        return g.token(f"({alts})")
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if any(k in ("object", "array") for k in kinds):
        inner = _inner(style)
        if len(kinds) == 1:
            value = _nested(g, inner, schema, tool, path, depth)
        elif inner.json:  # a union with objects or arrays: the JSON-schema compiler's
            value = _json_rule(schema)
        else:
            raise RequestError(
                f"{where}: type {kind!r} cannot be enforced in the {style.name} tool-call "
                "format.",
                fix="Declare a single type for object and array values.",
            )
        return " ".join(p for p in (before, value, after) if p)
    if kind is None and not set(schema) - _DESCRIPTIVE and (style.json or style.literal_nesting):
        return _any(g, style)  # any value (an XML format writes it as text)
    if not all(k is None or k in _SCALARS for k in kinds) or len(kinds) == 0:
        if style.json:
            return _json_rule(schema)
        raise RequestError(
            f"{where}: type {kind!r} cannot be enforced in the {style.name} tool-call format.",
            fix="Declare string, integer, number, boolean, null, object or array.",
        )
    text_kinds = {None, "string"}
    lengths = {"minLength", "maxLength"} if any(k in text_kinds for k in kinds) else set()
    extra = sorted(set(schema) - _DESCRIPTIVE - lengths)
    if extra and style.json:  # a pattern, bounds, anyOf...: the JSON-schema compiler's
        return _json_rule(schema)
    if extra:
        raise RequestError(
            f"{where}: the keyword(s) {extra} cannot be enforced in the {style.name} "
            "tool-call format (a parameter value is written as text).",
            fix="Drop those keywords from the tool's parameters, or use tool_choice 'auto'.",
        )
    options: list[str] = []
    for k in dict.fromkeys(kinds):
        if k in text_kinds:
            options.append(_string(g, style, schema, where))
            continue
        body = {"integer": _rx(_INTEGER), "number": _rx(_NUMBER)}.get(
            k, '("true" | "false")' if k == "boolean" else '"null"'
        )
        options.append(g.token(" ".join(p for p in (before, body, after) if p)))
    return options[0] if len(options) == 1 else "(" + " | ".join(options) + ")"


def _string(g: _Grammar, style: _Style, schema: Mapping[str, Any], where: str) -> str:
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    if not all(
        isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= MAX_STRING_BOUND
        for n in (low, low if high is None else high)
    ) or (high is not None and high < low):
        raise RequestError(
            f"{where}: minLength/maxLength must be integers from 0 to {MAX_STRING_BOUND}, "
            "minLength the smaller.",
            fix="Fix the schema.",
        )
    bound = f"{{{low},{'' if high is None else high}}}"
    negatives = ["(?s:.*(" + "|".join(_escape(m) for m in style.forbid) + ").*)"]
    if style.strip:
        negatives.append(r"(?s:\s.*|.*\s)")
    text = g.token(
        " & ".join([_rx(f"(?:{style.chars}){bound}"), *(f"~{_rx(n)}" for n in negatives)])
    )
    edge = style.before + style.quote, style.quote + style.after
    return g.token(" ".join(p for p in (_lit(edge[0]) if edge[0] else "", text,
                                        _lit(edge[1]) if edge[1] else "") if p))


def _inner(style: _Style) -> _Style:
    """How values nested in objects and arrays are written: Python literals in the
    pythonic format, JSON elsewhere (the XML formats' object values are JSON text),
    never holding the text that would end the call early."""
    if style.json or style.literal_nesting:
        return style
    return _Style(style.name, _JSON_CHAR, style.forbid, quote='"', json=True)


def _punctuation(style: _Style) -> tuple[str, str]:
    """The item and key separators of nested values (Python's literals are spaced)."""
    return (", ", ": ") if style.literal_nesting else (",", ":")


def _nested(g: _Grammar, style: _Style, schema: Mapping[str, Any], tool: str, path: str,
            depth: int) -> str:
    """An object or array, typed by its schema, in ``style``'s nested notation."""
    where = _where(tool, path)
    comma, colon = _punctuation(style)
    if schema.get("type") == "array":
        extra = sorted(set(schema) - _DESCRIPTIVE - {"items"})
        if extra and style.json:  # minItems...: the JSON-schema compiler's
            return _json_rule(schema)
        if extra:
            raise RequestError(
                f"{where}: the keyword(s) {extra} cannot be enforced in the {style.name} "
                "tool-call format.",
                fix="Drop those keywords from the tool's parameters, or use tool_choice 'auto'.",
            )
        item = _value(g, style, schema.get("items"), tool, f"{path}[]", depth + 1)
        return g.rule(f'"[" ({item} ({_lit(comma)} {item})*)? "]"')
    try:
        props, required = _properties(schema, tool, path)
    except RequestError:
        if style.json:
            return _json_rule(schema)
        raise
    if not props and schema.get("additionalProperties") is not False:
        return _any(g, style, objects_only=True)  # a free-form object
    items = []
    for name, sub in props.items():
        key = json.dumps(name, ensure_ascii=False)
        style._check_text(key, where)
        value = _value(g, style, sub, tool, f"{path}.{name}", depth + 1)
        items.append((f"{_lit(key + colon)} {value}", name in required))
    return g.rule(f'"{{" {g.sequence(items, _lit(comma))} "}}"')


#: How deeply a free-form value (a schema that says nothing) may nest.
ANY_DEPTH = 8


def _any(g: _Grammar, style: _Style, *, objects_only: bool = False) -> str:
    """Any JSON value in ``style``'s notation (strings that cannot end the call early,
    finite numbers), nested at most :data:`ANY_DEPTH` deep: a format's reader has a
    depth bound of its own."""
    comma, colon = _punctuation(style)
    text = _string(g, style, {}, "")
    scalar = g.rule(f'{text} | {_rx(_NUMBER)} | "true" | "false" | "null"')
    value = scalar
    for level in range(ANY_DEPTH):
        member = f"{text} {_lit(colon)} {value}"
        obj = f'"{{" ({member} ({_lit(comma)} {member})*)? "}}"'
        arr = f'"[" ({value} ({_lit(comma)} {value})*)? "]"'
        if objects_only and level == ANY_DEPTH - 1:
            return g.rule(obj)
        value = g.rule(f"{scalar} | {obj} | {arr}")
    return value


def _properties(schema: Mapping[str, Any], tool: str, path: str = "") -> tuple[
    Mapping[str, Any], list[Any]
]:
    who = f"tool {tool!r}" + (f", parameter {path!r}" if path else "")
    extra = sorted(set(schema) - _OBJECT_KEYS)
    if extra or schema.get("type", "object") != "object":
        raise RequestError(
            f"{who}: the object keyword(s) {extra or ['type']} cannot be enforced in a forced "
            "tool call's parameters.",
            fix="Declare the parameters as an object with properties and required.",
        )
    props = schema.get("properties") or {}
    if not isinstance(props, Mapping):
        raise RequestError(f"{who}: properties must be an object.", fix="Fix the schema.")
    required = schema.get("required") or []
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise RequestError(f"{who}: required must be a list of names.", fix="Fix the schema.")
    unknown = [r for r in required if r not in props]
    if unknown:
        raise RequestError(
            f"{who}: required parameter(s) {unknown} are not in properties.",
            fix="Declare every required parameter under properties.",
        )
    return props, required


def _writable_name(name: str, tool: str, fmt: str, ok: bool, what: str = "parameter") -> None:
    if not ok or not name:
        raise RequestError(
            f"tool {tool!r}: the {what} name {name!r} cannot be written in the {fmt} "
            "tool-call format.",
            fix=f"Rename the {what}, or use tool_choice 'auto'.",
        )


def _parameters_of(g: _Grammar, fmt: str, tool: str, schema: Mapping[str, Any]) -> str:
    """A Lark expression for a call's parameters in a text format."""
    style = _STYLES[fmt]
    props, required = _properties(schema, tool)
    items = []
    for name, sub in props.items():
        if fmt == "qwen3_coder":
            _writable_name(name, tool, fmt, name == name.strip() and not re.search("[>\n]", name))
            head = f"<parameter={name}>"
        elif fmt == "minicpm5":
            ok = name == name.strip() and not re.search('["<>&\n]', name)
            _writable_name(name, tool, fmt, ok)
            head = f'<param name="{name}">'
        elif fmt == "gemma4":
            if re.fullmatch(r'[^\s:{}\[\],<"]+', name):
                head = name + ":"
            else:
                _writable_name(name, tool, fmt, '<|"|>' not in name and "<tool_call|>" not in name)
                head = f'<|"|>{name}<|"|>:'
        else:  # pythonic: keyword arguments
            _writable_name(name, tool, fmt, _identifier(name))
            head = name + "="
        items.append((f"{_lit(head)} {_value(g, style, sub, tool, name, 0)}", name in required))
    sep = {"gemma4": '","', "pythonic": '", "'}.get(fmt, '""')
    return g.sequence(items, sep) if items else '""'


def _identifier(name: str) -> bool:
    """A Python name that ``ast`` reads back unchanged (it normalises to NFKC)."""
    return (
        name.isidentifier()
        and not keyword.iskeyword(name)
        and unicodedata.normalize("NFKC", name) == name
    )


def _text_format(fmt: str) -> Callable[[dict[str, dict[str, Any]], str | None, str], str]:
    """The builder of a text format's grammar (call framing around :func:`_parameters_of`)."""

    def build(tools: dict[str, dict[str, Any]], named: str | None, template: str) -> str:
        g = _Grammar()
        if named is not None:  # the prompt ends with the call's opening
            _function_head(fmt, named)  # (a name the format cannot write is refused)
            body = _parameters_of(g, fmt, named, tools[named])
            return g.text(f"{body} {_lit(_CLOSE[fmt])}")
        alts = []
        for name, params in tools.items():
            head = _function_head(fmt, name)
            alts.append(f"({_lit(head)} {_parameters_of(g, fmt, name, params)})")
        return g.text(f"{_lit(_OPEN[fmt])} ({' | '.join(alts)}) {_lit(_CLOSE[fmt])}")

    return build


#: What a required call writes before the function's name, and after its parameters.
_OPEN = {"qwen3_coder": "\n<function=", "minicpm5": "", "gemma4": "call:", "pythonic": "["}
_CLOSE = {
    "qwen3_coder": "</function>\n</tool_call>",
    "minicpm5": "</function>",
    "gemma4": "}<tool_call|>",
    "pythonic": ")]<|tool_call_end|>",
}


def _function_head(fmt: str, name: str) -> str:
    """The function's name and what follows it up to the first parameter."""
    if fmt == "qwen3_coder":
        _writable_name(name, name, fmt, name == name.strip() and not re.search("[>\n]", name),
                       "function")
        return f"{name}>\n"
    if fmt == "minicpm5":
        _writable_name(name, name, fmt, name == name.strip() and '"' not in name, "function")
        return f'"{name}">'
    if fmt == "gemma4":
        _writable_name(name, name, fmt, bool(re.fullmatch(r"[\w.\-]+", name)), "function")
        return f"{name}{{"
    _writable_name(name, name, fmt, all(_identifier(p) for p in name.split(".")), "function")
    return f"{name}("


# --- mistral: [TOOL_CALLS]f[ARGS]{...} or [TOOL_CALLS][{"name": ..., "arguments": {...}}] ----


def _mistral(tools: dict[str, dict[str, Any]], named: str | None, template: str) -> str:
    g = _Grammar()
    if "[ARGS]" in template:  # the newer spelling; the call runs to the end of the reply
        for name in tools if named is None else [named]:
            ok = bool(re.fullmatch(r"[\w.\-]+", name))
            _writable_name(name, name, "mistral", ok, "function")
        if named is not None:  # the prompt ends with 'f[ARGS]'
            return g.text(_json_arguments(g, "mistral", named, tools[named]))
        alts = []
        for name, params in tools.items():
            args = _json_arguments(g, "mistral", name, params)
            alts.append(f"({_lit(name + '[ARGS]')} {args})")
        return g.text(" | ".join(alts))
    end = _lit("}]")
    if named is not None:  # the prompt ends with '[{"name": "f", "arguments": '
        return g.text(f"{_json_arguments(g, 'mistral', named, tools[named])} {end}")
    alts = [
        f"({_call_head(name)} {_json_arguments(g, 'mistral', name, params)})"
        for name, params in tools.items()
    ]
    return g.text(f"{_lit('[')} ({' | '.join(alts)}) {end}")


# --- harmony: <|start|>assistant to=functions.f<|channel|>commentary json<|message|>{...} -----

#: What follows the function name in the role-header form of a call.
_HARMONY_HEAD = "<|channel|>commentary json<|message|>"


def _harmony(tools: dict[str, dict[str, Any]], named: str | None, template: str) -> str:
    g = _Grammar()
    for name in tools if named is None else [named]:
        _writable_name(name, name, "harmony", bool(re.fullmatch(r"[^\s<]+", name)), "function")
    if named is not None:  # the prompt ends with the whole header; the arguments end the reply
        return g.text(_json_arguments(g, "harmony", named, tools[named]))
    alts = [
        f"({_lit(name + _HARMONY_HEAD)} {_json_arguments(g, 'harmony', name, params)})"
        for name, params in tools.items()
    ]
    return g.text(" | ".join(alts))


_BUILDERS: dict[str, Callable[[dict[str, dict[str, Any]], str | None, str], str]] = {
    "json_tools": _json_tools,
    "mistral": _mistral,
    "harmony": _harmony,
    **{fmt: _text_format(fmt) for fmt in _STYLES},
}

#: The fixed text each format's calls are made of (checked to be writable).
_LITERALS: dict[str, tuple[str, ...]] = {
    "json_tools": ('{"name":', '"arguments":', "}\n</tool_call>"),
    "minicpm5": ('<param name="', '">', "</param>", "</function>"),
    "qwen3_coder": ("\n<function=", ">\n", "<parameter=", "\n</parameter>\n",
                    "</function>\n</tool_call>"),
    "gemma4": ("call:", '{a:<|"|>', '<|"|>,', "}<tool_call|>"),
    "pythonic": ("[", '(a="', '", ', ")]<|tool_call_end|>"),
    "mistral": ('[{"name":', '"arguments":', "}]"),  # ("[ARGS]" in the newer spelling)
    "harmony": (_HARMONY_HEAD, "{", "}"),
}


def _check_writable(
    tokenizer: Tokenizer, fmt: str, tools: dict[str, dict[str, Any]], template: str
) -> None:
    """Refuse a format whose text this tokenizer cannot write (it drops characters it
    has no token for): no sampled call could ever follow the grammar."""
    literals = _LITERALS[fmt]
    if fmt == "mistral" and "[ARGS]" in template:
        literals = ("[ARGS]",)
    texts = [*literals, *tools]
    for schema in tools.values():
        props = schema.get("properties")
        texts += list(props) if isinstance(props, Mapping) else []
    for text in texts:
        if tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) != text:
            raise CapabilityRefused(
                f"This model's tokenizer cannot write {text!r}, part of a {fmt} tool call, so "
                "a forced call cannot be held to the tool's schema.",
                fix='send tool_choice "auto", or serve a model whose tokenizer covers the '
                "format's characters",
            )


def tool_call_grammar(
    plan: ToolPlan, fmt: ChatFormat, tokenizer: Tokenizer | None = None
) -> str | None:
    """The Lark grammar of a forced call's remaining text (``None``: the call is not
    forced). A format without a grammar is refused; with ``tokenizer``, so is a
    format it cannot write."""
    parser = fmt.tool_parser
    if plan.forced is None or parser is None or not plan.tools:
        return None
    build = _BUILDERS.get(parser.name)
    if build is None:
        raise CapabilityRefused(
            f"A forced tool call (tool_choice required, any or a named function) cannot be "
            f"held to this model's {parser.name!r} tool-call format: the server has no "
            "grammar for it, and an unconstrained call might not parse.",
            fix='send tool_choice "auto" (the model may then call a tool)',
        )
    tools = {t["function"]["name"]: _parameters(t) for t in plan.tools}
    if tokenizer is not None:
        _check_writable(tokenizer, parser.name, tools, fmt.tools_template)
    named = None
    if plan.forced:
        named = next(
            (n for n in tools if parser.opening(n, fmt.tools_template) == plan.forced), None
        )
        if named is None:
            raise CapabilityRefused(
                f"The forced call's opening {plan.forced!r} names none of the tools.",
                fix="name one of the functions in tools",
            )
    return build(tools, named, fmt.tools_template)
