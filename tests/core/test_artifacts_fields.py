"""Bounded config fields and FieldError: one ConfigError naming the field, from one helper."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel, model_validator

from mlx_loom.artifacts import validate_family_config
from mlx_loom.errors import ConfigError
from mlx_loom.plugin import (
    Count,
    FieldError,
    FiniteFloat,
    Flag,
    LayerCount,
    PositiveFloat,
    Size,
    UnitFloat,
)

SOURCE = Path("model/config.json")


class Schema(BaseModel):
    hidden_size: Size = 64
    num_experts: Count = 0
    num_hidden_layers: LayerCount = 2
    rope_theta: PositiveFloat = 10000.0
    softcap: FiniteFloat | None = None
    partial_rotary_factor: UnitFloat = 1.0
    tie_word_embeddings: Flag = False
    num_key_value_heads: Size | None = None

    @model_validator(mode="after")
    def _heads(self) -> Schema:
        if self.num_key_value_heads is not None and self.hidden_size % self.num_key_value_heads:
            raise FieldError(
                "num_key_value_heads",
                f"does not divide hidden_size = {self.hidden_size}",
                fix="use a divisor of hidden_size",
            )
        if self.num_experts == 1:
            raise FieldError("num_key_value_heads", "is needed with one expert")
        return self


def error(**data) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        validate_family_config(Schema, data, source=SOURCE)
    return info.value


def test_a_valid_config_passes_with_ints_accepted_for_floats():
    cfg = validate_family_config(Schema, {"rope_theta": 500000}, source=SOURCE)
    assert cfg.rope_theta == 500000.0


@pytest.mark.parametrize("value", [2**31, 2**40, -1, 0])
def test_sizes_must_be_positive_and_fit_in_int32(value):
    assert f"hidden_size: found {value}" in error(hidden_size=value).message


@pytest.mark.parametrize("value", [True, "64", 64.0])
def test_sizes_must_be_json_integers(value):
    assert f"hidden_size: found {value!r}" in error(hidden_size=value).message


def test_layer_counts_are_bounded_far_past_published_models():
    message = error(num_hidden_layers=100000).message
    assert "num_hidden_layers: found 100000" in message and "65536" in message


@pytest.mark.parametrize("field", ["rope_theta", "softcap"])
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_floats_must_be_finite(field, value):
    assert f"{field}: found {value}" in error(**{field: value}).message


def test_unit_floats_stay_in_zero_to_one():
    assert "partial_rotary_factor: found 1.5" in error(partial_rotary_factor=1.5).message


def test_flags_must_be_json_booleans():
    assert "tie_word_embeddings: found 1" in error(tie_word_embeddings=1).message


def test_a_field_error_names_its_field_value_and_fix():
    err = error(hidden_size=64, num_key_value_heads=3)
    assert "num_key_value_heads: found 3; does not divide hidden_size = 64" in err.message
    assert err.fix.startswith("use a divisor of hidden_size")


def test_a_field_error_about_an_absent_field_says_it_is_not_set():
    assert "num_key_value_heads: not set (its default applies)" in error(num_experts=1).message


def test_a_nested_prefix_places_the_field_in_the_file():
    with pytest.raises(ConfigError, match="text_config.num_key_value_heads: found 3"):
        validate_family_config(
            Schema, {"num_key_value_heads": 3}, source=SOURCE, prefix="text_config"
        )
