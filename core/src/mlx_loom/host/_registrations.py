"""What a plugin registers: model types, implementations, and the declarative family.

A family plugin normally declares one :class:`Family` — its model types, its
graph(s) with their factories, kernels and capabilities — and the core
derives the rest: for every :class:`Graph` one :class:`Implementation` whose
id *is* the graph id, and one family :class:`~mlx_loom.host.Profile` (id
``"<family>/<graph suffix>"``) that selects it. :class:`Implementation` and
exact-artifact profiles remain for tuning one published artifact; a plugin may
register those alone (an *implementation-only* plugin).

Every registration is a frozen dataclass whose fields are checked on
construction (and again by the host), so a wrong type fails where it was
written, naming the class and the field.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from ..backends import Backend, Kernel, Provider
from ..errors import RegistrationError
from ..field_checks import (
    check_callable,
    check_id,
    check_ids,
    check_instance,
    check_optional_id,
    check_text,
)
from ._profiles import LOOP_CAPABILITIES, Execution, Profile, validate_profile

if TYPE_CHECKING:
    import mlx.nn as nn

    from ..artifacts import ArtifactConfig
    from ..parallel import PlanFunction
    from ..text.tool_calls import ToolParser

#: ``config dict -> {hf tensor name: (shape, dtype name)}``
CheckpointTensors = Callable[[Mapping[str, Any]], Mapping[str, tuple[tuple[int, ...], str]]]


def _set(obj: object, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)  # normalising a frozen dataclass's own field


@dataclass(frozen=True)
class ModelType:
    """A config ``model_type`` a plugin claims, with the schema that validates it.

    ``fingerprint_fields`` are the config fields that decide the graph; the
    config fingerprint is computed over exactly these, so two checkpoints with
    the same geometry share it whatever else their configs carry.
    """

    name: str
    schema: type[BaseModel]
    fingerprint_fields: tuple[str, ...]
    description: str = ""
    #: A small but complete ``config.json`` dict for this model type, used by
    #: the conformance kit to build a tiny random-weight checkpoint.
    tiny_config: Mapping[str, Any] | None = None
    #: The tensors a checkpoint of a given config holds, in Hugging Face
    #: layout. The conformance kit writes random weights from it and checks
    #: exact weight coverage. In a :class:`Family`, ``None`` means the family's.
    checkpoint_tensors: CheckpointTensors | None = None
    #: The tool-call format (a registered parser's name) this model type's chat
    #: templates teach, used when neither ``tokenizer_config.json`` nor the
    #: template's markers say which (see :mod:`mlx_loom.text.tool_calls`).
    tool_parser: str | None = None
    provider: Provider | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        check_id("ModelType", "name", self.name)
        check_optional_id("ModelType", "tool_parser", self.tool_parser)
        if not (isinstance(self.schema, type) and issubclass(self.schema, BaseModel)):
            raise RegistrationError(
                f"ModelType {self.name!r}: schema must be a pydantic model class, got "
                f"{self.schema!r}.",
                fix="Pass the pydantic BaseModel subclass that validates this config.",
            )
        _set(
            self,
            "fingerprint_fields",
            check_ids("ModelType", "fingerprint_fields", self.fingerprint_fields),
        )
        check_text("ModelType", "description", self.description)
        check_instance("ModelType", "tiny_config", self.tiny_config, Mapping, optional=True)
        check_callable("ModelType", "checkpoint_tensors", self.checkpoint_tensors, optional=True)
        check_instance("ModelType", "provider", self.provider, Provider, optional=True)


@dataclass(frozen=True)
class BuildContext:
    """Everything an implementation's factory gets to build a model."""

    model_dir: Path
    config: ArtifactConfig
    family_config: BaseModel
    profile: Profile
    backend: Backend
    kernels: Mapping[str, Callable[..., Any]]


