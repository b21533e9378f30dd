"""The plugin host: discovery, quarantine, and the registry it builds.

Plugins are found through the entry-point group ``mlx_loom`` (the entry-point
name is the plugin's name) or handed in directly by an embedding host. For
each plugin, in name order:

1. the host policy decides whether it may load at all (``blocked``); an
   entry-point name claimed by two distributions loads neither (which one ran
   would depend on install order) and both are reported;
2. it is imported — an installed plugin first in a child process, where a
   hang, an exit or a change to MLX itself is caught (:mod:`._import_check`),
   then here, bounded in time (:mod:`._bounded`) — and registered
   with pluggy; a hook implementation that matches no hookspec (a
   misspelling) is an error;
3. its plugin-API version is checked against the core's;
4. its registration hooks are called and every item is type-checked at this
   boundary; its own registrations must be unambiguous on their own (no
   duplicate ids; every family profile has one default implementation).

A failure in steps 2–4 *quarantines* that plugin: the host records its
package, version, the reason and the traceback, and carries on with the
others. Then registrations are compared across plugins: two plugins that
register the same id (model type, implementation, profile, kernel for one
backend, cache kind) are *both* quarantined, each naming the other, because
the host cannot know which one is meant — and every other plugin keeps
working. The CLI keeps working throughout, and anything that needs a
quarantined plugin refuses and shows the cause. With ``strict=True`` the
first failure raises instead.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import pluggy
from importlib_metadata import EntryPoint, entry_points

from ..backends import Kernel, Provider
from ..errors import (
    LoomError,
    PluginApiMismatch,
    PluginError,
    PolicyError,
    RegistrationError,
)
from ..text.tool_calls import ToolParser, parser_table
from . import _hookspecs as hookspecs
from ._bounded import PluginFault, describe, import_plugin, timeout_from_env
from ._bounded import call as bounded_call
from ._import_check import check_imports, module_of
from ._policy import PluginPolicy
from ._profiles import Profile, validate_profile
from ._registrations import Family, Implementation, ModelType, Registrations, check_cache_kind
from ._registry import Registry

STRICT_ENV = "MLX_LOOM_STRICT_PLUGINS"

Status = Literal["loaded", "quarantined", "blocked"]

_API_VERSION = re.compile(r"^(\d{1,4})\.(\d{1,4})$")


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
    #: The plugins whose registrations collide with this one's (both quarantined).
    conflicts_with: tuple[str, ...] = ()

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
            "conflicts_with": list(self.conflicts_with),
            "traceback": self.traceback,
        }


#: What each registration hook must return a list of.
_EXPECTED: dict[str, type] = {
    "loom_families": Family,
    "loom_model_types": ModelType,
    "loom_kernels": Kernel,
    "loom_implementations": Implementation,
    "loom_profiles": Profile,
    "loom_cache_kinds": type,
    "loom_tool_parsers": ToolParser,
}


def _given(obj: object) -> Callable[[], object]:
    """How to get a plugin object handed to the host directly: return it."""
    return lambda: obj


@dataclass(frozen=True)
class _Candidate:
    """A plugin to load: its name, who provides it and how to get the object."""

    name: str
    provider: Provider
    load: Callable[[], object]
    clash: str | None = None  # why it may not load: its name is claimed twice
    entry: tuple[str, str, str] | None = None  # an installed plugin: (name, value, group)


@dataclass
class _Loaded:
    record: PluginRecord
    found: Registrations


class PluginHost:
    """Discovers plugins, applies the policy, and builds the registry snapshot.

    ``plugins`` adds in-process plugins ``(name, module_or_object)`` — how an
    embedding application or a test supplies plugins without installing them.
    ``entry_points=False`` skips installed plugins entirely. ``timeout`` bounds
    each import and hook call in seconds (default ``MLX_LOOM_PLUGIN_TIMEOUT``,
    else 60).
    """

    def __init__(
        self,
        *,
        policy: PluginPolicy | None = None,
        strict: bool | None = None,
        plugins: Iterable[tuple[str, object]] = (),
        entry_points: bool = True,
        timeout: float | None = None,
    ) -> None:
        self.policy = policy if policy is not None else PluginPolicy.from_env()
        self.strict = strict if strict is not None else os.environ.get(STRICT_ENV) == "1"
        self.timeout = timeout if timeout is not None else timeout_from_env()
        self._pm = pluggy.PluginManager(hookspecs.PROJECT)
        self._pm.add_hookspecs(hookspecs)
        candidates = _discover_entry_points() if entry_points else []
        candidates += [_Candidate(name, Provider(name), _given(obj)) for name, obj in plugins]
        candidates = _mark_name_clashes(candidates)
        self._check_policy_names([c.name for c in candidates])

        refused = self._check_imports(candidates)
        outcomes: list[PluginRecord | _Loaded] = [
            self._load(c, refused.get(c.name)) for c in candidates
        ]
        outcomes = self._quarantine_conflicts(outcomes)
        self.records: tuple[PluginRecord, ...] = tuple(
            o.record if isinstance(o, _Loaded) else o for o in outcomes
        )
        merged = sum((o.found for o in outcomes if isinstance(o, _Loaded)), Registrations())
        self._registry: Registry | None = None
        self.registry_error: RegistrationError | None = None
        try:
            self._registry = _registry_of(merged)
        except RegistrationError as err:  # a conflict the checks above did not foresee
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
                f"installed plugin (installed: {', '.join(sorted(set(names))) or 'none'}).",
                fix="Correct the names in the policy (MLX_LOOM_PLUGINS), or install the plugins.",
            )

    def _check_imports(self, candidates: Sequence[_Candidate]) -> dict[str, str]:
        """Installed plugins this process has not imported yet, imported first
        in a child process (:mod:`._import_check`): ``{name: why refused}``."""
        entries = [
            c.entry
            for c in candidates
            if c.entry is not None
            and c.clash is None
            and self.policy.permits(c.name)
            and module_of(c.entry[1]) not in sys.modules
        ]
        return check_imports(entries, timeout=self.timeout) if entries else {}

    def _load(self, candidate: _Candidate, refused: str | None = None) -> PluginRecord | _Loaded:
        name, provider = candidate.name, candidate.provider
        base: dict[str, Any] = dict(
            name=name, distribution=provider.distribution, version=provider.version
        )
        if not self.policy.permits(name):
            return PluginRecord(
                **base,
                status="blocked",
                reason=f"blocked by plugin policy ({self.policy.describe()})",
            )
        api_version: str | None = None
        try:
            if candidate.clash is not None:
                raise PluginFault(candidate.clash)
            if refused is not None:
                raise PluginFault(refused)
            obj = import_plugin(candidate.load, what="import", timeout=self.timeout)
            api_version = self._register(name, obj)
            found = self._collect(name, provider)
            _check_alone(found)
        except PluginFault as fault:
            return self._quarantined(name, provider, fault, api_version)
        registers = _summary(found)
        record = PluginRecord(**base, status="loaded", api_version=api_version, registers=registers)
        return _Loaded(record, found)

    def _quarantined(
        self,
        name: str,
        provider: Provider,
        fault: PluginFault,
        api_version: str | None,
        *,
        conflict: PluginRecord | None = None,
    ) -> PluginRecord:
        """The quarantine record; ``conflict`` is the loaded record of a plugin
        quarantined only for colliding with others, whose registrations (what it
        would claim) and partners are kept."""
        if self.strict:
            raise PluginError(
                f"Plugin {name!r} ({provider.distribution} {provider.version}) failed: "
                f"{fault.reason}",
                fix="Fix or uninstall the plugin, or run without strict plugin loading.",
            ) from None
        if self._pm.has_plugin(name):
            self._pm.unregister(name=name)
        return PluginRecord(
            name=name,
            distribution=provider.distribution,
            version=provider.version,
            status="quarantined",
            reason=fault.reason,
            traceback=fault.trace,
            api_version=api_version,
            registers=conflict.registers if conflict is not None else {},
            conflicts_with=conflict.conflicts_with if conflict is not None else (),
        )

    def _register(self, name: str, obj: object) -> str:
        """Register with pluggy, reject misspelt hooks, check the API version."""
        try:
            self._pm.register(obj, name=name)
        except (Exception, SystemExit, GeneratorExit) as err:  # noqa: BLE001 - not Ctrl-C
            raise PluginFault(f"invalid plugin: {describe(err)}") from None
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
            raise PluginFault(
                f"implements hooks that match no hookspec: {', '.join(sorted(unknown))} "
                f"(known hooks: loom_plugin_api_version, {', '.join(hookspecs.REGISTRATION_HOOKS)})"
            ) from None
        answers = self._call(name, "loom_plugin_api_version")
        if not answers:
            raise PluginFault(
                "does not declare the plugin-API version it was written for "
                "(implement loom_plugin_api_version)"
            )
        version = answers[0]
        if not isinstance(version, str) or not _API_VERSION.match(version):
            raise PluginFault(
                f"loom_plugin_api_version returned {version!r:.60}; it must return a "
                f"'MAJOR.MINOR' string such as {hookspecs.PLUGIN_API_VERSION!r}"
            )
        if version.split(".")[0] != hookspecs.PLUGIN_API_VERSION.split(".")[0]:
            mismatch = PluginApiMismatch(
                f"Plugin {name!r} was written for plugin API {version}; this core speaks "
                f"plugin API {hookspecs.PLUGIN_API_VERSION}.",
                fix="Install a plugin release built for this core, or a core that matches it.",
            )
            raise PluginFault(mismatch.message + " " + f"Fix: {mismatch.fix}")
        if _minor(version) < _minor(hookspecs.OLDEST_PLUGIN_API_VERSION):
            too_old = PluginApiMismatch(
                f"Plugin {name!r} was written for plugin API {version}; this core needs plugin "
                f"API {hookspecs.OLDEST_PLUGIN_API_VERSION} or later (it speaks "
                f"{hookspecs.PLUGIN_API_VERSION}).",
                fix=f"Install a release of the plugin written for plugin API "
                f"{hookspecs.OLDEST_PLUGIN_API_VERSION} or later (its loom_plugin_api_version "
                "says which).",
            )
            raise PluginFault(f"{too_old.message} Fix: {too_old.fix}")
        return version

    def _call(self, name: str, hook: str) -> list[Any]:
        caller = getattr(self._pm.hook, hook)
        return [
            bounded_call(impl.function, what=hook, timeout=self.timeout)
            for impl in caller.get_hookimpls()
            if impl.plugin_name == name
        ]

    def _collect(self, name: str, provider: Provider) -> Registrations:
        """Call every registration hook; check each item here, at the boundary."""
        found = Registrations()
        for hook, expected in _EXPECTED.items():
            for result in self._call(name, hook):
                if result is None:
                    continue
                if not isinstance(result, (list, tuple)):
                    raise PluginFault(
                        f"{hook} returned {type(result).__name__}; it must return a list of "
                        f"{expected.__name__}"
                    )
                for item in result:
                    if not isinstance(item, expected):
                        raise PluginFault(
                            f"{hook} returned a {type(item).__name__}; expected {expected.__name__}"
                        )
                    try:
                        found += _admit(hook, item, provider)
                    except LoomError as err:
                        what = "profile" if hook == "loom_profiles" else f"registration ({hook})"
                        raise PluginFault(f"invalid {what}: {err.message}") from None
        return found

    # --- across plugins ----------------------------------------------------

    def _quarantine_conflicts(
        self, outcomes: list[PluginRecord | _Loaded]
    ) -> list[PluginRecord | _Loaded]:
        """Quarantine every plugin that registers an id another plugin also registers."""
        owners: dict[tuple[str, str], list[str]] = {}
        loaded = {o.record.name: o for o in outcomes if isinstance(o, _Loaded)}
        for name, done in loaded.items():
            for key in _ids(done.found):
                owners.setdefault(key, []).append(name)
        reasons: dict[str, list[str]] = {}
        partners: dict[str, set[str]] = {}
        for (kind, ident), names in owners.items():
            if len(names) < 2:
                continue
            for name in names:
                partners.setdefault(name, set()).update(n for n in names if n != name)
                others = ", ".join(str(loaded[n].record.provider) for n in names if n != name)
                reasons.setdefault(name, []).append(
                    f"{kind} {ident!r} is also registered by {others}"
                )
        if not reasons:
            return outcomes
        result: list[PluginRecord | _Loaded] = []
        for outcome in outcomes:
            if not isinstance(outcome, _Loaded) or outcome.record.name not in reasons:
                result.append(outcome)
                continue
            name = outcome.record.name
            fault = PluginFault(
                "conflicts with another plugin: "
                + "; ".join(sorted(reasons[name]))
                + " (neither is loaded; uninstall or disallow one of them)"
            )
            partners_of = tuple(sorted(partners[name]))
            record = dataclasses.replace(outcome.record, conflicts_with=partners_of)
            result.append(
                self._quarantined(name, record.provider, fault, record.api_version, conflict=record)
            )
        return result


def _admit(hook: str, item: Any, provider: Provider) -> Registrations:
    """One returned item, re-checked and tagged with its provider."""
    if hook == "loom_families":
        regs = item.registrations()
        return Registrations(
            model_types=tuple(_tag(m, provider) for m in regs.model_types),
            kernels=tuple(_tag(k, provider) for k in regs.kernels),
            implementations=tuple(_tag(i, provider) for i in regs.implementations),
            profiles=tuple(_tag(p, provider) for p in regs.profiles),
            cache_kinds=regs.cache_kinds,
        )
    if hook == "loom_cache_kinds":
        return Registrations(cache_kinds=(check_cache_kind(item),))
    if hook == "loom_tool_parsers":
        tagged = _tag(item, provider)
        parser_table([tagged])  # a built-in's name is refused here, naming both
        return Registrations(tool_parsers=(tagged,))
    tagged = _tag(item, provider)
    field_name = hook.removeprefix("loom_")
    return Registrations(**{field_name: (tagged,)})


def _tag(item: Any, provider: Provider) -> Any:
    if isinstance(item, Profile):
        profile = item.model_copy(update={"provider": provider})
        validate_profile(profile, origin=str(provider))
        return profile
    # replace() builds a new instance, so __post_init__ checks every field again
    # even if the plugin forged the original.
    return dataclasses.replace(item, provider=provider)


def _minor(version: str) -> int:
    """The minor part of a ``MAJOR.MINOR`` version already matched by ``_API_VERSION``."""
    return int(version.split(".")[1])


def _check_alone(found: Registrations) -> None:
    """A plugin's registrations must be unambiguous on their own."""
    try:
        _registry_of(found)
    except RegistrationError as err:
        raise PluginFault(f"invalid registrations: {err.message}") from None


