"""Profiles: what an artifact requires in order to be built.

A profile declares *construction* only — which graph, loader and loop, how
specialised, and the capabilities that follow. Request methods (sampling, KV
quantization, batching, speculation) are checked against capabilities when a
request arrives, not here.

Two kinds exist:

* a **family profile** (``specialization="family"``, no fingerprints) claims
  every checkpoint of its model types;
* an **exact-artifact profile** (``specialization="artifact"``, both
  fingerprints) claims one published artifact and may name one
  implementation tuned for it.

An exact-artifact profile that matches wins over the family profile; two
matches are an error, never a coin toss.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ..errors import ProfileError, UnknownModelType

# Capabilities the core understands. Plugins may declare others; the core
# checks these at request time.
GENERATE = "generate"
BATCH = "batch"
PROMPT_CACHE = "prompt-cache"
KV_QUANTIZATION = "kv-quantization"
SPECULATIVE = "speculative"
#: The graph may be wrapped by the core's adapter transform (LoRA/DoRA, see
#: :mod:`mlx_loom.adapters`). A family that omits it refuses ``adapter_path``.
ADAPTERS = "adapters"

# Each loop the core ships, and the capabilities a profile using it must
# declare (the loop cannot run without them).
LOOP_CAPABILITIES: Mapping[str, frozenset[str]] = {
    "autoregressive": frozenset({GENERATE}),
    "continuous-batching": frozenset({GENERATE, BATCH}),
    "speculative": frozenset({GENERATE, SPECULATIVE}),
}


class Execution(BaseModel):
    """How the artifact is built and run."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    graph: str
    loader: str
    loop: str = "autoregressive"
    specialization: Literal["family", "artifact"] = "family"
    implementation: str | None = None


class Profile(BaseModel):
    """One registered profile. ``model_types`` are the config model types it claims."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    model_types: frozenset[str] = Field(default_factory=frozenset)
    execution: Execution
    artifact_fingerprint: str | None = None
    config_fingerprint: str | None = None
    capabilities: frozenset[str] = Field(default_factory=frozenset)
    description: str = ""

    @property
    def is_exact(self) -> bool:
        return self.artifact_fingerprint is not None


def validate_profile(profile: Profile, *, origin: str = "") -> None:
    """Check the rules that need no config. Raises :class:`ProfileError`."""
    where = f" (from {origin})" if origin else ""
    if not profile.id.strip():
        raise ProfileError(
            f"A profile has an empty id{where}.",
            fix="Give every profile a unique, non-empty id.",
        )
    name = f"Profile {profile.id!r}{where}"
    has_a, has_c = profile.artifact_fingerprint is not None, profile.config_fingerprint is not None
    if has_a != has_c:
        missing = "config_fingerprint" if has_a else "artifact_fingerprint"
        raise ProfileError(
            f"{name} sets one fingerprint but not {missing}; fingerprints come as a pair.",
            fix="Set both artifact_fingerprint and config_fingerprint, or neither.",
        )
    ex = profile.execution
    if ex.specialization == "artifact" and not has_a:
        raise ProfileError(
            f"{name} has specialization 'artifact' but no fingerprints to identify the artifact.",
            fix="Add artifact_fingerprint and config_fingerprint, or use specialization 'family'.",
        )
    if ex.specialization == "family" and has_a:
        raise ProfileError(
            f"{name} carries fingerprints but has specialization 'family'.",
            fix="Use specialization 'artifact' for an exact-artifact profile.",
        )
    if ex.implementation is not None and (not has_a or ex.specialization != "artifact"):
        raise ProfileError(
            f"{name} names implementation {ex.implementation!r}, which only an exact-artifact "
            "profile (both fingerprints, specialization 'artifact') may do.",
            fix="Remove execution.implementation, or make the profile exact-artifact.",
        )
    implied = LOOP_CAPABILITIES.get(ex.loop)
    if implied is None:
        raise ProfileError(
            f"{name} uses loop {ex.loop!r}, which the core does not provide "
            f"(known: {', '.join(sorted(LOOP_CAPABILITIES))}).",
            fix="Use one of the core's loops.",
        )
    missing_caps = implied - profile.capabilities
    if missing_caps:
        raise ProfileError(
            f"{name} uses loop {ex.loop!r}, which implies capabilities "
            f"{sorted(implied)}, but the profile does not declare {sorted(missing_caps)}.",
            fix=f"Add {sorted(missing_caps)} to the profile's capabilities.",
        )
    if not profile.model_types:
        raise ProfileError(
            f"{name} claims no model types.",
            fix="List the config model_type values this profile claims.",
        )


def validate_against_config(
    profile: Profile, model_type: str, graph_model_types: Mapping[str, frozenset[str]]
) -> None:
    """Check the rules that need the artifact's config.

    ``graph_model_types`` maps each registered graph id to the model types it accepts.
    """
    validate_profile(profile)
    accepted = graph_model_types.get(profile.execution.graph)
    if accepted is None:
        raise ProfileError(
            f"Profile {profile.id!r} uses graph {profile.execution.graph!r}, which no installed "
            "implementation provides.",
            fix="Install or allow the plugin that provides this graph.",
        )
    if model_type not in accepted:
        raise ProfileError(
            f"Profile {profile.id!r} uses graph {profile.execution.graph!r}, which does not "
            f"accept model_type {model_type!r} (it accepts {sorted(accepted)}).",
            fix="Fix the profile's graph or model_types.",
        )


class ProfileChoice(BaseModel):
    """The outcome of resolution, with the reason shown by ``loom explain``."""

    model_config = ConfigDict(frozen=True)

    profile: Profile
    reason: str


def resolve_profile(
    profiles: Iterable[Profile],
    *,
    model_type: str,
    artifact_fingerprint: str | None,
    config_fingerprint: str | None,
) -> ProfileChoice:
    """Pick exactly one profile: an exact-artifact match, else the family profile."""
    candidates = [p for p in profiles if model_type in p.model_types]
    exact = [
        p
        for p in candidates
        if p.is_exact
        and p.artifact_fingerprint == artifact_fingerprint
        and p.config_fingerprint == config_fingerprint
    ]
    if len(exact) > 1:
        raise ProfileError(
            f"{len(exact)} exact-artifact profiles match this artifact: "
            f"{', '.join(repr(p.id) for p in exact)}.",
            fix="Uninstall or disallow all but one of the plugins registering them.",
        )
    if exact:
        return ProfileChoice(
            profile=exact[0],
            reason="exact-artifact profile: artifact and config fingerprints match",
        )
    family = [p for p in candidates if not p.is_exact]
    if len(family) > 1:
        raise ProfileError(
            f"{len(family)} family profiles claim model_type {model_type!r}: "
            f"{', '.join(repr(p.id) for p in family)}.",
            fix="Allow only one plugin for this model type (see MLX_LOOM_PLUGINS).",
        )
    if not family:
        raise UnknownModelType(
            f"No family profile claims model_type {model_type!r}.",
            fix="Install the family plugin for this model type.",
        )
    note = "family profile for model_type " + repr(model_type)
    if any(p.is_exact for p in candidates):
        note += " (exact-artifact profiles exist but their fingerprints differ)"
    return ProfileChoice(profile=family[0], reason=note)
