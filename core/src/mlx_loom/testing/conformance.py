"""The conformance suite: does one plugin honour the core's contracts?

The suite is plain functions returning :class:`CheckResult` values, so the
same checks run from pytest (``loom_conformance`` fixture), from the command
line (``loom plugins check NAME``) and from a plugin author's own tests.

What it checks, in order (each check is named; a check that applies to
several model types or implementations is reported once per item, with the
item in brackets):

``hooks``
    the plugin loads, declares a compatible plugin-API version and implements
    only known hooks.
``registrations``
    every model type, implementation, profile and kernel is well formed:
    namespaced ids, a schema, a tiny checkpoint recipe, implementations whose
    model types and kernels are registered, every implementation selected by
    some profile, profiles whose implementation fits them with no more
    capabilities than it provides. An *implementation-only* plugin (a tuned
    implementation plus exact-artifact profiles naming it, for model types
    another installed plugin claims) is a valid plugin.
``no-collisions``
    composed with every other installed plugin, nothing it registers collides
    (ids, kernel registrations, cache kinds — a host would quarantine both),
    each of its model types keeps one family profile, and the tiny checkpoint
    of every *other* plugin's model type it touches resolves exactly as it
    does without it (same profile, same implementation).
``construct[MODEL_TYPE]``
    a tiny random-weight checkpoint of each model type resolves to this
    plugin and builds (for an implementation-only plugin: the owning plugin's
    tiny checkpoint, bound to this plugin's implementation through an
    exact-artifact profile); ``implementations`` checks every declared
    implementation was built at least once.
``forward``, ``incremental-decode``, ``greedy-determinism``,
``weight-coverage``, ``kernel-refusal`` and the capability checks
(``cache-trim``, ``prompt-cache-reuse``, ``state-round-trip``,
``batch-rows``, ``batch-equals-single``, ``speculative-rounds``,
``kv-quantization``, ``kv-codecs``, ``compiled-step``, ``parallel-plan``) run
on one built model per
implementation; see
:mod:`mlx_loom.testing._model_checks`.

A check never skips when it applies: a capability check the plugin does not
declare is reported as ``SKIP (capability not declared)``; one whose
preconditions failed (the model did not build) is a ``FAIL``.
"""

from __future__ import annotations

import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from importlib_metadata import entry_points

from ..cache import CACHE_KINDS
from ..errors import LoomError
from ..host import (
    LOOP_CAPABILITIES,
    PLUGIN_API_VERSION,
    Execution,
    Implementation,
    Kernel,
    ModelType,
    PluginHost,
    PluginPolicy,
    PluginRecord,
    Profile,
    Registry,
    Resolved,
)
from ..host._hookspecs import PROJECT, REGISTRATION_HOOKS
from ..host._resolution import identify, resolve
from ..loader import build_model
from ..model import Model
from ..text import Tokenizer
from .checkpoints import write_checkpoint

__all__ = [
    "CheckResult",
    "ConformanceReport",
    "Target",
    "plugin_host",
    "run_conformance",
]

Status = Literal["pass", "fail", "skip"]
NOT_DECLARED = "capability not declared"


@dataclass(frozen=True)
class CheckResult:
    """One named check's outcome with a one-line detail."""

    name: str
    status: Status
    detail: str

    @property
    def ok(self) -> bool:
        return self.status != "fail"

    def line(self) -> str:
        detail = self.detail
        if self.status == "skip" and not detail.startswith("("):
            detail = f"({detail})"
        return f"{self.status.upper()} {self.name} — {detail}"


def passed(name: str, detail: str) -> CheckResult:
    return CheckResult(name, "pass", detail)


def failed(name: str, detail: str) -> CheckResult:
    return CheckResult(name, "fail", detail)


def skipped(name: str, detail: str = NOT_DECLARED) -> CheckResult:
    return CheckResult(name, "skip", detail)