def _registry_of(found: Registrations) -> Registry:
    return Registry(
        model_types=found.model_types,
        implementations=found.implementations,
        profiles=found.profiles,
        kernels=found.kernels,
        cache_kinds=found.cache_kinds,
        tool_parsers=found.tool_parsers,
    )


def _ids(found: Registrations) -> set[tuple[str, str]]:
    return {
        *(("model type", m.name) for m in found.model_types),
        *(("implementation", i.id) for i in found.implementations),
        *(("profile", p.id) for p in found.profiles),
        *(("kernel", f"{k.name}[{k.backend}]") for k in found.kernels),
        *(("cache kind", c.kind) for c in found.cache_kinds),
        *(("tool parser", t.name) for t in found.tool_parsers),
    }


def _summary(found: Registrations) -> dict[str, tuple[str, ...]]:
    return {
        "model_types": tuple(m.name for m in found.model_types),
        "implementations": tuple(i.id for i in found.implementations),
        "profiles": tuple(p.id for p in found.profiles),
        "kernels": tuple(f"{k.name}[{k.backend}]" for k in found.kernels),
        "cache_kinds": tuple(c.kind for c in found.cache_kinds),
        "tool_parsers": tuple(t.name for t in found.tool_parsers),
    }


def _discover_entry_points() -> list[_Candidate]:
    return sorted(
        (
            _Candidate(ep.name, _provider_of(ep), ep.load, entry=(ep.name, ep.value, ep.group))
            for ep in _entry_points()
        ),
        key=lambda c: c.name,
    )


def _entry_points() -> list[EntryPoint]:
    return list(entry_points(group=hookspecs.ENTRY_POINT_GROUP))


def _mark_name_clashes(candidates: list[_Candidate]) -> list[_Candidate]:
    """A plugin name claimed twice (two distributions, or an entry point and an
    in-process plugin) loads neither claimant; each is reported with the others."""
    by_name: dict[str, list[_Candidate]] = {}
    for c in candidates:
        by_name.setdefault(c.name, []).append(c)
    out = []
    for c in candidates:
        claimants = by_name[c.name]
        if len(claimants) == 1:
            out.append(c)
            continue
        listed = "; ".join(f"{o.provider.distribution} {o.provider.version}" for o in claimants)
        clash = (
            f"plugin name {c.name!r} is claimed by {len(claimants)} distributions ({listed}); "
            "none is loaded, since which one ran would depend on install order "
            "(uninstall all but one)"
        )
        out.append(dataclasses.replace(c, clash=clash))
    return out


def _provider_of(ep: EntryPoint) -> Provider:
    dist = ep.dist
    if dist is None:
        return Provider(ep.name, "(unknown distribution)", "?")
    return Provider(ep.name, dist.metadata["Name"] or dist.name, dist.version)


def _normalise(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")
