"""Profiles: what an artifact requires in order to be built.

A profile declares *construction* only — which graph, loader and loop, how
specialised, and the capabilities that follow. Request methods (sampling, KV
quantization, batching, speculation) are checked against capabilities when a
request arrives, not here.

Kinds, by ``execution.specialization``:

* ``"family"`` — claims every checkpoint of its model types; carries no
  fingerprints; its implementation is the one whose id is the graph id;
* ``"artifact"`` — an **exact-artifact profile**: both fingerprints identify
  one published artifact, and it may name (``implementation=``) one
  implementation tuned for it;
* ``"generated"`` — its implementation is generated for the graph, with id
  ``"<graph>-generated"``; with both fingerprints it is exact-artifact,
  without them it is the family profile of its model types.

An exact-artifact profile that matches wins over the family profile; two
matches are an error, never a coin toss. Which implementation a profile gets
is decided by :meth:`mlx_loom.host.Registry.select` (the selection rule).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictStr, field_validator

from ..backends import Provider
from ..capabilities import BATCH, GENERATE, SPECULATIVE
from ..errors import ProfileError, RegistrationError, UnknownModelType
from ..field_checks import check_id, check_ids

# Each loop the core ships, and the capabilities a profile using it must
# declare (the loop cannot run without them).
LOOP_CAPABILITIES: Mapping[str, frozenset[str]] = {
    "autoregressive": frozenset({GENERATE}),
    "continuous-batching": frozenset({GENERATE, BATCH}),
    "speculative": frozenset({GENERATE, SPECULATIVE}),
}


Specialization = Literal["family", "artifact", "generated"]


def _id(owner: str, name: str, value: str) -> str:
    try:
        return check_id(owner, name, value)
    except RegistrationError as err:
        raise ValueError(err.message) from None


class Execution(BaseModel):
    """How the artifact is built and run."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    graph: StrictStr
    loader: StrictStr
    loop: StrictStr = "autoregressive"
    specialization: Specialization = "family"
    implementation: StrictStr | None = None

    @field_validator("graph", "loader", "loop", "implementation")
    @classmethod
    def _ids(cls, value: str | None, info) -> str | None:
        return None if value is None else _id("Execution", info.field_name, value)

    @property
    def default_implementation(self) -> str:
        """The implementation id this execution selects when it names none."""
        if self.specialization == "generated":
            return f"{self.graph}-generated"
        return self.graph


class Profile(BaseModel):
    """One profile. ``model_types`` are the config model types it claims.

    ``provider`` is set by the plugin host to the plugin that registered it
    (``None`` for a profile the embedding host composed itself); it takes no
    part in comparisons of what the profile says.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    id: StrictStr
    model_types: frozenset[StrictStr] = Field(default_factory=frozenset)
    execution: Execution
    artifact_fingerprint: StrictStr | None = None
    config_fingerprint: StrictStr | None = None
    capabilities: frozenset[StrictStr] = Field(default_factory=frozenset)
    description: StrictStr = ""
    provider: Provider | None = Field(default=None, exclude=True, repr=False)

    @field_validator("id")
    @classmethod
    def _profile_id(cls, value: str) -> str:
        return _id("Profile", "id", value)

    @field_validator("model_types", "capabilities")
    @classmethod
    def _id_sets(cls, value: frozenset[str], info) -> frozenset[str]:
        try:
            return frozenset(check_ids("Profile", info.field_name, value))
        except RegistrationError as err:
            raise ValueError(err.message) from None

    @property
    def is_exact(self) -> bool:
        return self.artifact_fingerprint is not None

    def same_declaration(self, other: Profile) -> bool:
        """True when ``other`` says exactly what this profile says (provider aside)."""
        return self.model_dump() == other.model_dump()


def validate_profile(profile: Profile, *, origin: str = "") -> None:
    """Check the rules that need no config. Raises :class:`ProfileError`."""
    where = f" (from {origin})" if origin else ""
    if not profile.id.strip():  # unreachable through the constructor; a forged instance
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
    # 'generated' may carry both fingerprints (one artifact) or neither (the family).
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