@dataclass(frozen=True)
class ConformanceReport:
    """Every check run against one plugin.

    ``available`` is False when the plugin is not installed, blocked or
    quarantined: nothing else could be checked (``loom plugins check``
    exits 3 then).
    """

    plugin: str
    results: tuple[CheckResult, ...]
    available: bool = True
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return self.available and all(r.ok for r in self.results)

    @property
    def failures(self) -> tuple[CheckResult, ...]:
        return tuple(r for r in self.results if r.status == "fail")

    def count(self, status: Status) -> int:
        return sum(1 for r in self.results if r.status == status)

    def summary(self) -> str:
        verdict = "conforms" if self.passed else "does NOT conform"
        return (
            f"plugin {self.plugin!r} {verdict}: {self.count('pass')} passed, "
            f"{self.count('fail')} failed, {self.count('skip')} skipped "
            f"({self.seconds:.1f} s)"
        )

    def format(self) -> str:
        return "\n".join([*(r.line() for r in self.results), self.summary()])

    def result(self, name: str) -> CheckResult:
        """The result named ``name`` (raises ``KeyError`` when absent)."""
        for r in self.results:
            if r.name == name:
                return r
        raise KeyError(f"no check named {name!r} (ran: {[r.name for r in self.results]})")


@dataclass
class Target:
    """A built model of one implementation, from a tiny checkpoint of one model type."""

    model_type: ModelType
    implementation: Implementation
    checkpoint: Path
    resolved: Resolved
    model: Model
    tokenizer: Tokenizer
    workdir: Path

    @property
    def label(self) -> str:
        return self.model_type.name

    @property
    def capabilities(self) -> frozenset[str]:
        return self.model.capabilities


def plugin_host(
    name: str, plugin: object | None = None, *, policy: PluginPolicy | None = None
) -> PluginHost:
    """An isolated host holding only plugin ``name``.

    With ``plugin`` (a module or object with hookimpls) it is handed in
    directly — nothing needs to be installed; otherwise the installed entry
    point ``name`` is loaded, and ``policy`` (default: allow only ``name``)
    decides whether it may be.
    """
    if plugin is not None:
        return PluginHost(policy=PluginPolicy(), plugins=[(name, plugin)], entry_points=False)
    if policy is None:
        installed = PluginHost(policy=PluginPolicy.none())
        if installed.record(name) is None:
            return installed  # no such plugin: the caller reports it missing
        policy = PluginPolicy.allow(name)
    return PluginHost(policy=policy)


def _guard(name: str, fn: Callable[[], CheckResult | Iterable[CheckResult]]) -> list[CheckResult]:
    """Run one check; an unexpected exception is that check's failure, not the suite's."""
    try:
        out = fn()
    except Exception as err:  # noqa: BLE001 - every error becomes a reported failure
        return [failed(name, _describe_error(err))]
    return [out] if isinstance(out, CheckResult) else list(out)


def _describe_error(err: BaseException) -> str:
    if isinstance(err, LoomError):
        text = f"{type(err).__name__}: {err.message}"
    else:
        text = f"{type(err).__name__}: {err}"
        frame = traceback.extract_tb(err.__traceback__)[-1:] if err.__traceback__ else []
        if frame:
            text += f" (at {Path(frame[0].filename).name}:{frame[0].lineno})"
    return " ".join(text.split())


# --- the plugin and what it registered ----------------------------------------


