"""Per-request adapters in the server: ``--adapter NAME=PATH``, and which one a request picks.

Adapters are registered once, at start-up (``loom serve --adapter sql=./sql
--adapter chat=./chat``), as one :class:`~mlx_loom.adapters.AdapterSet` on the
served model. A request picks one by

* its model id, ``"<model>:<name>"`` (what ``GET /v1/models`` lists beside the
  base model), or
* a field: ``"adapter": "<name>"``, or mlx-lm's ``"adapters"`` naming a
  registered adapter by name or by the path it was registered from.

Nothing else loads: a request cannot make the server read a path it was not
started with. A name that is not registered is a 404 naming the registered
ones; a request that picks an adapter two different ways is a 400.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from ..adapters import AdapterSet
from ..adapters.multi import check_adapter_name
from ..errors import AdapterError
from .errors import NOT_FOUND, HttpError

__all__ = ["ServedAdapters", "parse_adapter_specs"]


def parse_adapter_specs(specs: Sequence[str]) -> dict[str, str]:
    """``["sql=./a", "chat=./b"]`` -> ``{"sql": "./a", "chat": "./b"}``, refusing malformed ones."""
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not path:
            raise AdapterError(
                f"--adapter {spec!r} is not NAME=PATH",
                fix="pass each adapter as --adapter NAME=PATH, e.g. --adapter sql=./adapters/sql",
            )
        check_adapter_name(name)
        if name in out:
            raise AdapterError(
                f"--adapter names {name!r} twice ({out[name]} and {path})",
                fix="give every adapter its own name",
            )
        out[name] = path
    return out


class ServedAdapters:
    """The served model's adapter set, seen from requests."""

    def __init__(self, adapters: AdapterSet, model_id: str) -> None:
        self.set = adapters
        self.model_id = model_id
        self._by_path = {str(a.path): a.name for a in adapters.adapters}
        self._by_path.update({str(a.path.resolve()): a.name for a in adapters.adapters})

    @property
    def ids(self) -> list[str]:
        """Every model id served: the base model, then ``<model>:<name>`` per adapter."""
        return [self.model_id, *(f"{self.model_id}:{name}" for name in self.set.names)]

    def split(
        self, requested: str | None, base_ids: Iterable[str]
    ) -> tuple[str | None, str | None]:
        """``(base id, adapter name)`` for a requested model id; ``(requested, None)`` if
        it names no adapter (the caller checks the base id)."""
        if requested is None:
            return None, None
        base, sep, name = requested.rpartition(":")
        if sep and base in set(base_ids):
            if name not in self.set:
                raise self._unknown(name, param="model")
            return base, name
        return requested, None

    def pick(self, from_model: str | None, adapter: str | None, adapters: str | None) -> str | None:
        """The one adapter a request asks for (``None``: the base model)."""
        chosen: dict[str, str] = {}
        if from_model is not None:
            chosen["model"] = from_model
        if adapter is not None:
            if adapter not in self.set:
                raise self._unknown(adapter, param="adapter")
            chosen["adapter"] = adapter
        if adapters is not None:
            name = adapters if adapters in self.set else self._by_path.get(adapters)
            if name is None:
                name = self._by_path.get(str(Path(adapters).expanduser().resolve()))
            if name is None:
                raise self._unknown(adapters, param="adapters")
            chosen["adapters"] = name
        if len(set(chosen.values())) > 1:
            raise HttpError(
                400,
                "the request picks different adapters: "
                + ", ".join(f"{k}={v!r}" for k, v in chosen.items()),
                fix="pick the adapter one way: the model id '<model>:<name>' or 'adapter'",
                param=next(iter(chosen)),
            )
        return next(iter(chosen.values()), None)

    def _unknown(self, name: str, *, param: str) -> HttpError:
        return HttpError(
            404,
            f"no adapter {name!r} is served here (served: {', '.join(self.set.names)})",
            fix=f"use one of {self.ids}",
            type=NOT_FOUND,
            param=param,
        )
