"""The plugin host: discovery, policy, quarantine, and the registry it builds.

Plugins are found through the entry-point group ``mlx_loom`` (the entry-point
name is the plugin's name) or handed in directly by an embedding host. For
each plugin, in order:

1. the host policy decides whether it may load at all (``blocked``);
2. it is imported and registered with pluggy; a hook implementation that
   matches no hookspec (a misspelling) is an error;
3. its plugin-API version is checked against the core's;
4. its registration hooks are called and every item is checked.

A failure in steps 2–4 *quarantines* that plugin: the host records its
package, version, the reason and the traceback, and carries on with the
others — the CLI keeps working and anything that needs the plugin refuses and
shows the cause. With ``strict=True`` the first failure raises instead.
"""

from __future__ import annotations

import dataclasses
import os
import traceback as tb
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import pluggy
from importlib_metadata import EntryPoint, entry_points

from ..errors import (
    LoomError,
    PluginApiMismatch,
    PluginError,
    PolicyError,
    RegistrationError,
)
from . import _hookspecs as hookspecs
from ._kernels import Kernel, Provider
from ._policy import PluginPolicy
from ._profiles import Profile, validate_profile
from ._registry import Implementation, ModelType, Registry

STRICT_ENV = "MLX_LOOM_STRICT_PLUGINS"

Status = Literal["loaded", "quarantined", "blocked"]


@dataclass(frozen=True)
class PluginRecord:
    """What the host knows about one discovered plugin."""

    name: str
    distribution: str
    version: str
    status: Status
    reason: str | None = None
    traceback: str | None = None
    api_version: str | None = None
    registers: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def provider(self) -> Provider:
        return Provider(self.name, self.distribution, self.version)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "status": self.status,
            "reason": self.reason,
            "api_version": self.api_version,
            "registers": {k: list(v) for k, v in self.registers.items()},
            "traceback": self.traceback,
        }


@dataclass
class _Collected:
    model_types: list[ModelType] = field(default_factory=list)
    kernels: list[Kernel] = field(default_factory=list)
    implementations: list[Implementation] = field(default_factory=list)
    profiles: list[Profile] = field(default_factory=list)


_EXPECTED = {
    "loom_model_types": ModelType,
    "loom_kernels": Kernel,
    "loom_implementations": Implementation,
    "loom_profiles": Profile,
}