@dataclass
class _Subject:
    """The plugin under test: its record and registrations, from its own host.

    ``own`` holds only this plugin's registrations; ``registry`` is what the
    checks build against — ``own``, plus, for model types this plugin uses but
    does not claim (an implementation-only plugin), the installed plugins
    that claim them.
    """

    name: str
    host: PluginHost
    record: PluginRecord
    own: Registry
    registry: Registry
    obj: object | None
    model_types: list[ModelType] = field(default_factory=list)
    implementations: list[Implementation] = field(default_factory=list)
    profiles: list[Profile] = field(default_factory=list)
    kernels: list[Kernel] = field(default_factory=list)
    foreign_types: frozenset[str] = frozenset()
    _others: list[tuple[PluginRecord, Registry]] | None = None

    @classmethod
    def of(cls, name: str, host: PluginHost, obj: object | None) -> _Subject:
        record = host.record(name)
        assert record is not None
        own = host.registry
        mine = lambda item: item.provider is not None and item.provider.plugin == name  # noqa: E731
        subject = cls(
            name=name,
            host=host,
            record=record,
            own=own,
            registry=own,
            obj=obj,
            model_types=[m for m in own.model_types.values() if mine(m)],
            implementations=[i for i in own.implementations.values() if mine(i)],
            profiles=[p for p in own.profiles if mine(p)],
            kernels=[k for k in own.kernels if mine(k)],
        )
        used = {m for i in subject.implementations for m in i.model_types}
        used |= {m for p in subject.profiles for m in p.model_types}
        subject.foreign_types = frozenset(used - {m.name for m in subject.model_types})
        owners = (
            [reg for _, reg in subject.others if subject.foreign_types & set(reg.model_types)]
            if subject.foreign_types
            else []
        )
        if owners:
            try:
                subject.registry = Registry.combined(own, *owners)
            except LoomError:
                pass  # reported by no-collisions; the checks build against own
        return subject

    @property
    def others(self) -> list[tuple[PluginRecord, Registry]]:
        """Every other installed plugin, each with the registry it builds alone."""
        if self._others is None:
            self._others = _installed_alone(exclude=self.name)
        return self._others

    @property
    def implementation_only(self) -> bool:
        return not self.model_types and not any(not p.is_exact for p in self.profiles)


def _installed_alone(*, exclude: str) -> list[tuple[PluginRecord, Registry]]:
    """Every other installed plugin that loads on its own, with the registry it builds.

    A plugin quarantined only because it collides with another (perhaps the
    subject) is included: that collision is what ``no-collisions`` must find.
    """
    everyone = PluginHost(policy=PluginPolicy())
    out = []
    for record in everyone.records:
        if record.name == exclude or (record.status != "loaded" and not record.conflicts_with):
            continue
        alone = PluginHost(policy=PluginPolicy.allow(record.name))
        mine = alone.record(record.name)
        if alone.registry_error is None and mine is not None and mine.status == "loaded":
            out.append((mine, alone.registry))
    return out


def check_hooks(subject: _Subject) -> CheckResult:
    name = "hooks"
    record = subject.record
    version = record.api_version or ""
    if version.split(".")[0] != PLUGIN_API_VERSION.split(".")[0]:
        return failed(
            name, f"declares plugin API {version!r}; this core speaks {PLUGIN_API_VERSION}"
        )
    implemented = _hookimpl_names(subject)
    known = {"loom_plugin_api_version", *REGISTRATION_HOOKS}
    unknown = sorted(set(implemented) - known)
    if unknown:
        return failed(name, f"implements unknown hooks {unknown}")
    registering = {"loom_families", "loom_model_types", "loom_implementations", "loom_profiles"}
    if not set(implemented) & registering and not _codec_kinds(subject):
        return failed(
            name,
            f"implements none of {', '.join(sorted(registering))}; a plugin registers at least "
            "a family, or an implementation and a profile, or a KV codec's cache kinds",
        )
    return passed(
        name,
        f"plugin API {version} (core {PLUGIN_API_VERSION}); implements {', '.join(implemented)}",
    )


def _hookimpl_names(subject: _Subject) -> list[str]:
    obj = subject.obj
    if obj is None:
        found = [ep for ep in entry_points(group=PROJECT) if ep.name == subject.name]
        obj = found[0].load() if found else None
    if obj is None:
        return []
    marker = f"{PROJECT}_impl"
    return sorted(
        attr
        for attr in dir(obj)
        if attr.startswith("loom_") and hasattr(getattr(obj, attr, None), marker)
    )


