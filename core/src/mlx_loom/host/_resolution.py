"""How a model reference becomes a binding — without loading any weights.

``resolve`` is what ``loom explain`` prints and what :func:`mlx_loom.load`
builds from. Steps, each of which either succeeds or raises a refusal naming
its cause:

1. the reference becomes a directory (local path or Hugging Face cache);
2. ``config.json`` gives the model type; a plugin must claim it (if the
   plugin that would is quarantined, blocked or not installed, the refusal
   says which and how to fix it);
3. the family's schema validates the config;
4. fingerprints are computed (config: the family's fields; artifact: the
   tensor manifest from the safetensors headers — no tensor data is read);
5. the profile is chosen (exact artifact beats family);
6. the registry re-validates it against the config and both fingerprints,
   selects its implementation by id (the selection rule in
   :mod:`mlx_loom.host._registry`) and resolves each kernel it needs for this
   device (or the host's pinned backend);
7. the compute dtype and, on the CPU, the kernel set for the model's matrix
   products are chosen (:mod:`mlx_loom.cpu`).
"""

from __future__ import annotations

import functools
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from ..artifacts import (
    ArtifactConfig,
    artifact_fingerprint,
    config_fingerprint,
    read_config,
    read_manifest,
    resolve_model_ref,
    validate_family_config,
)
from ..backends import Backend
from ..cpu.path import CpuPath, resolve_cpu_path
from ..errors import PluginUnavailable, UnknownModelType
from ._advice import allow_plugin_fix, install_command, quarantine_fix
from ._discovery import PluginHost, PluginRecord
from ._policy import POLICY_ENV, PluginPolicy
from ._profiles import resolve_profile
from ._registry import Binding, ModelType, Registry

# Where the project's own families live, so a refusal can name the package to
# install. This is a hint table only: it never loads anything, and third-party
# plugins claim model types without appearing here.
KNOWN_FAMILIES: dict[str, tuple[str, str]] = {
    "llama": ("minicpm5", "mlx-loom-minicpm5"),
    "qwen3_next": ("qwen3_next", "mlx-loom-qwen3-next"),
    "qwen3_5": ("qwen3_next", "mlx-loom-qwen3-next"),
    "qwen3_5_text": ("qwen3_next", "mlx-loom-qwen3-next"),
    "gemma4": ("gemma4", "mlx-loom-gemma4"),
    "gemma4_text": ("gemma4", "mlx-loom-gemma4"),
}


