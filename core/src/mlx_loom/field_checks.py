"""Field checks for registrations, run when one is constructed and again at the host boundary.

A registration is data a plugin hands the core; a wrong type there (an id
that is a number, a factory that is a string) would otherwise surface far
away, as a ``TypeError`` deep inside selection or a silent mismatch. Each
check raises :class:`~mlx_loom.errors.RegistrationError` naming the class and
the field, so the host's quarantine reason reads like
``Implementation.id must be a non-blank string without whitespace, got None``.

Ids (model types, implementations, graphs, loaders, profiles, kernels,
loops) are compared verbatim with config values and with each other, so an
id with whitespace in it can never be meant: it is refused outright rather
than stripped.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .errors import RegistrationError

#: Longest id accepted; ids are names, not payloads.
MAX_ID_LENGTH = 200


def _fail(owner: str, name: str, want: str, value: Any) -> RegistrationError:
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return RegistrationError(
        f"{owner}.{name} must be {want}, got {shown} ({type(value).__name__}).",
        fix=f"Pass {want} as {owner}.{name}.",
    )


def check_id(owner: str, name: str, value: Any) -> str:
    """A non-blank id with no whitespace, at most :data:`MAX_ID_LENGTH` characters."""
    want = "a non-blank string without whitespace"
    if not isinstance(value, str) or not value or len(value) > MAX_ID_LENGTH:
        raise _fail(owner, name, want, value)
    if any(ch.isspace() for ch in value):
        raise _fail(owner, name, want, value)
    return value


def check_optional_id(owner: str, name: str, value: Any) -> str | None:
    return None if value is None else check_id(owner, name, value)


def check_ids(owner: str, name: str, value: Any, *, empty_ok: bool = True) -> tuple[str, ...]:
    """A collection of ids (never a bare string, which would iterate as characters)."""
    want = "a collection of non-blank string ids"
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise _fail(owner, name, want, value)
    items = tuple(value)
    if not items and not empty_ok:
        raise _fail(owner, name, "a non-empty collection of string ids", value)
    for item in items:
        if not isinstance(item, str) or not item or any(ch.isspace() for ch in item):
            raise _fail(owner, name, want, value)
    return items


def check_text(owner: str, name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise _fail(owner, name, "a string", value)
    return value


def check_callable(owner: str, name: str, value: Any, *, optional: bool = False) -> Any:
    if value is None and optional:
        return None
    if not callable(value):
        raise _fail(owner, name, "a callable", value)
    return value


def check_instance(owner: str, name: str, value: Any, kind: type, *, optional: bool = False) -> Any:
    if value is None and optional:
        return None
    if not isinstance(value, kind):
        raise _fail(owner, name, f"a {kind.__name__}", value)
    return value
