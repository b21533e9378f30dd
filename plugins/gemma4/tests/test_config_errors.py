"""Config and weight errors surface at load, naming the field or tensor and the fix."""

from __future__ import annotations

import json

import pytest

from mlx_loom.errors import ConfigError, WeightsError
from mlx_loom_gemma4.config import Gemma4TextConfig


def _load_error(kit, tmp_path, error=ConfigError, drop=(), **overrides):
    """A valid checkpoint whose config.json is then replaced by the bad one."""
    path = kit.write_checkpoint(tmp_path / "bad", kit.tiny_config(**kit.PER_LAYER), drop=drop)
    (path / "config.json").write_text(json.dumps(kit.tiny_config(**kit.PER_LAYER, **overrides)))
    with pytest.raises(error) as info:
        kit.load_ours(path)
    return str(info.value)


def test_shared_layer_count_not_below_layer_count_is_refused(kit, tmp_path):
    msg = _load_error(kit, tmp_path, num_kv_shared_layers=5)
    assert "num_kv_shared_layers" in msg and "smaller than num_hidden_layers=5" in msg
    assert "Fix:" in msg


def test_layer_types_of_the_wrong_length_is_refused(kit, tmp_path):
    msg = _load_error(kit, tmp_path, layer_types=[kit.S, kit.F])
    assert "layer_types" in msg and "2 entries but num_hidden_layers=5" in msg


def test_unknown_layer_kind_is_refused(kit, tmp_path):
    msg = _load_error(kit, tmp_path, layer_types=[kit.S, "local_attention", kit.F, kit.S, kit.F])
    assert "layer_types" in msg and "local_attention" in msg


def test_shared_layers_of_a_kind_no_earlier_layer_has_are_refused():
    with pytest.raises(ValueError, match="no\\s+earlier layer has"):
        Gemma4TextConfig(
            num_hidden_layers=3,
            layer_types=["sliding_attention"] * 2 + ["full_attention"],
            num_kv_shared_layers=1,
            head_dim=32,
            global_head_dim=64,
        )


def test_partial_rotary_factor_giving_an_odd_rotary_dim_is_refused(kit, tmp_path):
    rope = {
        kit.F: {"rope_type": "proportional", "partial_rotary_factor": 0.3, "rope_theta": 1e6},
        kit.S: {"rope_type": "default", "rope_theta": 1e4},
    }
    msg = _load_error(kit, tmp_path, rope_parameters=rope)
    assert "rope_parameters" in msg and "global_head_dim=64" in msg and "19 rotated dims" in msg


def test_partial_factor_on_default_rope_is_refused_as_ambiguous():
    with pytest.raises(ValueError, match="only 'proportional' RoPE rotates part"):
        Gemma4TextConfig(
            head_dim=32,
            global_head_dim=64,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "partial_rotary_factor": 0.5}
            },
        )


def test_missing_per_layer_input_tensors_are_named(kit, tmp_path):
    drop = ("model.embed_tokens_per_layer.weight", "model.layers.2.per_layer_input_gate.weight")
    msg = _load_error(kit, tmp_path, WeightsError, drop=drop)
    assert "missing (2)" in msg
    assert all(name in msg for name in drop)


def test_moe_without_expert_counts_is_refused():
    with pytest.raises(ValueError, match="num_experts"):
        Gemma4TextConfig(head_dim=32, global_head_dim=64, enable_moe_block=True)


def test_num_kv_shared_layers_defaults_to_zero_unlike_mlx_lm():
    """Decision (see docs/families/gemma4.md): transformers' default, not mlx-lm's 20."""
    from mlx_lm.models.gemma4_text import ModelArgs

    assert Gemma4TextConfig(num_hidden_layers=4).num_kv_shared_layers == 0
    assert ModelArgs().num_kv_shared_layers == 20