class KernelChoice(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    backend: str
    registered_backends: tuple[str, ...]


class Resolution(BaseModel):
    """The full answer to "what would run for this model, and why"."""

    model_config = ConfigDict(frozen=True)

    model_ref: str
    model_dir: str
    model_type: str
    plugin: str | None
    profile: str
    profile_reason: str
    implementation: str
    graph: str
    loader: str
    loop: str
    backend: str
    kernels: tuple[KernelChoice, ...]
    capabilities: tuple[str, ...]
    cpu: CpuPath
    config_fingerprint: str
    artifact_fingerprint: str


@dataclass(frozen=True)
class Resolved:
    """A resolution plus what loading needs next."""

    summary: Resolution
    binding: Binding
    config: ArtifactConfig
    family_config: BaseModel
    model_type: ModelType
    model_dir: Path


@dataclass(frozen=True)
class Identity:
    """What an artifact is, before any profile is chosen: its directory, config,
    validated family config, model type and both fingerprints."""

    model_dir: Path
    config: ArtifactConfig
    family_config: BaseModel
    model_type: ModelType
    config_fingerprint: str
    artifact_fingerprint: str


def identify(model_ref: str | Path, *, host: PluginHost, registry: Registry) -> Identity:
    """Steps 1–4: directory, config, claiming model type, schema, fingerprints."""
    model_dir = resolve_model_ref(model_ref)
    config = read_config(model_dir)
    name = config.model_type
    if name not in registry.model_types:
        raise _unclaimed(name, host, registry)
    claim = registry.model_type(name)
    text = config.text_config()
    family_config = validate_family_config(
        claim.schema,
        text,
        source=model_dir / "config.json",
        prefix="text_config" if config.is_nested else None,
    )
    config_fp = config_fingerprint({f: text.get(f) for f in claim.fingerprint_fields})
    artifact_fp = artifact_fingerprint(read_manifest(model_dir))
    return Identity(model_dir, config, family_config, claim, config_fp, artifact_fp)


def resolve(
    model_ref: str | Path,
    *,
    host: PluginHost,
    registry: Registry | None = None,
    compute_dtype: str | None = None,
    cpu_kernels: str | None = None,
) -> Resolved:
    """Resolve ``model_ref`` against the host's (or the given composed) registry.

    ``compute_dtype`` and ``cpu_kernels`` are this run's requests for the CPU
    compute path (:mod:`mlx_loom.cpu`); the host's pins win, and a request
    that contradicts one is refused.
    """
    registry = registry if registry is not None else host.registry
    ident = identify(model_ref, host=host, registry=registry)
    model_dir, config, family_config, claim = (
        ident.model_dir,
        ident.config,
        ident.family_config,
        ident.model_type,
    )
    name, config_fp, artifact_fp = claim.name, ident.config_fingerprint, ident.artifact_fingerprint
    choice = resolve_profile(
        registry.profiles,
        model_type=name,
        artifact_fingerprint=artifact_fp,
        config_fingerprint=config_fp,
    )
    binding = registry.select(
        name, choice.profile, config_fingerprint=config_fp, artifact_fingerprint=artifact_fp
    )
    cpu = resolve_cpu_path(
        binding.backend,
        compute_dtype=compute_dtype,
        cpu_kernels=cpu_kernels,
        host_compute_dtype=registry.compute_dtype,
        host_cpu_kernels=registry.cpu_kernels,
    )
    impl = binding.implementation
    summary = Resolution(
        model_ref=str(model_ref),
        model_dir=str(model_dir),
        model_type=name,
        plugin=claim.provider.plugin if claim.provider else None,
        profile=choice.profile.id,
        profile_reason=choice.reason,
        implementation=impl.id,
        graph=impl.graph,
        loader=impl.loader,
        loop=impl.loop,
        backend=binding.backend,
        kernels=tuple(
            KernelChoice(
                name=k, backend=kern.backend, registered_backends=registry.kernels.backends_for(k)
            )
            for k, kern in binding.kernels.items()
        ),
        capabilities=tuple(sorted(impl.capabilities & choice.profile.capabilities)),
        cpu=cpu,
        config_fingerprint=config_fp,
        artifact_fingerprint=artifact_fp,
    )
    return Resolved(summary, binding, config, family_config, claim, model_dir)


def _unclaimed(name: str, host: PluginHost, registry: Registry) -> Exception:
    claimed = ", ".join(sorted(registry.model_types)) or "none"
    known = KNOWN_FAMILIES.get(name)
    if known is not None:
        plugin, dist = known
        record = host.record(plugin) or host.by_distribution(dist)
        if record is not None and record.status != "loaded":
            return _unavailable(name, record, host)
        if record is None:
            return UnknownModelType(
                f"model_type {name!r} needs the {plugin!r} family plugin, which is not "
                f"installed (model types claimed here: {claimed}).",
                fix=install_command(plugin, dist),
            )
    suspects = [r for r in host.unavailable]
    if suspects:
        listed = "; ".join(f"{r.name} ({r.distribution} {r.version}): {r.reason}" for r in suspects)
        return UnknownModelType(
            f"No loaded plugin claims model_type {name!r} (claimed: {claimed}). Plugins not "
            f"loaded, any of which might: {listed}.",
            fix="Fix or allow those plugins (see `loom plugins`), or install a plugin for "
            "this model type.",
        )
    return UnknownModelType(
        f"No installed plugin claims model_type {name!r} (claimed: {claimed}).",
        fix="Install a plugin for this model type; `loom plugins` lists what is installed.",
    )


def _unavailable(name: str, record: PluginRecord, host: PluginHost) -> PluginUnavailable:
    who = f"plugin {record.name!r} ({record.distribution} {record.version})"
    if record.status == "blocked":
        return PluginUnavailable(
            f"model_type {name!r} is claimed by {who}, which is {record.reason}.",
            fix=allow_plugin_fix(record.name, host.policy),
        )
    return PluginUnavailable(
        f"model_type {name!r} is claimed by {who}, which is quarantined: {record.reason}.",
        fix=quarantine_fix(record, host),
    )


#: The default plugin host is the one documented piece of process-wide state: a
#: snapshot of the installed plugins under the policy in ``MLX_LOOM_PLUGINS``,
#: built on first use. Hosts that need another composition pass their own
#: ``host`` (or a ``registry`` composed with :meth:`Registry.with_`) and never
#: touch the default.
_DEFAULT_HOST_LOCK = threading.Lock()


@functools.lru_cache(maxsize=4)
def _default_host(policy_env: str | None) -> PluginHost:
    del policy_env  # part of the cache key: a changed policy gets a fresh snapshot
    return PluginHost()


def default_host() -> PluginHost:
    """The process-wide plugin snapshot for the current ``MLX_LOOM_PLUGINS``.

    Built once per policy value; threads that ask at the same time share one.
    """
    with _DEFAULT_HOST_LOCK:
        return _default_host(os.environ.get(POLICY_ENV))


def make_host(policy: PluginPolicy | None) -> PluginHost:
    return default_host() if policy is None else PluginHost(policy=policy)


def resolve_model(
    model_ref: str | Path,
    *,
    policy: PluginPolicy | None = None,
    host: PluginHost | None = None,
    registry: Registry | None = None,
    kernel_backend: Backend | None = None,
    compute_dtype: str | None = None,
    cpu_kernels: str | None = None,
) -> Resolved:
    """Resolve without loading weights (what ``loom explain`` shows)."""
    host = host if host is not None else make_host(policy)
    registry = registry if registry is not None else host.registry
    if kernel_backend is not None:
        registry = registry.with_(kernel_backend=kernel_backend)
    return resolve(
        model_ref,
        host=host,
        registry=registry,
        compute_dtype=compute_dtype,
        cpu_kernels=cpu_kernels,
    )
