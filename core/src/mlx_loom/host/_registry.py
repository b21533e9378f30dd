"""The implementation registry: what plugins registered, frozen, and selection.

A :class:`Registry` is an immutable snapshot of everything the allowed plugins
registered — model types, implementations, profiles, kernels, cache kinds. It
is the one piece of shared state the engine documents: built once by the
plugin host and never mutated. A host narrows or pins it with
:meth:`Registry.with_`, which returns a *new* registry; models already built
keep the binding they were built with.

:meth:`Registry.select` turns a profile into exactly one :class:`Binding`
(implementation + the kernels it needs, resolved for one backend) or raises a
refusal that says what was asked, what is installed and how to fix it.

The selection rule — by id, never by "whatever fits":

1. An exact-artifact profile that names ``implementation=`` gets exactly that
   implementation, from whichever plugin registers it.
2. Otherwise the profile's graph names the implementation: ``graph`` for a
   family profile, ``"<graph>-generated"`` for a generated one — provided it
   is registered by the profile's own plugin (a profile the embedding host
   composed itself, with no plugin, may take it from any plugin).
3. Implementations of other plugins are never defaults, so installing any
   number of extra implementations changes no other checkpoint's resolution.
4. The chosen implementation must then fit — same graph, loader and loop,
   the model type, the capabilities, every kernel runnable here — or the
   profile is refused as incompatible. Nothing is ever substituted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from ..backends import (
    Backend,
    Kernel,
    KernelRegistry,
    Provider,
    active_backend,
    registered_twice,
    runnable_backends,
)
from ..cache import CACHE_KINDS
from ..cpu.path import check_compute_dtype, check_kernel_set
from ..errors import (
    ImplementationUnavailable,
    IncompatibleImplementation,
    KernelUnavailable,
    ProfileError,
    RegistrationError,
    UnknownModelType,
)
from ..field_checks import check_instance
from ..text.tool_calls import ToolParser, parser_table
from ._profiles import Profile, validate_profile
from ._registrations import BuildContext, Implementation, ModelType, check_cache_kind

__all__ = ["Binding", "BuildContext", "Implementation", "ModelType", "Registry"]


@dataclass(frozen=True)
class Binding:
    """The outcome of selection: one implementation, its resolved kernels, and the
    cache kinds a prompt-cache file for this model may name."""

    implementation: Implementation
    profile: Profile
    backend: Backend
    kernels: Mapping[str, Kernel]
    cache_kinds: Mapping[str, type] = field(default_factory=lambda: MappingProxyType({}))


def _describe(item: Any) -> str:
    return str(item.provider) if getattr(item, "provider", None) is not None else "a plugin"


def _unique(kind: str, items: Iterable[Any], cls: type, key: Callable[[Any], str]) -> dict:
    table: dict[str, Any] = {}
    for item in items:
        check_instance("Registry", f"{kind}s[]", item, cls)
        ident = key(item)
        if not isinstance(ident, str) or not ident.strip():
            raise RegistrationError(
                f"{_describe(item)} registered a {kind} with an empty id.",
                fix=f"Give every {kind} a non-empty id.",
            )
        if ident in table:
            who, fix = registered_twice(
                getattr(table[ident], "provider", None),
                getattr(item, "provider", None),
                rename="one of the ids",
            )
            raise RegistrationError(
                f"{kind.capitalize()} id {ident!r} is registered twice{who}.", fix=fix
            )
        table[ident] = item
    return table


def standard_cache_kinds() -> Mapping[str, type]:
    """The cache kinds the core ships (every registry includes them)."""
    return CACHE_KINDS


def _cache_table(extra: Iterable[type[Any]]) -> Mapping[str, type]:
    table = dict(standard_cache_kinds())
    for cls in extra:
        check_cache_kind(cls)
        if cls.kind in table and table[cls.kind] is not cls:
            raise RegistrationError(
                f"Cache kind {cls.kind!r} is claimed by both {_qualname(table[cls.kind])} and "
                f"{_qualname(cls)}.",
                fix="Give each cache class a distinct 'kind'.",
            )
        table[cls.kind] = cls
    return MappingProxyType(table)


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _plugin(item: Any) -> str | None:
    provider = getattr(item, "provider", None)
    return provider.plugin if provider is not None else None


@dataclass(frozen=True)
class _Composition:
    """Host choices layered over what plugins registered."""

    allowed_implementations: frozenset[str] | None = None
    kernel_backend: Backend | None = None
    #: The host's pins of the CPU compute path (see :mod:`mlx_loom.cpu`).
    compute_dtype: str | None = None
    cpu_kernels: str | None = None


class Registry:
    """Immutable snapshot of registrations plus the host's composition choices."""

    def __init__(
        self,
        *,
        model_types: Iterable[ModelType] = (),
        implementations: Iterable[Implementation] = (),
        profiles: Iterable[Profile] = (),
        kernels: Iterable[Kernel] = (),
        cache_kinds: Iterable[type] = (),
        tool_parsers: Iterable[ToolParser] = (),
        _composition: _Composition | None = None,
    ) -> None:
        self._model_types = _unique("model type", model_types, ModelType, lambda m: m.name)
        self._implementations = _unique(
            "implementation", implementations, Implementation, lambda i: i.id
        )
        self._profiles = _unique("profile", profiles, Profile, lambda p: p.id)
        self._kernels = KernelRegistry(kernels)
        self._extra_cache_kinds = tuple(cache_kinds)
        self._cache_kinds = _cache_table(self._extra_cache_kinds)
        self._extra_tool_parsers = tuple(tool_parsers)
        self._tool_parsers = parser_table(self._extra_tool_parsers)
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
        return tuple(self._profiles.values())

    def profile_provider(self, profile_id: str) -> Provider | None:
        entry = self._profiles.get(profile_id)
        return entry.provider if entry else None

    @property
    def kernels(self) -> KernelRegistry:
        return self._kernels

    @property
    def cache_kinds(self) -> Mapping[str, type]:
        """``kind -> class`` for every cache kind a prompt-cache file may name."""
        return self._cache_kinds

    @property
    def tool_parsers(self) -> Mapping[str, ToolParser]:
        """Every tool-call parser by name: the plugins' first, then the core's."""
        return dict(self._tool_parsers)

    @property
    def kernel_backend(self) -> Backend | None:
        return self._composition.kernel_backend

    @property
    def allowed_implementations(self) -> frozenset[str] | None:
        return self._composition.allowed_implementations

    @property
    def compute_dtype(self) -> str | None:
        """The compute dtype the host pins (``None``: the run or the default decides)."""
        return self._composition.compute_dtype

    @property
    def cpu_kernels(self) -> str | None:
        """The CPU kernel set the host pins (``None``: the run or the default decides)."""
        return self._composition.cpu_kernels

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

    @classmethod
    def combined(cls, *parts: Registry) -> Registry:
        """One registry of every part's registrations, providers kept — what a host
        loading all their plugins together builds. The parts' host choices
        (allow-lists, pinned backend) are not carried over; a duplicate id
        raises :class:`~mlx_loom.errors.RegistrationError`."""
        return cls(
            model_types=[m for p in parts for m in p._model_types.values()],
            implementations=[i for p in parts for i in p._implementations.values()],
            profiles=[q for p in parts for q in p._profiles.values()],
            kernels=[k for p in parts for k in p._kernels],
            cache_kinds=[c for p in parts for c in p._extra_cache_kinds],
            tool_parsers=[t for p in parts for t in p._extra_tool_parsers],
        )

    def with_(
        self,
        *,
        implementations: Iterable[Implementation] = (),
        profiles: Iterable[Profile] = (),
        kernels: Iterable[Kernel] = (),
        model_types: Iterable[ModelType] = (),
        cache_kinds: Iterable[type] = (),
        tool_parsers: Iterable[ToolParser] = (),
        allow_implementations: Iterable[str] | None = None,
        kernel_backend: Backend | None = None,
        compute_dtype: str | None = None,
        cpu_kernels: str | None = None,
    ) -> Registry:
        """A new registry with extra registrations and/or narrowed host choices.

        Registrations added here belong to the embedding host (no plugin).
        ``allow_implementations`` restricts selection to those ids (each must
        exist): a profile whose implementation is not allowed is refused, never
        given another. ``kernel_backend`` pins the backend kernels resolve on;
        ``compute_dtype`` and ``cpu_kernels`` pin the CPU compute path
        (:mod:`mlx_loom.cpu`). This registry is left unchanged.
        """
        implementations, profiles = tuple(implementations), tuple(profiles)
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
        if compute_dtype is not None or cpu_kernels is not None:
            check_compute_dtype(compute_dtype)
            check_kernel_set(cpu_kernels)
            composition = replace(
                composition,
                compute_dtype=compute_dtype or composition.compute_dtype,
                cpu_kernels=cpu_kernels or composition.cpu_kernels,
            )
        return Registry(
            model_types=[*self._model_types.values(), *model_types],
            implementations=[*self._implementations.values(), *implementations],
            profiles=[*self.profiles, *(p.model_copy(update={"provider": None}) for p in profiles)],
            kernels=[*self._kernels, *kernels],
            cache_kinds=[*self._extra_cache_kinds, *cache_kinds],
            tool_parsers=[*self._extra_tool_parsers, *tool_parsers],
            _composition=composition,
        )

    # --- selection ---------------------------------------------------------

    def select(
        self,
        model_type: str,
        profile: Profile,
        *,
        config_fingerprint: str | None = None,
        artifact_fingerprint: str | None = None,
    ) -> Binding:
        """Exactly one binding for ``profile`` serving ``model_type``, or a refusal.

        The profile is re-validated every time — its own rules, that it claims
        ``model_type``, and for an exact-artifact profile that both fingerprints
        are the artifact's — so a profile built by hand cannot bypass them.
        """
        profile = self._checked(model_type, profile, config_fingerprint, artifact_fingerprint)
        impl = self.default_implementation(profile)
        allowed = self._composition.allowed_implementations
        if allowed is not None and impl.id not in allowed:
            raise ImplementationUnavailable(
                f"Profile {profile.id!r} selects implementation {impl.id!r}, but the host allows "
                f"only {sorted(allowed)}.",
                fix=f"Add {impl.id!r} to the host's allowed implementations.",
            )
        why = self._misfit(impl, model_type, profile)
        if isinstance(why, KernelUnavailable):
            raise KernelUnavailable(
                f"Profile {profile.id!r} cannot run here: {impl.id!r}: {why.message.rstrip('.')}.",
                fix=why.fix,
            )
        if why is not None:
            raise IncompatibleImplementation(
                f"Implementation {impl.id!r} ({_describe(impl)}) cannot serve profile "
                f"{profile.id!r} for model_type {model_type!r}: {why}; it is never replaced "
                "by another implementation.",
                fix="Install or allow a version of the plugin whose implementation fits.",
            )
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
        return Binding(
            implementation=impl,
            profile=profile,
            backend=backend,
            kernels=kernels,
            cache_kinds=self._cache_kinds,
        )

    def default_implementation(self, profile: Profile) -> Implementation:
        """The implementation ``profile`` names, by the selection rule (no fit checks)."""
        ex = profile.execution
        if ex.implementation is not None:
            impl = self._implementations.get(ex.implementation)
            if impl is None:
                raise ImplementationUnavailable(
                    f"Profile {profile.id!r} requires implementation {ex.implementation!r}, "
                    f"which is not installed (installed: {self._describe_impls()}).",
                    fix=self._install_hint(profile),
                )
            return impl
        owner = _plugin(profile)
        wanted = ex.default_implementation
        impl = self._implementations.get(wanted)
        if impl is not None and (owner is None or _plugin(impl) == owner):
            return impl
        foreign = (
            f"; {wanted!r} is registered by {_describe(impl)}, and another plugin's "
            "implementation is never a default"
            if impl is not None
            else ""
        )
        raise ImplementationUnavailable(
            f"Profile {profile.id!r} selects implementation {wanted!r} (named by its graph), "
            f"which {'its plugin does not register' if impl is not None else 'is not installed'}"
            f"{foreign} (installed: {self._describe_impls()}).",
            fix=self._install_hint(profile),
        )

    def _checked(
        self,
        model_type: str,
        profile: Profile,
        config_fingerprint: str | None,
        artifact_fingerprint: str | None,
    ) -> Profile:
        check_instance("Registry.select", "profile", profile, Profile)
        validate_profile(profile)
        registered = self._profiles.get(profile.id)
        if registered is not None:
            if not registered.same_declaration(profile):
                raise ProfileError(
                    f"The profile passed as {profile.id!r} differs from the registered profile "
                    "of that id.",
                    fix="Select with the registered profile, or give yours an id of its own.",
                )
            profile = registered
        elif profile.provider is not None:
            profile = profile.model_copy(update={"provider": None})  # only plugins own profiles
        if model_type not in profile.model_types:
            raise ProfileError(
                f"Profile {profile.id!r} claims model types {sorted(profile.model_types)}, not "
                f"{model_type!r}.",
                fix="Select a profile that claims this model type.",
            )
        if profile.is_exact and (
            profile.artifact_fingerprint != artifact_fingerprint
            or profile.config_fingerprint != config_fingerprint
        ):
            raise ProfileError(
                f"Exact-artifact profile {profile.id!r} is for artifact "
                f"{profile.artifact_fingerprint} with config {profile.config_fingerprint}; this "
                f"artifact is {artifact_fingerprint} with config {config_fingerprint}.",
                fix="Use the family profile for this artifact (resolution chooses it).",
            )
        return profile

    def _default_backend(self) -> Backend:
        return self.kernel_backend or active_backend()

    def _misfit(
        self, impl: Implementation, model_type: str, profile: Profile
    ) -> str | KernelUnavailable | None:
        ex = profile.execution
        if (impl.graph, impl.loader, impl.loop) != (ex.graph, ex.loader, ex.loop):
            return (
                f"it provides graph {impl.graph!r}, loader {impl.loader!r}, loop "
                f"{impl.loop!r}; the profile needs {ex.graph!r}, {ex.loader!r}, {ex.loop!r}"
            )
        if model_type not in impl.model_types:
            return (
                f"it does not accept model_type {model_type!r} (accepts {sorted(impl.model_types)})"
            )
        missing = profile.capabilities - impl.capabilities
        if missing:
            return f"it lacks capabilities {sorted(missing)} the profile requires"
        for name in impl.kernels:
            try:
                self._kernels.resolve(name, self.kernel_backend)
            except KernelUnavailable as err:
                return err
        return None

    def _describe_impls(self) -> str:
        if not self._implementations:
            return "none"
        return ", ".join(f"{i.id!r} from {_describe(i)}" for i in self._implementations.values())

    def _install_hint(self, profile: Profile) -> str:
        provider = profile.provider
        if provider is not None:
            return (
                f"Install a version of {provider.distribution} that registers it, or allow the "
                "plugin that does."
            )
        return "Install or allow the plugin that registers it."
