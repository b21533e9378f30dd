"""Loading: bad configs and incomplete checkpoints are refused by name; spellings agree."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from qwen3_testkit import PROMPT, write_checkpoint

from mlx_loom.plugin import ConfigError, WeightsError
from mlx_loom.testing.parity import load_ours


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize(
    "model_type,changes,field",
    [
        ("qwen3", {"head_dim": None}, "head_dim"),
        ("qwen3", {"num_key_value_heads": 3}, "num_key_value_heads"),
        ("qwen3", {"use_sliding_window": True, "sliding_window": 8}, "use_sliding_window"),
        ("qwen3_moe", {"num_experts_per_tok": 5}, "num_experts_per_tok"),
        ("qwen3_moe", {"mlp_only_layers": [0, 3]}, "mlp_only_layers"),
        ("qwen3_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ],
)
def test_a_bad_config_is_refused_naming_the_field(tmp_path, model_type, changes, field):
    path = _edit_config(write_checkpoint(tmp_path / "c", model_type), **changes)
    with pytest.raises(ConfigError, match=field):
        load_ours(path)


def test_a_missing_expert_is_refused_naming_the_projection(tmp_path):
    path = write_checkpoint(tmp_path / "c", "qwen3_moe", "hf")
    tensors = mx.load(str(path / "model.safetensors"))
    del tensors["model.layers.2.mlp.experts.3.up_proj.weight"]
    mx.save_safetensors(str(path / "model.safetensors"), tensors, {"format": "pt"})
    with pytest.raises(WeightsError, match=r"model\.layers\.2\.mlp\.experts\.\*\.up_proj"):
        load_ours(path)


def test_nested_rope_parameters_read_as_the_flat_fields(tmp_path):
    # transformers >= 5 writes rope_theta (and any scaling) under rope_parameters.
    flat = write_checkpoint(tmp_path / "flat", "qwen3", rope_theta=5000.0)
    nested = _edit_config(
        write_checkpoint(tmp_path / "nested", "qwen3"),
        rope_theta=None,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
    )
    x = mx.array([PROMPT])
    a, b = load_ours(flat)(x), load_ours(nested)(x)
    assert mx.array_equal(a, b).item()
    default_theta = load_ours(_edit_config(nested, rope_parameters=None))(x)
    assert not mx.array_equal(a, default_theta).item()  # the nested base was read


def test_no_experts_makes_every_layer_dense(tmp_path):
    path = write_checkpoint(tmp_path / "c", "qwen3_moe", num_experts=0)
    model = load_ours(path).module
    assert all(not hasattr(layer.mlp, "switch_mlp") for layer in model.model.layers)
