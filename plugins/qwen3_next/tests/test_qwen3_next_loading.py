"""Loading: configs and checkpoints that cannot work fail at load, naming what is wrong."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from mlx_loom.artifacts import validate_family_config
from mlx_loom.errors import ConfigError, WeightsError
from mlx_loom_qwen3_next.config import Qwen3_5Config, Qwen3NextConfig
from mlx_loom_qwen3_next.loader import sanitize
from mlx_loom_qwen3_next.plugin import TINY_QWEN3_NEXT


def _cfg(**changes):
    return {**TINY_QWEN3_NEXT, "head_dim": 16, **changes}


def _validate(data, schema=Qwen3NextConfig):
    """Through the core's one helper, as resolution validates a checkpoint's config."""
    return validate_family_config(schema, data, source=Path("model/config.json"))


def test_the_tiny_config_is_valid_and_interleaves_layer_kinds():
    cfg = _validate(_cfg())
    assert cfg.layer_kinds == ("linear", "attention", "linear", "attention")
    assert [cfg.mlp_kind(i) for i in range(4)] == ["moe", "moe", "dense", "moe"]


def test_attention_heads_that_do_not_divide_fail_at_load():
    want = "num_attention_heads: found 4; 4 is not a multiple of num_key_value_heads = 3"
    with pytest.raises(ConfigError, match=want):
        _validate(_cfg(num_key_value_heads=3))


def test_linear_heads_that_do_not_divide_fail_at_load():
    with pytest.raises(
        ConfigError, match="linear_num_value_heads: found 5; .* linear_num_key_heads = 2"
    ):
        _validate(_cfg(linear_num_value_heads=5))


@pytest.mark.parametrize("width", [1, 9])
def test_a_conv_width_the_kernels_do_not_implement_fails_at_load(width):
    with pytest.raises(
        ConfigError, match=f"linear_conv_kernel_dim: found {width}; .*supported: 2, 3"
    ):
        _validate(_cfg(linear_conv_kernel_dim=width))


@pytest.mark.parametrize("interval", [0, 5])
def test_an_interval_that_leaves_no_attention_layer_fails_at_load(interval):
    want = f"full_attention_interval: found {interval}; {interval} leaves no full-attention"
    with pytest.raises(ConfigError, match=want):
        _validate(_cfg(full_attention_interval=interval))


def test_a_missing_field_is_reported_through_the_core_with_its_name(tmp_path):
    data = _cfg()
    del data["linear_key_head_dim"]
    with pytest.raises(ConfigError, match="linear_key_head_dim"):
        validate_family_config(Qwen3NextConfig, data, source=tmp_path / "config.json")


def test_qwen3_5_reads_rope_parameters(qn):
    cfg = _validate(qn.QWEN3_5_CONFIG["text_config"], Qwen3_5Config)
    assert (cfg.hidden_size, cfg.rope_theta, cfg.rope_dims, cfg.num_experts) == (64, 10000.0, 4, 0)
    assert cfg.norm_topk_prob is True


def test_missing_linear_attention_tensors_fail_at_load_naming_them(tmp_path, qn):
    gone = "model.layers.2.linear_attn.in_proj_ba.weight"
    path = qn.write_checkpoint(
        tmp_path / "m", qn.QWEN3_NEXT_CONFIG, drop=(gone, "model.layers.0.linear_attn.A_log")
    )
    with pytest.raises(WeightsError, match="2 missing") as err:
        qn.load_ours(path)
    assert gone in str(err.value) and "model.layers.0.linear_attn.A_log" in str(err.value)


def test_a_missing_expert_fails_at_load_naming_it(tmp_path, qn):
    path = qn.write_checkpoint(
        tmp_path / "m", qn.QWEN3_NEXT_CONFIG, drop=("model.layers.1.mlp.experts.3.up_proj.weight",)
    )
    want = r"model.layers.1.mlp.experts.\*.up_proj.weight: missing experts \[3\] \(3 of"
    with pytest.raises(WeightsError, match=want):
        qn.load_ours(path)


def test_sanitize_maps_hf_layout_like_mlx_lm():
    cfg = _validate(_cfg(num_hidden_layers=2, mlp_only_layers=[]))
    w = {
        "model.layers.0.linear_attn.conv1d.weight": mx.zeros((96, 1, 4)),
        "model.layers.0.input_layernorm.weight": mx.zeros(64),
        "model.layers.0.linear_attn.norm.weight": mx.zeros(8),
        "model.norm.weight": mx.zeros(64),
        "mtp.layers.0.input_layernorm.weight": mx.zeros(64),
        **{
            f"model.layers.1.mlp.experts.{e}.{p}.weight": mx.full((2, 2), e)
            for e in range(4)
            for p in ("gate_proj", "up_proj", "down_proj")
        },
    }
    out = sanitize(w, cfg)
    assert out["model.layers.0.linear_attn.conv1d.weight"].shape == (96, 4, 1)
    assert out["model.layers.0.input_layernorm.weight"].tolist() == [1.0] * 64
    assert out["model.norm.weight"].tolist() == [1.0] * 64
    assert out["model.layers.0.linear_attn.norm.weight"].tolist() == [0.0] * 8
    assert out["model.layers.1.mlp.switch_mlp.up_proj.weight"][:, 0, 0].tolist() == [0, 1, 2, 3]
    assert not any(k.startswith("mtp.") for k in out)


def test_already_converted_checkpoints_are_not_shifted_again():
    cfg = _validate(_cfg(num_hidden_layers=2, mlp_only_layers=[]))
    w = {
        "model.layers.0.linear_attn.conv1d.weight": mx.zeros((96, 4, 1)),
        "model.norm.weight": mx.ones(64),
    }
    assert sanitize(w, cfg)["model.norm.weight"].tolist() == [1.0] * 64
