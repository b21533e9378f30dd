"""Profile validation and resolution rules, one test per rule."""

import pytest

from mlx_loom.errors import ProfileError, UnknownModelType
from mlx_loom.host._profiles import (
    Execution,
    Profile,
    resolve_profile,
    validate_against_config,
    validate_profile,
)

FP_A, FP_C = "sha256:aaa", "sha256:ccc"


def profile(**changes) -> Profile:
    fields = dict(
        id="fam/llama",
        model_types=frozenset({"llama"}),
        execution=Execution(graph="llama", loader="hf"),
        capabilities=frozenset({"generate"}),
    )
    fields.update(changes)
    return Profile(**fields)


def exact(id="fam/exact", a=FP_A, c=FP_C, **execution) -> Profile:
    return profile(
        id=id,
        artifact_fingerprint=a,
        config_fingerprint=c,
        execution=Execution(graph="llama", loader="hf", specialization="artifact", **execution),
    )


def test_a_valid_family_profile_passes():
    validate_profile(profile())


def test_empty_id_is_rejected():
    with pytest.raises(ProfileError, match="empty id"):
        validate_profile(profile(id="  "))


@pytest.mark.parametrize("which", ["artifact_fingerprint", "config_fingerprint"])
def test_one_fingerprint_without_the_other_is_rejected(which):
    bad = exact().model_copy(update={which: None})
    with pytest.raises(ProfileError, match="fingerprints come as a pair"):
        validate_profile(bad)


def test_named_implementation_without_exact_artifact_is_rejected():
    bad = profile(execution=Execution(graph="llama", loader="hf", implementation="fam.fast"))
    with pytest.raises(ProfileError, match="only an exact-artifact profile"):
        validate_profile(bad)


def test_named_implementation_without_artifact_specialization_is_rejected():
    bad = exact().model_copy(
        update={"execution": Execution(graph="llama", loader="hf", implementation="fam.fast")}
    )
    with pytest.raises(ProfileError, match="specialization 'family'"):
        validate_profile(bad)


def test_named_implementation_on_exact_artifact_profile_is_valid():
    validate_profile(exact(implementation="fam.fast"))


def test_capabilities_implied_by_the_loop_must_be_declared():
    bad = profile(
        execution=Execution(graph="llama", loader="hf", loop="continuous-batching"),
        capabilities=frozenset({"generate"}),
    )
    with pytest.raises(ProfileError, match=r"does not declare \['batch'\]"):
        validate_profile(bad)


def test_unknown_loop_is_rejected():
    bad = profile(execution=Execution(graph="llama", loader="hf", loop="teleport"))
    with pytest.raises(ProfileError, match="loop 'teleport'"):
        validate_profile(bad)


def test_graph_that_does_not_accept_the_model_type_is_rejected():
    with pytest.raises(ProfileError, match="does not accept model_type 'gemma4'"):
        validate_against_config(profile(), "gemma4", {"llama": frozenset({"llama"})})


def test_graph_that_nobody_provides_is_rejected():
    with pytest.raises(ProfileError, match="no installed implementation provides"):
        validate_against_config(profile(), "llama", {})


def test_exact_artifact_profile_wins_over_family_profile():
    choice = resolve_profile(
        [profile(), exact()], model_type="llama", artifact_fingerprint=FP_A, config_fingerprint=FP_C
    )
    assert choice.profile.id == "fam/exact"
    assert "fingerprints match" in choice.reason


def test_family_profile_is_chosen_when_fingerprints_differ():
    choice = resolve_profile(
        [profile(), exact()],
        model_type="llama",
        artifact_fingerprint="sha256:x",
        config_fingerprint=FP_C,
    )
    assert choice.profile.id == "fam/llama"
    assert "fingerprints differ" in choice.reason


def test_two_exact_matches_are_an_error():
    with pytest.raises(ProfileError, match="2 exact-artifact profiles match"):
        resolve_profile(
            [exact("a"), exact("b")],
            model_type="llama",
            artifact_fingerprint=FP_A,
            config_fingerprint=FP_C,
        )


def test_two_family_profiles_for_one_model_type_are_an_error():
    with pytest.raises(ProfileError, match="2 family profiles claim model_type 'llama'"):
        resolve_profile(
            [profile(id="a"), profile(id="b")],
            model_type="llama",
            artifact_fingerprint=None,
            config_fingerprint=None,
        )


def test_no_profile_for_the_model_type_is_unknown_model_type():
    with pytest.raises(UnknownModelType, match="'mamba'"):
        resolve_profile(
            [profile()], model_type="mamba", artifact_fingerprint=None, config_fingerprint=None
        )
