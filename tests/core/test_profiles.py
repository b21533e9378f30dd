"""Profile validation and resolution rules, one test per rule."""

import pytest
from pydantic import ValidationError

from mlx_loom.errors import ProfileError, UnknownModelType
from mlx_loom.host._profiles import (
    Execution,
    Profile,
    resolve_profile,
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


@pytest.mark.parametrize("bad", ["", "  ", "fam/ llama", "fam/llama\n", 123, None])
def test_a_blank_whitespace_or_non_string_profile_id_is_refused_on_construction(bad):
    with pytest.raises(ValidationError, match="id"):
        profile(id=bad)


@pytest.mark.parametrize("field", ["graph", "loader", "loop", "implementation"])
@pytest.mark.parametrize("bad", ["", " ", "a b", 7])
def test_blank_or_non_string_execution_ids_are_refused_on_construction(field, bad):
    fields = {"graph": "llama", "loader": "hf", field: bad}
    with pytest.raises(ValidationError, match=field):
        Execution(**fields)


def test_blank_model_type_names_in_a_profile_are_refused():
    with pytest.raises(ValidationError, match="model_types"):
        profile(model_types=frozenset({"llama", " "}))


def test_a_family_execution_selects_the_implementation_named_like_its_graph():
    assert Execution(graph="fam.llama", loader="hf").default_implementation == "fam.llama"


def test_a_generated_execution_selects_the_graph_generated_implementation():
    ex = Execution(graph="fam.llama", loader="hf", specialization="generated")
    assert ex.default_implementation == "fam.llama-generated"


def test_a_generated_profile_may_be_family_wide_or_exact():
    generated = Execution(graph="llama", loader="hf", specialization="generated")
    validate_profile(profile(execution=generated))
    validate_profile(exact().model_copy(update={"execution": generated}))


def test_a_generated_profile_may_not_name_an_implementation():
    named = Execution(
        graph="llama", loader="hf", specialization="generated", implementation="fam.fast"
    )
    with pytest.raises(ProfileError, match="only an exact-artifact profile"):
        validate_profile(exact().model_copy(update={"execution": named}))


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