def _codec_kinds(subject: _Subject) -> list[type]:
    """The KV codec cache kinds this plugin registers (see :mod:`mlx_loom.cache.codecs`)."""
    return [
        cls
        for kind, cls in subject.own.cache_kinds.items()
        if kind not in CACHE_KINDS and isinstance(getattr(cls, "codec", None), str)
    ]


def check_registrations(subject: _Subject) -> CheckResult:
    name = "registrations"
    problems: list[str] = []
    reg, plugin = subject.registry, subject.name
    codec_only = not subject.implementations and not subject.profiles and _codec_kinds(subject)
    if codec_only:
        kinds = ", ".join(c.__name__ for c in _codec_kinds(subject))
        return passed(name, f"KV codec plugin: cache kinds {kinds} (checked by kv-codec-kinds)")
    if not subject.implementations:
        problems.append("registers no implementation")
    if not subject.profiles:
        problems.append("registers no profile")
    if subject.implementation_only:
        problems += _implementation_only_problems(subject)
    elif subject.foreign_types:
        problems.append(
            f"uses model types {sorted(subject.foreign_types)} it does not claim, beside ones it "
            "does: a family plugin claims its model types; tuning another plugin's is the job "
            "of an implementation-only plugin"
        )
    for mt in subject.model_types:
        where = f"model type {mt.name!r}"
        if not mt.fingerprint_fields:
            problems.append(
                f"{where}: fingerprint_fields must name the fields that decide the graph"
            )
        if mt.tiny_config is None:
            problems.append(f"{where}: no tiny_config (a small complete config.json dict)")
        elif mt.tiny_config.get("model_type") != mt.name:
            problems.append(
                f"{where}: tiny_config['model_type'] is {mt.tiny_config.get('model_type')!r}"
            )
        if mt.checkpoint_tensors is None:
            problems.append(f"{where}: no checkpoint_tensors(config) -> {{name: (shape, dtype)}}")
        if not any(mt.name in p.model_types and not p.is_exact for p in subject.profiles):
            problems.append(f"{where}: no family profile of this plugin claims it")
    selected = set()
    for profile in subject.profiles:
        where = f"profile {profile.id!r}"
        if not profile.id.startswith(f"{plugin}/"):
            problems.append(f"{where}: id must start with '{plugin}/'")
        try:
            impl = reg.default_implementation(profile)
        except LoomError as err:
            problems.append(f"{where}: {err.message}")
            continue
        selected.add(impl.id)
        ex = profile.execution
        if (impl.graph, impl.loader, impl.loop) != (ex.graph, ex.loader, ex.loop):
            problems.append(
                f"{where}: selects {impl.id!r}, whose graph/loader/loop differ from the profile's"
            )
        extra = sorted(profile.capabilities - impl.capabilities)
        if extra:
            problems.append(f"{where}: declares {extra}, which {impl.id!r} does not provide")
    for impl in subject.implementations:
        where = f"implementation {impl.id!r}"
        if not impl.id.startswith(f"{plugin}."):
            problems.append(f"{where}: id must start with '{plugin}.'")
        unclaimed = sorted(m for m in impl.model_types if m not in reg.model_types)
        if unclaimed:
            problems.append(f"{where}: model types {unclaimed} are claimed by no installed plugin")
        if impl.loop not in LOOP_CAPABILITIES:
            problems.append(f"{where}: loop {impl.loop!r} is not a core loop")
        elif not LOOP_CAPABILITIES[impl.loop] <= impl.capabilities:
            problems.append(
                f"{where}: loop {impl.loop!r} needs capabilities "
                f"{sorted(LOOP_CAPABILITIES[impl.loop])}"
            )
        for kernel in impl.kernels:
            if not reg.kernels.backends_for(kernel):
                problems.append(f"{where}: kernel {kernel!r} has no registration")
        if impl.id not in selected:
            problems.append(
                f"{where}: no profile selects it (a family profile selects the implementation "
                "whose id is its graph id; an exact-artifact profile names one explicitly)"
            )
    if problems:
        return failed(name, "; ".join(problems))
    kind = "implementation-only plugin: " if subject.implementation_only else ""
    return passed(
        name,
        f"{kind}{len(subject.model_types)} model type(s), {len(subject.implementations)} "
        f"implementation(s), {len(subject.profiles)} profile(s), {len(subject.kernels)} kernel "
        "registration(s), all well formed",
    )


