"""The implementation registry: what plugins registered, frozen, and selection.

A :class:`Registry` is an immutable snapshot of everything the allowed plugins
registered — model types, implementations, profiles, kernels. It is the one
piece of shared state the engine documents: built once by the plugin host and
never mutated. A host narrows or pins it with :meth:`Registry.with_`, which
returns a *new* registry; models already built keep the binding they were
built with.

:meth:`Registry.select` turns a resolved profile into exactly one
:class:`Binding` (implementation + the kernels it needs, resolved for one
backend) or raises a refusal that says what was asked, what is installed and
how to fix it. A declared implementation never falls back to another.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from ..errors import (
    ImplementationUnavailable,
    IncompatibleImplementation,
    KernelUnavailable,
    RegistrationError,
    UnknownModelType,
)
from ._kernels import Backend, Kernel, KernelRegistry, Provider, active_backend, runnable_backends
from ._profiles import Profile

if TYPE_CHECKING:
    import mlx.nn as nn

    from ..artifacts import ArtifactConfig


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
    #: layout: ``config dict -> {name: (shape, dtype name)}``. The conformance
    #: kit writes random weights from it and checks exact weight coverage.
    checkpoint_tensors: (
        Callable[[Mapping[str, Any]], Mapping[str, tuple[tuple[int, ...], str]]] | None
    ) = None
    provider: Provider | None = field(default=None, compare=False)


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
    :class:`mlx_loom.model.CausalLM`.
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


@dataclass(frozen=True)
class Binding:
    """The outcome of selection: one implementation and its resolved kernels."""

    implementation: Implementation
    profile: Profile
    backend: Backend
    kernels: Mapping[str, Kernel]


def _duplicates_error(kind: str, ident: str, first: Any, second: Any) -> RegistrationError:
    if not ident:
        return RegistrationError(
            f"{second.provider or 'a plugin'} registered a {kind} with an empty id.",
            fix=f"Give every {kind} a non-empty id.",
        )
    return RegistrationError(
        f"{kind.capitalize()} id {ident!r} is registered twice: by "
        f"{first.provider or 'a plugin'} and by {second.provider or 'a plugin'}.",
        fix="Uninstall or disallow one of the two plugins, or rename one of the ids.",
    )


def _unique(kind: str, items: Iterable[Any], key: Callable[[Any], str]) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for item in items:
        ident = key(item)
        if not ident or not ident.strip():
            raise _duplicates_error(kind, "", None, item)
        if ident in table:
            raise _duplicates_error(kind, ident, table[ident], item)
        table[ident] = item
    return table


@dataclass(frozen=True)
class _Composition:
    """Host choices layered over what plugins registered."""

    allowed_implementations: frozenset[str] | None = None
    kernel_backend: Backend | None = None


class Registry:
    """Immutable snapshot of registrations plus the host's composition choices."""

    def __init__(
        self,
        *,
        model_types: Iterable[ModelType] = (),
        implementations: Iterable[Implementation] = (),
        profiles: Iterable[Profile] = (),
        kernels: Iterable[Kernel] = (),
        profile_providers: Mapping[str, Provider] | None = None,
        _composition: _Composition | None = None,
    ) -> None:
        self._model_types = _unique("model type", model_types, lambda m: m.name)
        self._implementations = _unique("implementation", implementations, lambda i: i.id)
        profiles = tuple(profiles)
        providers = dict(profile_providers or {})
        self._profiles = _unique(
            "profile", [_ProfileEntry(p, providers.get(p.id)) for p in profiles], lambda e: e.id
        )
        self._kernels = KernelRegistry(kernels)
        self._composition = _composition or _Composition()

    # --- read access -------------------------------------------------------

    @property
    def model_types(self) -> Mapping[str, ModelType]:
        return dict(self._model_types)

    @property
    def implementations(self) -> Mapping[str, Implementation]:
        return dict(self._implementations)

    @property
    def profiles(self) -> tuple[Profile, ...]:
        return tuple(e.profile for e in self._profiles.values())

    def profile_provider(self, profile_id: str) -> Provider | None:
        entry = self._profiles.get(profile_id)
        return entry.provider if entry else None

    @property
    def kernels(self) -> KernelRegistry:
        return self._kernels

    @property
    def kernel_backend(self) -> Backend | None:
        return self._composition.kernel_backend

    @property
    def allowed_implementations(self) -> frozenset[str] | None:
        return self._composition.allowed_implementations

    def graph_model_types(self) -> dict[str, frozenset[str]]:
        """Each graph id and the model types some implementation of it accepts."""
        out: dict[str, set[str]] = {}
        for impl in self._implementations.values():
            out.setdefault(impl.graph, set()).update(impl.model_types)
        return {g: frozenset(m) for g, m in out.items()}

    def model_type(self, name: str) -> ModelType:
        found = self._model_types.get(name)
        if found is None:
            raise UnknownModelType(
                f"No installed plugin claims model_type {name!r} "
                f"(claimed: {', '.join(sorted(self._model_types)) or 'none'}).",
                fix="Install the family plugin for this model type.",
            )
        return found

    # --- composition -------------------------------------------------------

    def with_(
        self,
        *,
        implementations: Iterable[Implementation] = (),
        profiles: Iterable[Profile] = (),
        kernels: Iterable[Kernel] = (),
        model_types: Iterable[ModelType] = (),
        allow_implementations: Iterable[str] | None = None,
        kernel_backend: Backend | None = None,
    ) -> Registry:
        """A new registry with extra registrations and/or narrowed host choices.

        ``allow_implementations`` restricts selection to those ids (each must
        exist); ``kernel_backend`` pins the backend kernels resolve on. This
        registry is left unchanged.
        """
        composition = self._composition
        if allow_implementations is not None:
            allowed = frozenset(allow_implementations)
            known = set(self._implementations) | {i.id for i in implementations}
            unknown = sorted(allowed - known)
            if unknown:
                raise ImplementationUnavailable(
                    f"The host allows implementation(s) {unknown}, which no installed plugin "
                    f"registers (registered: {sorted(known) or 'none'}).",
                    fix="Correct the implementation ids or install the plugin providing them.",
                )
            composition = replace(composition, allowed_implementations=allowed)
        if kernel_backend is not None:
            composition = replace(composition, kernel_backend=kernel_backend)
        return Registry(
            model_types=[*self._model_types.values(), *model_types],
            implementations=[*self._implementations.values(), *implementations],
            profiles=[*self.profiles, *profiles],
            kernels=[*self._kernels, *kernels],
            profile_providers={
                **{k: e.provider for k, e in self._profiles.items() if e.provider},
            },
            _composition=composition,
        )

    # --- selection ---------------------------------------------------------

    def select(self, model_type: str, profile: Profile) -> Binding:
        """Exactly one binding for ``profile`` serving ``model_type``, or a refusal."""
        ex = profile.execution
        allowed = self._composition.allowed_implementations
        if ex.implementation is not None:
            impl = self._implementations.get(ex.implementation)
            if impl is None:
                raise ImplementationUnavailable(
                    f"Profile {profile.id!r} requires implementation {ex.implementation!r}, "
                    f"which is not installed (installed: {self._describe_impls()}).",
                    fix=self._install_hint(profile),
                )
            candidates = [impl]
        else:
            candidates = [
                i
                for i in self._implementations.values()
                if i.graph == ex.graph and i.loader == ex.loader
            ]
            if not candidates:
                raise ImplementationUnavailable(
                    f"Profile {profile.id!r} needs graph {ex.graph!r} with loader "
                    f"{ex.loader!r}; no installed implementation provides it "
                    f"(installed: {self._describe_impls()}).",
                    fix=self._install_hint(profile),
                )
        if allowed is not None:
            permitted = [i for i in candidates if i.id in allowed]
            if not permitted:
                raise ImplementationUnavailable(
                    f"Profile {profile.id!r} can be served by "
                    f"{', '.join(repr(i.id) for i in candidates)}, but the host allows only "
                    f"{sorted(allowed)}.",
                    fix="Add one of those implementation ids to the host's allowed list.",
                )
            candidates = permitted
        fitting, reasons, kernel_refusals = [], [], []
        for impl in candidates:
            why = self._misfit(impl, model_type, profile)
            if why is None:
                fitting.append(impl)
            elif isinstance(why, KernelUnavailable):
                kernel_refusals.append(why)
                reasons.append(f"{impl.id!r}: {why.message.rstrip('.')}")
            else:
                reasons.append(f"{impl.id!r}: {why}")
        if not fitting and kernel_refusals and len(kernel_refusals) == len(candidates):
            first = kernel_refusals[0]
            raise KernelUnavailable(
                f"Profile {profile.id!r} cannot run here: " + "; ".join(reasons) + ".",
                fix=first.fix,
            )
        if not fitting:
            raise IncompatibleImplementation(
                f"No implementation can serve profile {profile.id!r} for model_type "
                f"{model_type!r}: " + "; ".join(reasons) + ".",
                fix="Install or allow a plugin whose implementation fits this profile.",
            )
        if len(fitting) > 1:
            raise ImplementationUnavailable(
                f"{len(fitting)} implementations fit profile {profile.id!r}: "
                f"{', '.join(f'{i.id!r} from {i.provider}' for i in fitting)}; "
                "selection must be unambiguous.",
                fix="Restrict the host's allowed implementations to one of them.",
            )
        impl = fitting[0]
        pinned = self.kernel_backend
        if not impl.kernels and pinned is not None and pinned not in runnable_backends():
            # No kernel to name, but the pin still cannot be honoured here.
            raise KernelUnavailable(
                f"The host pins kernel backend {pinned!r}, which cannot run on this machine "
                f"(runnable here: {', '.join(sorted(runnable_backends()))}).",
                fix="Run on a device with that backend, or pin one that runs here "
                "(e.g. kernel_backend='cpu').",
            )
        kernels = {name: self._kernels.resolve(name, self.kernel_backend) for name in impl.kernels}
        backend = next(iter(kernels.values())).backend if kernels else self._default_backend()
        return Binding(implementation=impl, profile=profile, backend=backend, kernels=kernels)

    def _default_backend(self) -> Backend:
        return self.kernel_backend or active_backend()

    def _misfit(
        self, impl: Implementation, model_type: str, profile: Profile
    ) -> str | KernelUnavailable | None:
        ex = profile.execution
        if model_type not in impl.model_types:
            return f"does not accept model_type {model_type!r} (accepts {sorted(impl.model_types)})"
        if impl.graph != ex.graph or impl.loader != ex.loader:
            return (
                f"provides graph {impl.graph!r}/loader {impl.loader!r}, the profile needs "
                f"{ex.graph!r}/{ex.loader!r}"
            )
        if impl.loop != ex.loop:
            return f"runs loop {impl.loop!r}, the profile needs {ex.loop!r}"
        missing = profile.capabilities - impl.capabilities
        if missing:
            return f"lacks capabilities {sorted(missing)} the profile requires"
        for name in impl.kernels:
            try:
                self._kernels.resolve(name, self.kernel_backend)
            except KernelUnavailable as err:
                return err
        return None

    def _describe_impls(self) -> str:
        if not self._implementations:
            return "none"
        return ", ".join(f"{i.id!r} from {i.provider}" for i in self._implementations.values())

    def _install_hint(self, profile: Profile) -> str:
        provider = self.profile_provider(profile.id)
        if provider is not None:
            return (
                f"Install a version of {provider.distribution} that registers it, or allow the "
                "plugin that does."
            )
        return "Install or allow the plugin that registers it."


@dataclass(frozen=True)
class _ProfileEntry:
    profile: Profile
    provider: Provider | None

    @property
    def id(self) -> str:
        return self.profile.id
