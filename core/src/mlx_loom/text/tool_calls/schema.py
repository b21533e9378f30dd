"""Coerce a call's arguments to the JSON types its tool's schema declares.

XML-style formats (Qwen3-Coder, MiniCPM5) write every argument as text, and
models in JSON formats sometimes quote a number. A client that declared
``{"type": "integer"}`` expects ``5``, not ``"5"``, so each argument is
converted to a type its schema allows — but only when the text reads as that
type exactly; a value that cannot be converted is left as the model wrote it
(the client's own validation then sees what the model said, rather than a
guess). A value that already has a declared type is never changed.

Schemas are the client's: ``type`` may be a name or a list of names, and
``anyOf``/``oneOf`` alternatives are followed; object ``properties``,
``additionalProperties`` and array ``items`` are coerced recursively, to a
bounded depth.
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

#: Deeper than this, values are left as they are (schemas are client input).
MAX_DEPTH = 32

#: Longest text that is tried as a Python literal (``{'a': 1}``) when it is not JSON.
MAX_LITERAL_CHARS = 65536

_INT = re.compile(r"[-+]?\d+")
_MISSING = object()


def tool_schemas(tools: Sequence[Any] | None) -> dict[str, Mapping[str, Any]]:
    """``{function name: parameters schema}`` from an OpenAI ``tools`` list."""
    out: dict[str, Mapping[str, Any]] = {}
    for tool in tools or ():
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if isinstance(function, Mapping) and isinstance(function.get("name"), str):
            parameters = function.get("parameters")
            out[function["name"]] = parameters if isinstance(parameters, Mapping) else {}
    return out


def coerce_arguments(arguments: dict[str, Any], schema: Mapping[str, Any] | None) -> dict[str, Any]:
    """``arguments`` with each value converted to a type ``schema`` declares for it."""
    if not isinstance(schema, Mapping):
        return arguments
    coerced = coerce_value(arguments, {"type": "object", **schema}, 0)
    return coerced if isinstance(coerced, dict) else arguments


def coerce_value(value: Any, schema: Any, depth: int = 0) -> Any:
    """``value`` as a type ``schema`` allows, or unchanged when none fits exactly."""
    if not isinstance(schema, Mapping) or depth > MAX_DEPTH:
        return value
    alternatives = _alternatives(schema, depth)
    for alternative, kind in alternatives:
        if _has_type(value, kind):
            return _descend(value, kind, alternative, depth)
    for alternative, kind in alternatives:
        converted = _convert(value, kind)
        if converted is not _MISSING:
            return _descend(converted, kind, alternative, depth)
    if isinstance(value, str) and isinstance(schema.get("enum"), list):
        for member in schema["enum"]:
            if not isinstance(member, str) and json.dumps(member) == value.strip():
                return member
    return value


def _alternatives(schema: Mapping[str, Any], depth: int) -> list[tuple[Mapping[str, Any], str]]:
    """``(schema, type name)`` pairs in declaration order, ``anyOf``/``oneOf`` included."""
    out: list[tuple[Mapping[str, Any], str]] = []
    declared = schema.get("type")
    names = [declared] if isinstance(declared, str) else declared
    if isinstance(names, list):
        out += [(schema, name) for name in names if isinstance(name, str)]
    if depth <= MAX_DEPTH:
        for key in ("anyOf", "oneOf"):
            members = schema.get(key)
            if isinstance(members, list):
                for member in members:
                    if isinstance(member, Mapping):
                        out += _alternatives(member, depth + 1)
    return out


def _has_type(value: Any, kind: str) -> bool:
    if kind == "string":
        return isinstance(value, str)
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "null":
        return value is None
    if kind == "object":
        return isinstance(value, dict)
    if kind == "array":
        return isinstance(value, list)
    return False


def _convert(value: Any, kind: str) -> Any:
    """``value`` as ``kind`` when it reads as one exactly, else ``_MISSING``."""
    if isinstance(value, str):
        return _from_text(value.strip(), kind)
    if kind == "integer" and isinstance(value, float) and value.is_integer():
        return int(value)
    if kind == "string" and (value is None or isinstance(value, (bool, int, float))):
        try:
            return json.dumps(value)
        except ValueError:  # an int past the digit limit: leave it for the guard
            return _MISSING
    return _MISSING


def _from_text(text: str, kind: str) -> Any:
    if kind == "null":
        return None if text in ("null", "None") else _MISSING
    if kind == "boolean":
        return {"true": True, "false": False}.get(text.lower(), _MISSING)
    if kind in ("integer", "number"):
        if _INT.fullmatch(text):
            try:
                return int(text)
            except ValueError:  # past int()'s digit limit: the model's text stays a string
                return _MISSING
        try:
            number = float(text)
        except ValueError:
            return _MISSING
        if not math.isfinite(number):
            return _MISSING
        if kind == "integer":
            return int(number) if number.is_integer() else _MISSING
        return number
    if kind in ("object", "array"):
        parsed = _structured(text)
        wanted = dict if kind == "object" else list
        return parsed if isinstance(parsed, wanted) else _MISSING
    return _MISSING


def _structured(text: str) -> Any:
    """A JSON (or, failing that, Python-literal) object or array, else ``_MISSING``."""
    if not text or text[0] not in "{[":
        return _MISSING
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        pass
    if len(text) > MAX_LITERAL_CHARS:
        return _MISSING
    try:
        return _json_safe(ast.literal_eval(text))
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _MISSING


def _json_safe(value: Any) -> Any:
    """A Python literal as JSON data (tuples become lists); anything else is refused."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("not a JSON number")
        return value
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _json_safe(v) for k, v in value.items()}
    raise ValueError(f"{type(value).__name__} is not JSON data")


def _descend(value: Any, kind: str, schema: Mapping[str, Any], depth: int) -> Any:
    if kind == "object" and isinstance(value, dict):
        properties = schema.get("properties")
        properties = properties if isinstance(properties, Mapping) else {}
        extra = schema.get("additionalProperties")
        return {
            key: coerce_value(item, properties.get(key, extra), depth + 1)
            for key, item in value.items()
        }
    if kind == "array" and isinstance(value, list):
        items = schema.get("items")
        return [coerce_value(item, items, depth + 1) for item in value]
    return value
