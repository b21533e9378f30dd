"""The config dialect (``FamilyConfig``): derived defaults filled once, checks that name a field."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from mlx_loom.artifacts import validate_family_config
from mlx_loom.errors import ConfigError
from mlx_loom.plugin import FamilyConfig, FieldError, Given, LayerCount, Size, derived

SOURCE = Path("model/config.json")


class DemoConfig(FamilyConfig):
    hidden_size: Size
    num_hidden_layers: LayerCount
    num_attention_heads: Size
    head_dim: Size = derived()
    layer_kinds: list[str] = derived()
    window: Size | None = None  # an optional field: no bounds metadata of its own

    @classmethod
    def fill(cls, given: Given) -> Mapping[str, Any]:
        hidden, heads, layers = (
            given.get("hidden_size"),
            given.get("num_attention_heads"),
            given.get("num_hidden_layers"),
        )
        out: dict[str, Any] = {}
        if given.get("window") is not None:
            out["head_dim"] = given.get("window")
        elif hidden is not None and heads is not None:
            out["head_dim"] = hidden // heads
        if layers is not None:
            out["layer_kinds"] = ["full"] * layers
        return out

    def check(self) -> None:
        if len(self.layer_kinds) != self.num_hidden_layers:
            raise FieldError("layer_kinds", "needs one entry per layer", fix="list every layer")


GOOD = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}


def validate(**changes: Any) -> DemoConfig:
    return validate_family_config(DemoConfig, GOOD | changes, source=SOURCE)


def message(**changes: Any) -> str:
    with pytest.raises(ConfigError) as err:
        validate(**changes)
    return str(err.value) + "\n" + (err.value.fix or "")


def test_absent_or_null_derived_fields_are_filled_and_given_ones_kept():
    assert validate().head_dim == 16
    assert validate(head_dim=None).head_dim == 16
    assert validate(head_dim=32).head_dim == 32
    assert validate().layer_kinds == ["full", "full"]


def test_an_optional_field_is_read_through_its_own_type():
    assert validate(window=8).head_dim == 8
    assert "window: found 0" in message(window=0)  # not read as a window; reported alone


def test_a_derived_value_is_validated_like_a_given_one():
    # 64 // 128 = 0: the derived head_dim fails its own Size bound.
    assert "head_dim: " in message(num_attention_heads=128)


def test_an_invalid_input_never_sizes_a_derived_value_and_is_reported_alone():
    text = message(num_hidden_layers=10**8)
    assert "num_hidden_layers: found 100000000" in text
    assert "1 invalid field(s)" in text  # no spurious "layer_kinds: missing"


def test_cross_field_check_reads_as_a_type_error_naming_its_field_and_fix():
    text = message(layer_kinds=["full"])
    assert "layer_kinds: found ['full']; needs one entry per layer" in text
    assert "list every layer" in text


def test_unknown_keys_are_ignored_and_the_config_is_frozen():
    cfg = validate(some_field_we_do_not_read=1)
    with pytest.raises(ValueError):
        cfg.hidden_size = 8  # type: ignore[misc]