def _implementation_only_problems(subject: _Subject) -> list[str]:
    problems = []
    for profile in subject.profiles:
        if profile.execution.implementation is None:
            problems.append(
                f"profile {profile.id!r}: an implementation-only plugin's exact-artifact profile "
                "must name the implementation it tunes the artifact for"
            )
    unclaimed = sorted(subject.foreign_types - set(subject.registry.model_types))
    if unclaimed:
        problems.append(
            f"tunes model types {unclaimed}, which no installed plugin claims (install the "
            "family plugin it builds on)"
        )
    return problems


def check_collisions(subject: _Subject, workdir: Path) -> CheckResult:
    """Compose this plugin with every other installed plugin; nothing else may change."""
    name = "no-collisions"
    if not subject.others:
        return passed(name, "no other installed plugins to compose with")
    others = [reg for _, reg in subject.others]
    listed = ", ".join(r.name for r, _ in subject.others)
    try:
        combined = Registry.combined(subject.own, *others)
    except LoomError as err:
        return failed(
            name, f"{err.message.rstrip('.')} — a host with both installed quarantines both"
        )
    for mt in subject.model_types:
        family = [p.id for p in combined.profiles if mt.name in p.model_types and not p.is_exact]
        if len(family) > 1:
            return failed(
                name, f"model type {mt.name!r} is claimed by several family profiles: {family}"
            )
    baseline = Registry.combined(*others)
    touched = sorted(subject.foreign_types & set(baseline.model_types))
    changed = []
    for model_type in touched:
        checkpoint = _tiny_checkpoint(
            baseline.model_type(model_type), workdir / "no-collisions" / model_type
        )
        before = _resolves_to(checkpoint, subject.host, baseline)
        after = _resolves_to(checkpoint, subject.host, combined)
        if before != after:
            changed.append(f"{model_type!r}: {before} -> {after}")
    if changed:
        return failed(
            name,
            "installing it changes what another plugin's checkpoint resolves to: "
            + "; ".join(changed),
        )
    unchanged = f"; tiny checkpoints of {touched} resolve as before" if touched else ""
    return passed(name, f"composes with the other installed plugins ({listed}){unchanged}")


def _resolves_to(checkpoint: Path, host: PluginHost, registry: Registry) -> str:
    try:
        summary = resolve(checkpoint, host=host, registry=registry).summary
    except LoomError as err:
        return f"refused ({type(err).__name__})"
    return f"{summary.profile} / {summary.implementation}"


# --- building targets -------------------------------------------------------------


def _tiny_checkpoint(mt: ModelType, directory: Path, *, seed: int = 0) -> Path:
    if mt.tiny_config is None or mt.checkpoint_tensors is None:
        raise _NotBuildable(
            f"model type {mt.name!r} declares no tiny_config/checkpoint_tensors, so no "
            "tiny checkpoint can be written"
        )
    config = dict(mt.tiny_config)
    return write_checkpoint(directory, config, mt.checkpoint_tensors(config), seed=seed)


class _NotBuildable(Exception):
    pass