class _Quarantine(Exception):
    def __init__(self, reason: str, trace: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.trace = trace


class PluginHost:
    """Discovers plugins, applies the policy, and builds the registry snapshot.

    ``plugins`` adds in-process plugins ``(name, module_or_object)`` — how an
    embedding application or a test supplies plugins without installing them.
    ``entry_points=False`` skips installed plugins entirely.
    """

    def __init__(
        self,
        *,
        policy: PluginPolicy | None = None,
        strict: bool | None = None,
        plugins: Iterable[tuple[str, object]] = (),
        entry_points: bool = True,
    ) -> None:
        self.policy = policy if policy is not None else PluginPolicy.from_env()
        self.strict = strict if strict is not None else os.environ.get(STRICT_ENV) == "1"
        self._pm = pluggy.PluginManager(hookspecs.PROJECT)
        self._pm.add_hookspecs(hookspecs)
        discovered = _discover_entry_points() if entry_points else []
        inline = [(name, obj, Provider(name)) for name, obj in plugins]
        self._check_policy_names([d.name for d in discovered] + [n for n, _, _ in inline])

        records: list[PluginRecord] = []
        collected = _Collected()
        self._profile_providers: list[Provider] = []
        for ep in discovered:
            records.append(self._load(ep.name, _provider_of(ep), collected, loader=ep.load))
        for name, obj, provider in inline:
            records.append(self._load(name, provider, collected, loader=lambda o=obj: o))
        self.records: tuple[PluginRecord, ...] = tuple(records)
        self._registry: Registry | None = None
        self.registry_error: RegistrationError | None = None
        try:
            self._registry = Registry(
                model_types=collected.model_types,
                implementations=collected.implementations,
                profiles=collected.profiles,
                kernels=collected.kernels,
                profile_providers={
                    p.id: prov
                    for p, prov in zip(collected.profiles, self._profile_providers, strict=True)
                },
            )
        except RegistrationError as err:
            if self.strict:
                raise
            self.registry_error = err

    # --- public ------------------------------------------------------------

    @property
    def registry(self) -> Registry:
        """The frozen registry of every loaded plugin's registrations."""
        if self._registry is None:
            assert self.registry_error is not None
            raise self.registry_error
        return self._registry

    def record(self, name: str) -> PluginRecord | None:
        return next((r for r in self.records if r.name == name), None)

    def by_distribution(self, distribution: str) -> PluginRecord | None:
        norm = _normalise(distribution)
        return next((r for r in self.records if _normalise(r.distribution) == norm), None)

    @property
    def loaded(self) -> tuple[PluginRecord, ...]:
        return tuple(r for r in self.records if r.status == "loaded")

    @property
    def unavailable(self) -> tuple[PluginRecord, ...]:
        return tuple(r for r in self.records if r.status != "loaded")

    # --- discovery ---------------------------------------------------------

    def _check_policy_names(self, names: Sequence[str]) -> None:
        unknown = sorted(self.policy.names - set(names))
        if unknown:
            raise PolicyError(
                f"The plugin policy ({self.policy.describe()}) names {unknown}, which match no "
                f"installed plugin (installed: {', '.join(sorted(names)) or 'none'}).",
                fix="Correct the names in the policy (MLX_LOOM_PLUGINS), or install the plugins.",
            )

    def _load(self, name: str, provider: Provider, collected: _Collected, loader) -> PluginRecord:
        base = dict(name=name, distribution=provider.distribution, version=provider.version)
        if not self.policy.permits(name):
            return PluginRecord(
                **base,
                status="blocked",
                reason=f"blocked by plugin policy ({self.policy.describe()})",
            )
        api_version: str | None = None
        try:
            try:
                obj = loader()
            except Exception as err:  # noqa: BLE001 - any import failure quarantines
                raise _Quarantine(
                    f"import failed: {type(err).__name__}: {err}", tb.format_exc()
                ) from None
            api_version = self._register(name, obj)
            found = self._collect(name, obj, provider)
        except _Quarantine as q:
            if self.strict:
                raise PluginError(
                    f"Plugin {name!r} ({provider.distribution} {provider.version}) failed: "
                    f"{q.reason}",
                    fix="Fix or uninstall the plugin, or run without strict plugin loading.",
                ) from None
            if self._pm.get_plugin(name) is not None:
                self._pm.unregister(name=name)
            return PluginRecord(
                **base,
                status="quarantined",
                reason=q.reason,
                traceback=q.trace,
                api_version=api_version,
            )
        collected.model_types += found.model_types
        collected.kernels += found.kernels
        collected.implementations += found.implementations
        collected.profiles += found.profiles
        self._profile_providers += [provider] * len(found.profiles)
        registers = {
            "model_types": tuple(m.name for m in found.model_types),
            "implementations": tuple(i.id for i in found.implementations),
            "profiles": tuple(p.id for p in found.profiles),
            "kernels": tuple(f"{k.name}[{k.backend}]" for k in found.kernels),
        }
        return PluginRecord(**base, status="loaded", api_version=api_version, registers=registers)

    def _register(self, name: str, obj: object) -> str:
        """Register with pluggy, reject misspelt hooks, check the API version."""
        try:
            self._pm.register(obj, name=name)
        except (pluggy.PluginValidationError, ValueError) as err:
            raise _Quarantine(f"invalid plugin: {err}", tb.format_exc()) from None
        try:
            # pluggy's own check: a hook implementation with no matching spec
            # (a misspelling) is an error. Earlier plugins passed it already,
            # so any pending hook belongs to this one.
            self._pm.check_pending()
        except pluggy.PluginValidationError:
            unknown = [
                caller.name
                for caller in (self._pm.get_hookcallers(obj) or [])
                if not caller.has_spec()
            ]
            raise _Quarantine(
                f"implements hooks that match no hookspec: {', '.join(sorted(unknown))} "
                f"(known hooks: loom_plugin_api_version, {', '.join(hookspecs.REGISTRATION_HOOKS)})"
            ) from None
        answers = self._call(name, "loom_plugin_api_version")
        if not answers:
            raise _Quarantine(
                "does not declare the plugin-API version it was written for "
                "(implement loom_plugin_api_version)"
            )
        version = str(answers[0])
        if version.split(".")[0] != hookspecs.PLUGIN_API_VERSION.split(".")[0]:
            err = PluginApiMismatch(
                f"Plugin {name!r} was written for plugin API {version}; this core speaks "
                f"plugin API {hookspecs.PLUGIN_API_VERSION}.",
                fix="Install a plugin release built for this core, or a core that matches it.",
            )
            raise _Quarantine(err.message + " " + f"Fix: {err.fix}")
        return version

    def _call(self, name: str, hook: str) -> list[Any]:
        caller = getattr(self._pm.hook, hook)
        return [impl.function() for impl in caller.get_hookimpls() if impl.plugin_name == name]

    def _collect(self, name: str, obj: object, provider: Provider) -> _Collected:
        found = _Collected()
        for hook, expected in _EXPECTED.items():
            try:
                results = self._call(name, hook)
            except Exception as err:  # noqa: BLE001 - a raising hook quarantines the plugin
                raise _Quarantine(
                    f"{hook} raised {type(err).__name__}: {err}", tb.format_exc()
                ) from None
            items: list[Any] = []
            for result in results:
                if result is None:
                    continue
                if not isinstance(result, (list, tuple)):
                    raise _Quarantine(
                        f"{hook} returned {type(result).__name__}; it must return a list of "
                        f"{expected.__name__}"
                    )
                for item in result:
                    if not isinstance(item, expected):
                        raise _Quarantine(
                            f"{hook} returned a {type(item).__name__}; expected {expected.__name__}"
                        )
                    if dataclasses.is_dataclass(item):
                        item = dataclasses.replace(item, provider=provider)
                    items.append(item)
            if hook == "loom_profiles":
                for profile in items:
                    try:
                        validate_profile(profile, origin=str(provider))
                    except LoomError as err:
                        raise _Quarantine(f"invalid profile: {err.message}") from None
            setattr(found, hook.removeprefix("loom_"), items)
        return found


def _discover_entry_points() -> list[EntryPoint]:
    seen: dict[str, EntryPoint] = {}
    for ep in entry_points(group=hookspecs.ENTRY_POINT_GROUP):
        seen.setdefault(ep.name, ep)
    return sorted(seen.values(), key=lambda e: e.name)


def _provider_of(ep: EntryPoint) -> Provider:
    dist = ep.dist
    if dist is None:
        return Provider(ep.name, "(unknown distribution)", "?")
    return Provider(ep.name, dist.metadata["Name"] or dist.name, dist.version)


def _normalise(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")
