"""The models one server serves: their ids, how each is loaded, and which a request names.

``loom serve --model A --model B`` serves each model under an id (the
reference as given, ``tiny``'s bundled name, or ``NAME`` of ``NAME=REF``);
a :class:`~mlx_loom.engine.pool.ModelPool` of per-model
:class:`~mlx_loom.serve.app.ServeApp` s keeps them resident, loads them on
their first request and unloads them under its bounds. :class:`ServedModels`
maps a request's ``model`` to one of those ids — the allow-list: any other
name is a 404 naming the served ids, so no client can make the server load
anything else.

Each model keeps its own app, so its own engine, prefix store, adapters,
drafter, KV codec and chat format; the server-wide options are each
model's unless its :class:`ServedModel` overrides them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..adapters import AdapterSet
from ..engine.pool import ModelPool, PooledModel, checkpoint_bytes
from ..loader import load
from ..model import Model
from ..text import Tokenizer
from . import schemas
from .app import ServeApp
from .errors import NOT_FOUND, HttpError

__all__ = ["ServedModel", "ServedModels", "split_model_spec"]


def split_model_spec(spec: str) -> tuple[str, str]:
    """``--model`` value -> ``(id, reference)``: the id is the reference as given (what a
    single-model server has always called it), or ``NAME`` of ``NAME=REF``.

    A value that is an existing path is a reference even if it holds ``=``.
    """
    name, sep, ref = spec.partition("=")
    if sep and name and ref and "/" not in name and not Path(spec).exists():
        return name, ref
    return spec, spec


@dataclass(frozen=True)
class ServedModel:
    """One model a server may serve.

    ``load`` builds it (on the pool's thread, when first asked for);
    ``weight_bytes`` reads its size from its headers; ``options`` are
    :class:`ServeApp` options for this model over the server-wide ones
    (``speculation``, ``kv_bits``, ``tool_call_parser`` ...); ``adapters``
    (name -> directory) are registered on it once loaded; ``aliases`` are
    other names a request may use for it (its directory).
    """

    id: str
    load: Callable[[], tuple[Model, Tokenizer]]
    weight_bytes: Callable[[], int]
    options: Mapping[str, Any] = field(default_factory=dict)
    adapters: Mapping[str, str] = field(default_factory=dict)
    aliases: tuple[str, ...] = ()

    @classmethod
    def from_ref(
        cls,
        model_id: str,
        ref: str | Path,
        *,
        options: Mapping[str, Any] | None = None,
        adapters: Mapping[str, str] | None = None,
        **load_options: Any,
    ) -> ServedModel:
        """A model loaded by :func:`mlx_loom.load` with ``load_options`` (its plugin
        ``policy`` or ``host``, ``compute_dtype`` ...): an embedding host chooses,
        per model, which plugins may build it."""
        path = Path(ref).expanduser()
        aliases = (str(path), str(path.resolve()), path.name) if path.exists() else ()
        return cls(
            model_id,
            lambda: load(ref, **load_options),
            lambda: checkpoint_bytes(ref),
            dict(options or {}),
            dict(adapters or {}),
            aliases,
        )

    def pooled(self, common: Mapping[str, Any]) -> PooledModel[ServeApp]:
        """This model as the pool loads it: a :class:`ServeApp` with ``common`` options
        under its own."""

        def load_app() -> ServeApp:
            model, tokenizer = self.load()
            if self.adapters:
                AdapterSet(model, dict(self.adapters))
            return ServeApp(model, tokenizer, model_id=self.id, **{**common, **self.options})

        return PooledModel(self.id, load_app, self.weight_bytes)


class ServedModels:
    """Which served model a request's ``model`` names, and the cards of all of them."""

    def __init__(self, models: Sequence[ServedModel], pool: ModelPool[ServeApp]) -> None:
        self.models = list(models)
        self.pool = pool
        self._names: dict[str, str] = {}
        for m in reversed(self.models):  # an id wins over another model's alias
            self._names.update({alias: m.id for alias in m.aliases})
        self._names.update({m.id: m.id for m in self.models})

    @property
    def single(self) -> bool:
        """One model: every request is its (it checks the name itself, as it always has)."""
        return len(self.models) == 1

    @property
    def default_id(self) -> str:
        return self.models[0].id

    def route(self, name: Any, *, param: str | None = "model") -> str:
        """The served id a request's ``model`` names (``None``, or not a string: the default).

        ``<id>:<adapter>`` routes to ``<id>`` (its app checks the adapter).
        """
        if self.single or not isinstance(name, str):
            return self.default_id
        found = self._names.get(name)
        if found is None:
            base, sep, _ = name.rpartition(":")
            found = self._names.get(base) if sep else None
        if found is not None:
            return found
        served = ", ".join(repr(m.id) for m in self.models)
        raise HttpError(
            404,
            f"The model {name[:200]!r} is not served here; this server serves {served}.",
            fix=f"pass one of them as model (see GET /v1/models), or omit model for "
            f"{self.default_id!r}",
            type=NOT_FOUND if param is None else "invalid_request_error",
            param=param,
            code="model_not_found",
        )

    def cards(self, created: int) -> dict[str, Any]:
        """``GET /v1/models``: every served model (and its adapters), loaded or not."""
        cards: list[schemas.ModelCard] = []
        for m in self.models:
            app = self.pool.resident(m.id)
            if app is not None:
                cards += [schemas.ModelCard(**c) for c in app.models()["data"]]
                continue
            ids = [m.id, *(f"{m.id}:{name}" for name in m.adapters)]
            cards += [schemas.ModelCard(id=i, created=created, loaded=False) for i in ids]
        return schemas.ModelList(data=cards).model_dump()

    def card(self, name: str, created: int) -> dict[str, Any]:
        """``GET /v1/models/{id}``."""
        model_id = self.route(name, param=None)
        app = self.pool.resident(model_id)
        if app is not None:
            return app.model_card(name)
        m = next(m for m in self.models if m.id == model_id)
        base, sep, adapter = name.rpartition(":")
        if name != model_id and name not in m.aliases and not (sep and adapter in m.adapters):
            raise HttpError(
                404,
                f"no adapter {adapter!r} is served with {model_id!r}",
                fix="see GET /v1/models",
                type=NOT_FOUND,
                code="model_not_found",
            )
        shown = name if sep and name != model_id else model_id
        return schemas.ModelCard(id=shown, created=created, loaded=False).model_dump()