def resolve_for(
    checkpoint: Path, implementation: Implementation, *, host: PluginHost, registry: Registry
) -> Resolved:
    """Resolve ``checkpoint`` and bind it to ``implementation`` specifically.

    When the profile resolution picks selects another implementation (or
    none), the implementation is pinned the way the design pins one: an
    exact-artifact profile for this checkpoint's fingerprints naming it —
    so the binding still goes through :meth:`Registry.select` and its checks.
    """
    try:
        resolved = resolve(checkpoint, host=host, registry=registry)
        if resolved.binding.implementation.id == implementation.id:
            return resolved
    except LoomError:
        pass  # the pinned resolution below reports what is wrong with this implementation
    ident = identify(checkpoint, host=host, registry=registry)
    impl = implementation
    pin = Profile(
        id=f"conformance/{impl.id}",
        model_types=frozenset({ident.model_type.name}),
        execution=Execution(
            graph=impl.graph,
            loader=impl.loader,
            loop=impl.loop,
            specialization="artifact",
            implementation=impl.id,
        ),
        artifact_fingerprint=ident.artifact_fingerprint,
        config_fingerprint=ident.config_fingerprint,
        capabilities=impl.capabilities,
    )
    return resolve(checkpoint, host=host, registry=registry.with_(profiles=[pin]))


def load_target(
    subject_host: PluginHost,
    registry: Registry,
    mt: ModelType,
    impl: Implementation,
    directory: Path,
    *,
    seed: int = 0,
) -> Target:
    checkpoint = _tiny_checkpoint(mt, directory, seed=seed)
    resolved = resolve_for(checkpoint, impl, host=subject_host, registry=registry)
    model = build_model(resolved)
    tokenizer = Tokenizer.from_dir(checkpoint, config_eos=resolved.config.eos_token_id)
    return Target(mt, impl, checkpoint, resolved, model, tokenizer, directory.parent)


def _pairs(subject: _Subject) -> list[tuple[ModelType, Implementation]]:
    """(model type, implementation) pairs to build: each of this plugin's model types once,
    with the implementation its family profile selects, plus every other implementation
    of this plugin (with the first model type it serves)."""
    reg = subject.registry
    out: list[tuple[ModelType, Implementation]] = []
    mine = {i.id for i in subject.implementations}
    for mt in sorted(subject.model_types, key=lambda m: m.name):
        chosen = None
        for profile in subject.profiles:
            if mt.name in profile.model_types and not profile.is_exact:
                try:
                    chosen = reg.default_implementation(profile)
                except LoomError:
                    continue
                break
        if chosen is None or chosen.id not in mine:
            chosen = next((i for i in subject.implementations if mt.name in i.model_types), None)
        if chosen is not None:
            out.append((mt, chosen))
    reached = {impl.id for _, impl in out}
    for impl in subject.implementations:
        if impl.id in reached:
            continue
        served = sorted(m for m in impl.model_types if m in reg.model_types)
        if served:
            out.append((reg.model_type(served[0]), impl))
    return out


def _check_construct(
    subject: _Subject, mt: ModelType, impl: Implementation, workdir: Path
) -> tuple[CheckResult, Target | None]:
    name = f"construct[{mt.name}]"
    start = time.perf_counter()
    try:
        target = load_target(subject.host, subject.registry, mt, impl, workdir / mt.name / "seed0")
    except Exception as err:  # noqa: BLE001 - reported as this check's failure
        return failed(name, _describe_error(err)), None
    summary = target.resolved.summary
    built_by = target.resolved.binding.implementation.provider
    if mt.name not in subject.foreign_types and summary.plugin != subject.name:
        return failed(name, f"resolved to plugin {summary.plugin!r}, not {subject.name!r}"), None
    if built_by is None or built_by.plugin != subject.name:
        return failed(name, f"bound to {summary.implementation!r}, not this plugin's"), None
    n = len(mt.checkpoint_tensors(dict(mt.tiny_config or {})))  # type: ignore[misc]
    return passed(
        name,
        f"{n} tensors -> profile {summary.profile}, implementation {impl.id}, backend "
        f"{summary.backend}, built in {time.perf_counter() - start:.2f} s",
    ), target