@dataclass(frozen=True)
class Implementation:
    """One way to build and run a model: graph + loader + loop + kernels.

    ``factory`` builds the model (graph with its weights loaded by the loader)
    from a :class:`BuildContext`; the returned module must satisfy
    :class:`mlx_loom.plugin.CausalLM`. A family's default implementation has
    the graph's id; a tuned one has its own and is named by an exact-artifact
    profile.
    """

    id: str
    graph: str
    loader: str
    model_types: frozenset[str]
    factory: Callable[[BuildContext], nn.Module]
    loop: str = "autoregressive"
    kernels: tuple[str, ...] = ()
    capabilities: frozenset[str] = frozenset()
    description: str = ""
    provider: Provider | None = field(default=None, compare=False)
    #: ``family_config -> ParallelPlan``: how the built graph splits across
    #: processes (:mod:`mlx_loom.parallel`); ``None``: it runs in one process only.
    parallel: PlanFunction | None = None

    def __post_init__(self) -> None:
        for name in ("id", "graph", "loader", "loop"):
            check_id("Implementation", name, getattr(self, name))
        _set(
            self,
            "model_types",
            frozenset(check_ids("Implementation", "model_types", self.model_types, empty_ok=False)),
        )
        check_callable("Implementation", "factory", self.factory)
        _set(self, "kernels", check_ids("Implementation", "kernels", self.kernels))
        _set(
            self,
            "capabilities",
            frozenset(check_ids("Implementation", "capabilities", self.capabilities)),
        )
        check_text("Implementation", "description", self.description)
        check_instance("Implementation", "provider", self.provider, Provider, optional=True)
        check_callable("Implementation", "parallel", self.parallel, optional=True)


def check_cache_kind(cls: Any, *, owner: str = "cache kind") -> type:
    """A cache class a prompt-cache file may name: a string ``kind`` and ``from_state``."""
    kind = getattr(cls, "kind", None) if isinstance(cls, type) else None
    if kind is None or not callable(getattr(cls, "from_state", None)):
        raise RegistrationError(
            f"{owner} {cls!r} is not a cache class with a string 'kind' and a from_state "
            "classmethod.",
            fix="Give the cache class a 'kind' class attribute and from_state(state, meta_state).",
        )
    check_id(getattr(cls, "__name__", "cache kind"), "kind", kind)
    return cls


@dataclass(frozen=True)
class Graph:
    """One graph of a family: its id, the factory that builds it, what it needs.

    ``model_types`` empty means every model type of the family. ``loader`` and
    ``capabilities`` default to the family's. ``parallel`` is the graph's
    :class:`~mlx_loom.parallel.ParallelPlan` function (``None``: one process only).
    """

    id: str
    factory: Callable[[BuildContext], nn.Module]
    model_types: frozenset[str] = frozenset()
    kernels: tuple[str, ...] = ()
    loop: str = "autoregressive"
    loader: str | None = None
    capabilities: frozenset[str] | None = None
    description: str = ""
    parallel: PlanFunction | None = None

    def __post_init__(self) -> None:
        check_id("Graph", "id", self.id)
        check_callable("Graph", "factory", self.factory)
        _set(self, "model_types", frozenset(check_ids("Graph", "model_types", self.model_types)))
        _set(self, "kernels", check_ids("Graph", "kernels", self.kernels))
        check_id("Graph", "loop", self.loop)
        if self.loader is not None:
            check_id("Graph", "loader", self.loader)
        if self.capabilities is not None:
            _set(
                self,
                "capabilities",
                frozenset(check_ids("Graph", "capabilities", self.capabilities)),
            )
        check_text("Graph", "description", self.description)
        check_callable("Graph", "parallel", self.parallel, optional=True)


@dataclass(frozen=True)
class Registrations:
    """Everything one plugin registers, of every kind."""

    model_types: tuple[ModelType, ...] = ()
    kernels: tuple[Kernel, ...] = ()
    implementations: tuple[Implementation, ...] = ()
    profiles: tuple[Profile, ...] = ()
    cache_kinds: tuple[type[Any], ...] = ()
    tool_parsers: tuple[ToolParser, ...] = ()

    def __add__(self, other: Registrations) -> Registrations:
        return Registrations(
            *(getattr(self, f) + getattr(other, f) for f in self.__dataclass_fields__)
        )


