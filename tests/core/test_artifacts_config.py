"""Specification of config.json reading and of the family-config validation helper."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict, Field

from mlx_loom.artifacts import ArtifactConfig, QuantSpec, read_config, validate_family_config
from mlx_loom.errors import ConfigError

FLAT = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}

NESTED = {
    "model_type": "gemma4",
    "architectures": ["Gemma4ForConditionalGeneration"],
    "eos_token_id": [1, 106],
    "text_config": {"model_type": "gemma4_text", "hidden_size": 32, "tie_word_embeddings": True},
    "vision_config": {"model_type": "gemma4_vision"},
}


def write_config(model_dir: Path, config: dict | str) -> Path:
    text = config if isinstance(config, str) else json.dumps(config, indent=2)
    (model_dir / "config.json").write_text(text)
    return model_dir


def config_error(model_dir: Path) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        read_config(model_dir)
    assert str(model_dir / "config.json") in str(info.value)
    assert info.value.fix
    return info.value


# --- read_config ---------------------------------------------------------------


def test_flat_config_exposes_the_core_fields(tmp_path):
    config = read_config(write_config(tmp_path, FLAT))
    assert isinstance(config, ArtifactConfig)
    assert config.model_type == "llama" and config.text_model_type == "llama"
    assert config.architectures == ("LlamaForCausalLM",)
    assert config.eos_token_id == 2 and config.eos_token_ids == (2,)
    assert config.tie_word_embeddings is False
    assert config.quantization is None
    assert config.raw == FLAT
    assert config.path == tmp_path / "config.json"


def test_flat_layout_text_config_is_the_whole_config_as_a_copy(tmp_path):
    config = read_config(write_config(tmp_path, FLAT))
    text = config.text_config()
    assert text == FLAT
    text["hidden_size"] = 1
    assert config.text_config()["hidden_size"] == 64


def test_wrapper_layout_exposes_both_model_types_and_the_nested_text_config(tmp_path):
    config = read_config(write_config(tmp_path, NESTED))
    assert config.model_type == "gemma4"
    assert config.text_model_type == "gemma4_text"
    assert config.is_nested
    assert config.text_config() == NESTED["text_config"]
    assert config.eos_token_id == [1, 106]  # as written: an int or a list
    assert config.eos_token_ids == (1, 106)
    assert config.tie_word_embeddings is True  # read from text_config


def test_model_type_comes_from_text_config_when_the_top_level_has_none(tmp_path):
    config = read_config(write_config(tmp_path, {"text_config": {"model_type": "qwen3_5_text"}}))
    assert config.model_type == "qwen3_5_text" == config.text_model_type


def test_fields_a_config_omits_are_none_not_guessed(tmp_path):
    config = read_config(write_config(tmp_path, {"model_type": "llama"}))
    assert config.tie_word_embeddings is None
    assert config.eos_token_id is None and config.eos_token_ids == ()
    assert config.architectures == ()


def test_quantization_is_parsed_into_the_config(tmp_path):
    data = {**FLAT, "quantization": {"group_size": 32, "bits": 4}}
    config = read_config(write_config(tmp_path, data))
    assert config.quantization is not None
    assert config.quantization.for_module("model.layers.0.mlp") == QuantSpec(group_size=32, bits=4)


def test_missing_config_file_is_a_config_error(tmp_path):
    config_error(tmp_path)


def test_malformed_json_names_the_line_and_column(tmp_path):
    write_config(tmp_path, '{\n  "model_type": "llama",\n  "hidden_size": 64,,\n}')
    err = config_error(tmp_path)
    assert "line 3, column 21" in str(err)  # the second comma


def test_a_top_level_that_is_not_an_object_is_rejected(tmp_path):
    write_config(tmp_path, "[1, 2, 3]")
    assert "list, not an object" in str(config_error(tmp_path))


def test_missing_model_type_is_named(tmp_path):
    write_config(tmp_path, {"hidden_size": 8})
    assert "model_type is missing" in str(config_error(tmp_path))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("model_type", 7),
        ("eos_token_id", "2"),
        ("eos_token_id", [1, "x"]),
        ("tie_word_embeddings", "true"),
        ("architectures", "LlamaForCausalLM"),
        ("text_config", [1]),
    ],
)
def test_a_field_of_the_wrong_type_is_named_with_its_value(tmp_path, field, value):
    write_config(tmp_path, {**FLAT, field: value})
    text = str(config_error(tmp_path))
    assert f"\n  {field}" in text
    assert repr(value) in text or repr(value[1]) in text


def test_a_bad_field_inside_text_config_is_named_with_its_path(tmp_path):
    write_config(tmp_path, {"model_type": "gemma4", "text_config": {"eos_token_id": 1.5}})
    assert "text_config.eos_token_id: found 1.5" in str(config_error(tmp_path))


# --- validate_family_config ------------------------------------------------------


class RopeScaling(BaseModel):
    factor: float
    type: str = "linear"


class FamilyConfig(BaseModel):
    hidden_size: int = Field(gt=0)
    num_heads: int
    layer_types: list[str] = []
    rope_scaling: RopeScaling | None = None


class StrictFamilyConfig(FamilyConfig):
    model_config = ConfigDict(extra="forbid")


SOURCE = Path("/models/tiny/config.json")


def test_a_valid_family_config_is_returned_as_the_model():
    cfg = validate_family_config(FamilyConfig, {"hidden_size": 8, "num_heads": 2}, source=SOURCE)
    assert isinstance(cfg, FamilyConfig)
    assert (cfg.hidden_size, cfg.num_heads) == (8, 2)


@pytest.mark.parametrize("schema", [FamilyConfig, StrictFamilyConfig])
def test_unknown_keys_are_ignored_even_by_a_schema_that_forbids_extras(schema):
    data = {"hidden_size": 8, "num_heads": 2, "torch_dtype": "bfloat16", "_name_or_path": "x"}
    cfg = validate_family_config(schema, data, source=SOURCE)
    assert cfg.num_heads == 2


def test_every_bad_field_is_named_by_dotted_path_with_value_and_fix():
    data = {
        "hidden_size": -4,
        "layer_types": ["full", 3],
        "rope_scaling": {"factor": "big"},
    }
    with pytest.raises(ConfigError) as info:
        validate_family_config(FamilyConfig, data, source=SOURCE)
    text = info.value.message
    assert str(SOURCE) in text
    assert "4 invalid field(s) for FamilyConfig" in text
    assert "hidden_size: found -4; Input should be greater than 0" in text
    assert "num_heads: missing" in text
    assert "layer_types.1: found 3" in text
    assert "rope_scaling.factor: found 'big'" in text
    assert str(SOURCE) in info.value.fix


def test_union_errors_collapse_to_the_field_path():
    class WithUnion(BaseModel):
        eos_token_id: int | list[int]

    with pytest.raises(ConfigError) as info:
        validate_family_config(WithUnion, {"eos_token_id": "x"}, source=SOURCE)
    text = info.value.message
    assert "eos_token_id: found 'x'" in text
    assert "eos_token_id.int" not in text


def test_prefix_places_the_field_paths_inside_the_file():
    with pytest.raises(ConfigError, match=r"text_config\.num_heads: missing"):
        validate_family_config(
            FamilyConfig, {"hidden_size": 8}, source=SOURCE, prefix="text_config"
        )
