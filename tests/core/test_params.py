"""SamplingParams: defaults, validation, and what a bad request is told."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from mlx_loom.engine.params import MAX_LOGPROBS, SamplingParams
from mlx_loom.errors import RequestError


def _error(**options) -> RequestError:
    with pytest.raises(RequestError) as info:
        SamplingParams.parse(**options)
    return info.value


# --- defaults and accepted values ------------------------------------------


def test_defaults_mean_greedy_with_no_filters_or_penalties():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.0, 1.0, 0, 0.0)
    assert p.min_tokens_to_keep == 1
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (None, None, None)
    assert p.penalty_context_size == 20
    assert (p.logit_bias, p.seed, p.logprobs) == (None, None, 0)
    assert p.greedy


def test_positive_temperature_is_not_greedy():
    assert not SamplingParams.parse(temperature=0.7).greedy


def test_params_are_frozen():
    p = SamplingParams.parse(temperature=0.5)
    with pytest.raises(ValidationError):
        p.temperature = 1.0  # type: ignore[misc]


def test_parse_treats_null_as_not_given():
    p = SamplingParams.parse(temperature=None, top_p=None, seed=None, logit_bias=None)
    assert p == SamplingParams()


def test_boundary_values_are_accepted():
    p = SamplingParams.parse(
        top_p=1.0,
        min_p=1.0,
        top_k=0,
        logprobs=MAX_LOGPROBS,
        penalty_context_size=1,
        seed=2**64 - 1,
        presence_penalty=-1.5,
        frequency_penalty=-0.5,
        repetition_penalty=0.5,
    )
    assert p.min_p == 1.0 and p.logprobs == 20 and p.seed == 2**64 - 1


def test_logit_bias_string_keys_from_json_become_token_ids():
    p = SamplingParams.parse(logit_bias={"7": -100, "3": 2.5})
    assert p.logit_bias == {7: -100.0, 3: 2.5}


# --- every out-of-range parameter is a RequestError --------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", float("inf")),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_p", -0.5),
        ("top_k", -1),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("min_tokens_to_keep", 0),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.2),
        ("presence_penalty", float("nan")),
        ("frequency_penalty", float("inf")),
        ("penalty_context_size", -1),
        ("penalty_context_size", 0),
        ("seed", -1),
        ("seed", 2**64),
        ("logprobs", MAX_LOGPROBS + 1),
        ("logprobs", -1),
    ],
)
def test_out_of_range_value_is_a_request_error_naming_field_value_range_and_fix(field, value):
    err = _error(**{field: value})
    assert f"{field}={value!r}" in err.message
    assert "Valid:" in err.message
    assert err.fix and field in err.fix
    assert "Fix:" in str(err)


def test_request_error_is_not_a_pydantic_error():
    err = _error(top_p=2.0)
    assert not isinstance(err, ValidationError)
    assert isinstance(err, ValueError)  # RequestError is a ValueError for API callers


def test_constructor_raises_request_error_too():
    with pytest.raises(RequestError, match="temperature"):
        SamplingParams(temperature=-1.0)


def test_temperature_message_states_range_and_greedy_fix():
    err = _error(temperature=-0.5)
    assert "temperature=-0.5" in err.message
    assert ">= 0" in err.message
    assert "temperature=0" in err.fix


def test_top_p_message_states_half_open_interval():
    err = _error(top_p=0.0)
    assert "(0, 1]" in err.message
    assert "top_p=1.0" in err.fix


def test_logprobs_message_states_limit():
    err = _error(logprobs=21)
    assert "[0, 20]" in err.message


def test_wrongly_typed_value_names_field_and_value():
    err = _error(top_k="many")
    assert "top_k='many'" in err.message
    assert "valid integer" in err.message


def test_fractional_top_k_is_refused():
    assert "top_k=2.5" in _error(top_k=2.5).message


def test_boolean_is_refused_where_a_number_is_expected():
    assert "top_k=True" in _error(top_k=True).message


# --- logit_bias --------------------------------------------------------------


def test_negative_logit_bias_token_is_refused():
    err = _error(logit_bias={-3: 1.0})
    assert "logit_bias" in err.message and "-3" in err.message
    assert "logit_bias" in err.fix


def test_non_integer_logit_bias_key_is_refused():
    err = _error(logit_bias={"hello": 1.0})
    assert "logit_bias key 'hello'" in err.message


def test_non_numeric_logit_bias_value_names_the_entry():
    assert "logit_bias[3]='lots'" in _error(logit_bias={3: "lots"}).message


def test_non_finite_logit_bias_value_is_refused():
    err = _error(logit_bias={5: float("-inf")})
    assert "logit_bias" in err.message and "not finite" in err.message


def test_logit_bias_must_be_a_mapping():
    assert "logit_bias=[1, 2]" in _error(logit_bias=[1, 2]).message


def test_validate_logit_bias_accepts_ids_inside_the_vocabulary():
    SamplingParams.parse(logit_bias={0: 1.0, 99: -1.0}).validate_logit_bias(100)


def test_validate_logit_bias_refuses_ids_outside_the_vocabulary():
    params = SamplingParams.parse(logit_bias={5: 1.0, 100: -1.0, 250: 2.0})
    with pytest.raises(RequestError) as info:
        params.validate_logit_bias(100)
    assert "100, 250" in info.value.message
    assert "0..99" in info.value.message
    assert "logit_bias" in info.value.fix


def test_validate_logit_bias_without_bias_is_a_no_op():
    SamplingParams().validate_logit_bias(1)


# --- unknown options ------------------------------------------------------------


def test_misspelt_option_names_the_closest_valid_option():
    err = _error(top_pp=0.9)
    assert "'top_pp'" in err.message and "'top_p'" in err.message
    assert err.fix == "rename 'top_pp' to 'top_p'"


def test_mlx_lm_temp_name_points_to_temperature():
    err = _error(temp=0.7)
    assert "did you mean 'temperature'" in err.message


def test_openai_top_logprobs_name_points_to_logprobs():
    assert "did you mean 'logprobs'" in _error(top_logprobs=5).message


def test_per_penalty_context_size_points_to_shared_context_size():
    assert "'penalty_context_size'" in _error(repetition_context_size=64).message


def test_transformers_max_new_tokens_name_points_to_max_tokens():
    err = _error(max_new_tokens=64)
    assert "did you mean 'max_tokens'" in err.message
    assert err.fix == "rename 'max_new_tokens' to 'max_tokens'"


def test_unrelated_unknown_option_lists_valid_options():
    err = _error(beam_width=4)
    assert "did you mean" not in err.message
    assert "temperature" in err.message and "logprobs" in err.message
    assert "beam_width" in err.fix