@dataclass(frozen=True)
class Family:
    """A model family declared once; the core derives its implementations and profiles.

    For each graph the core registers an :class:`Implementation` with
    ``id == graph.id`` and a family profile ``"<name>/<graph id after '<name>.'>"``
    claiming the graph's model types. Each model type must be served by
    exactly one graph. ``profiles`` holds exact-artifact profiles (fingerprints
    of one published artifact), ``implementations`` the tuned implementations
    they name; ``cache_kinds`` the cache classes of this family that
    prompt-cache files may name.
    """

    name: str
    model_types: tuple[ModelType, ...]
    graphs: tuple[Graph, ...]
    loader: str
    capabilities: frozenset[str]
    kernels: tuple[Kernel, ...] = ()
    checkpoint_tensors: CheckpointTensors | None = None
    profiles: tuple[Profile, ...] = ()
    implementations: tuple[Implementation, ...] = ()
    cache_kinds: tuple[type[Any], ...] = ()
    description: str = ""

    def __post_init__(self) -> None:
        check_id("Family", "name", self.name)
        check_id("Family", "loader", self.loader)
        _set(
            self, "capabilities", frozenset(check_ids("Family", "capabilities", self.capabilities))
        )
        check_callable("Family", "checkpoint_tensors", self.checkpoint_tensors, optional=True)
        check_text("Family", "description", self.description)
        for name, kind in (
            ("model_types", ModelType),
            ("graphs", Graph),
            ("kernels", Kernel),
            ("profiles", Profile),
            ("implementations", Implementation),
        ):
            items = getattr(self, name)
            if isinstance(items, (str, bytes)) or not hasattr(items, "__iter__"):
                raise RegistrationError(
                    f"Family {self.name!r}: {name} must be a collection of {kind.__name__}, "
                    f"got {type(items).__name__}.",
                    fix=f"Pass a tuple of {kind.__name__} as {name}.",
                )
            items = tuple(items)
            for item in items:
                check_instance(f"Family {self.name!r}", name, item, kind)
            _set(self, name, items)
        _set(
            self,
            "cache_kinds",
            tuple(
                check_cache_kind(c, owner=f"Family {self.name!r} cache kind")
                for c in self.cache_kinds
            ),
        )
        self._check_shape()

    def _check_shape(self) -> None:
        where = f"Family {self.name!r}"
        if not self.model_types or not self.graphs:
            raise RegistrationError(
                f"{where} declares no model types or no graphs.",
                fix="Declare at least one ModelType and one Graph.",
            )
        names = [m.name for m in self.model_types]
        served: dict[str, list[str]] = {n: [] for n in names}
        for graph in self.graphs:
            if not graph.id.startswith(f"{self.name}."):
                raise RegistrationError(
                    f"{where}: graph id {graph.id!r} does not start with {self.name + '.'!r}.",
                    fix=f"Name each graph '{self.name}.<graph>'.",
                )
            unknown = sorted(graph.model_types - set(names))
            if unknown:
                raise RegistrationError(
                    f"{where}: graph {graph.id!r} serves model types {unknown}, which the "
                    f"family does not declare (declared: {names}).",
                    fix="Declare those model types, or fix the graph's model_types.",
                )
            for name in graph.model_types or names:
                served[name].append(graph.id)
        for name, graphs in served.items():
            if len(graphs) != 1:
                raise RegistrationError(
                    f"{where}: model type {name!r} is served by {len(graphs)} graphs "
                    f"({graphs or 'none'}); each model type needs exactly one family graph.",
                    fix="Give each graph the model types it serves (Graph(model_types=...)).",
                )
        for profile in self.profiles:
            if not profile.is_exact:
                raise RegistrationError(
                    f"{where}: profile {profile.id!r} is not exact-artifact; the family "
                    "profiles are derived from the graphs.",
                    fix="Declare only exact-artifact profiles (both fingerprints) in profiles.",
                )
        for profile in self.registrations().profiles:
            validate_profile(profile, origin=where)

    def registrations(self) -> Registrations:
        """The model types, kernels, implementations and profiles this family registers."""
        model_types = tuple(
            m
            if m.checkpoint_tensors is not None or self.checkpoint_tensors is None
            else replace(m, checkpoint_tensors=self.checkpoint_tensors)
            for m in self.model_types
        )
        all_types = frozenset(m.name for m in self.model_types)
        implementations, profiles = [], []
        for graph in self.graphs:
            served = graph.model_types or all_types
            loader = graph.loader or self.loader
            capabilities = (
                graph.capabilities if graph.capabilities is not None else self.capabilities
            ) | LOOP_CAPABILITIES.get(graph.loop, frozenset())
            description = graph.description or self.description
            implementations.append(
                Implementation(
                    id=graph.id,
                    graph=graph.id,
                    loader=loader,
                    model_types=served,
                    factory=graph.factory,
                    loop=graph.loop,
                    kernels=graph.kernels,
                    capabilities=capabilities,
                    description=description,
                    parallel=graph.parallel,
                )
            )
            profiles.append(
                Profile(
                    id=f"{self.name}/{graph.id.removeprefix(self.name + '.')}",
                    model_types=served,
                    execution=Execution(graph=graph.id, loader=loader, loop=graph.loop),
                    capabilities=capabilities,
                    description=description,
                )
            )
        return Registrations(
            model_types=model_types,
            kernels=self.kernels,
            implementations=(*implementations, *self.implementations),
            profiles=(*profiles, *self.profiles),
            cache_kinds=self.cache_kinds,
        )