def check_implementations(subject: _Subject, targets: Sequence[Target]) -> CheckResult:
    name = "implementations"
    built = {t.implementation.id for t in targets}
    missing = sorted(i.id for i in subject.implementations if i.id not in built)
    if missing:
        return failed(name, f"not built from a tiny checkpoint: {missing}")
    return passed(name, f"every declared implementation built: {', '.join(sorted(built))}")


# --- the runner -----------------------------------------------------------------


def run_conformance(
    name: str,
    *,
    plugin: object | None = None,
    host: PluginHost | None = None,
    workdir: str | Path | None = None,
    collisions: bool = True,
) -> ConformanceReport:
    """Run the whole suite against plugin ``name``; never raises for a failing check.

    ``plugin`` hands the plugin in directly (no installation needed);
    ``host`` supplies an already built host (which must hold ``name``);
    otherwise the installed entry point ``name`` is loaded on its own.
    ``collisions=False`` leaves out the comparison with other installed
    plugins (for a plugin checked before it is installed anywhere).
    """
    # Both check modules build on this one's results and helpers, so they import it.
    from . import _codec_checks, _model_checks

    start = time.perf_counter()
    host = host if host is not None else plugin_host(name, plugin)
    record = host.record(name)
    if record is None or record.status != "loaded":
        installed = [r.name for r in PluginHost(policy=PluginPolicy.none()).records]
        why = (
            f"plugin {name!r} is not installed (installed: {', '.join(installed) or 'none'})"
            if record is None
            else f"plugin {name!r} ({record.distribution} {record.version}) is {record.status}: "
            f"{record.reason}"
        )
        return ConformanceReport(
            name, (failed("hooks", why),), available=False, seconds=time.perf_counter() - start
        )
    if host.registry_error is not None:
        return ConformanceReport(
            name,
            (passed("hooks", "loads"), failed("registrations", host.registry_error.message)),
            seconds=time.perf_counter() - start,
        )
    subject = _Subject.of(name, host, plugin)
    results: list[CheckResult] = []
    with ExitStack() as stack:
        root = (
            Path(workdir)
            if workdir is not None
            else Path(
                stack.enter_context(tempfile.TemporaryDirectory(prefix=f"loom-conformance-{name}-"))
            )
        )
        results += _guard("hooks", lambda: check_hooks(subject))
        results += _guard("registrations", lambda: check_registrations(subject))
        results += _guard(
            "kv-codec-kinds", lambda: _codec_checks.check_kv_codecs(dict(subject.own.cache_kinds))
        )
        if collisions:
            results += _guard("no-collisions", lambda: check_collisions(subject, root))
        targets: list[Target] = []
        pairs = _guard_pairs(subject, results)
        for mt, impl in pairs:
            result, target = _check_construct(subject, mt, impl, root)
            results.append(result)
            if target is not None:
                targets.append(target)
        results += _guard("implementations", lambda: check_implementations(subject, targets))
        # Behaviour checks: once per implementation, on the first model type built with it.
        failed_builds = [
            mt.name for (mt, impl) in pairs if impl.id not in {t.implementation.id for t in targets}
        ]
        seen: set[str] = set()
        for target in targets:
            if target.implementation.id in seen:
                continue
            seen.add(target.implementation.id)
            results += _model_checks.run_all(subject, target)
        for label in sorted(set(failed_builds)):
            results += [
                failed(f"{check}[{label}]", f"cannot run: construct[{label}] failed")
                for check in _model_checks.CHECK_NAMES
            ]
    return ConformanceReport(name, tuple(results), seconds=time.perf_counter() - start)


def _guard_pairs(subject: _Subject, results: list[CheckResult]) -> list[tuple[ModelType, Any]]:
    try:
        return _pairs(subject)
    except Exception as err:  # noqa: BLE001
        results.append(failed("construct", _describe_error(err)))
        return []
