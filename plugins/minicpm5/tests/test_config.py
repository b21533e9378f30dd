"""The config schema: defaults a checkpoint may omit, and what fails at load."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from minicpm5_testkit import TINY

from mlx_loom.artifacts import validate_family_config
from mlx_loom.errors import ConfigError
from mlx_loom.nn import Llama3Scaling, LongRopeScaling, YarnScaling
from mlx_loom_minicpm5.config import MiniCPM5Config

SOURCE = Path("model/config.json")


def validate(**changes):
    data = copy.deepcopy(TINY) | changes
    data = {k: v for k, v in data.items() if v is not None}
    return validate_family_config(MiniCPM5Config, data, source=SOURCE)


def config_error(**changes) -> str:
    with pytest.raises(ConfigError) as err:
        validate(**changes)
    return str(err.value)


def test_omitted_fields_get_hugging_face_defaults():
    cfg = validate(
        num_key_value_heads=None,
        head_dim=None,
        rms_norm_eps=None,
        rope_theta=None,
        attention_bias=None,
        tie_word_embeddings=None,
    )
    assert cfg.num_key_value_heads == 4
    assert cfg.head_dim == 16
    assert cfg.rms_norm_eps == 1e-6 and cfg.rope_theta == 10000.0
    assert cfg.attention_bias is False and cfg.tie_word_embeddings is False
    assert cfg.layer_types == ["full_attention", "full_attention"]


def test_explicit_head_dim_need_not_be_hidden_over_heads():
    assert validate(head_dim=32).head_dim == 32


def test_heads_not_dividing_hidden_without_head_dim_names_head_dim():
    message = config_error(num_attention_heads=3, num_key_value_heads=1, head_dim=None)
    assert "head_dim" in message and "hidden_size = 64" in message


def test_kv_heads_not_dividing_heads_names_num_key_value_heads():
    message = config_error(num_key_value_heads=3)
    assert "num_key_value_heads: found 3" in message


def test_odd_head_dim_is_refused():
    assert "head_dim: found 15" in config_error(head_dim=15)


def test_non_positive_sizes_are_refused():
    assert "hidden_size: found 0" in config_error(hidden_size=0)


@pytest.mark.parametrize(
    "scaling,expected",
    [
        ({"rope_type": "llama3", "factor": 8.0}, Llama3Scaling),
        ({"type": "yarn", "factor": 4.0}, YarnScaling),
        (
            {
                "rope_type": "longrope",
                "original_max_position_embeddings": 8,
                "short_factor": [1.0] * 16,
                "long_factor": [2.0] * 16,
            },
            LongRopeScaling,
        ),
    ],
)
def test_rope_scaling_is_parsed_by_its_type(scaling, expected):
    assert isinstance(validate(rope_scaling=scaling).rope_scaling, expected)


def test_default_rope_type_means_no_scaling():
    assert validate(rope_scaling={"rope_type": "default"}).rope_scaling is None


def test_unsupported_rope_type_is_a_config_error_naming_it():
    message = config_error(rope_scaling={"rope_type": "mrope", "mrope_section": [1, 1, 1]})
    assert "rope_scaling" in message and "'mrope'" in message


def test_dynamic_rope_needs_max_position_embeddings():
    message = config_error(
        rope_scaling={"type": "dynamic", "factor": 2.0}, max_position_embeddings=None
    )
    assert "max_position_embeddings" in message


def test_longrope_factors_must_cover_half_the_head_dim():
    message = config_error(
        rope_scaling={
            "rope_type": "longrope",
            "original_max_position_embeddings": 8,
            "long_factor": [1.0] * 3,
        }
    )
    assert "long_factor has 3 entries" in message


def test_layer_types_must_list_every_layer():
    assert "layer_types" in config_error(layer_types=["full_attention"])


def test_sliding_layers_need_a_window():
    message = config_error(layer_types=["sliding_attention", "full_attention"])
    assert "sliding_window" in message


def test_unknown_layer_kind_is_refused():
    assert "layer_types" in config_error(layer_types=["linear_attention", "full_attention"])
