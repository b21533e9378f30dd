"""Loading gpt-oss checkpoints: the Hugging Face layouts mapped as mlx-lm maps them, and
what is refused (by name, before any weight is attached)."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from gpt_oss_testkit import TINY, hf_layout, mxfp4_layout, write
from mlx.utils import tree_flatten

from mlx_loom.errors import ConfigError, WeightsError
from mlx_loom.testing.parity import load_ours, oracle_model
from mlx_loom_gpt_oss import sanitize


@pytest.fixture(scope="module")
def params():
    return dict(tree_flatten(oracle_model(TINY).parameters()))


@pytest.mark.parametrize("layout", [hf_layout, mxfp4_layout], ids=["hf", "hf-mxfp4"])
def test_sanitize_is_mlx_lms_on_the_hugging_face_layouts(params, layout):
    stored = layout(params)
    ours = sanitize(stored)
    theirs = oracle_model(TINY).sanitize(dict(stored))
    assert sorted(ours) == sorted(theirs)
    for name, value in ours.items():
        assert value.dtype == theirs[name].dtype, name
        assert mx.array_equal(value, theirs[name]).item(), name


def test_the_mlx_layout_is_left_as_it_is(params):
    assert sanitize(params).keys() == params.keys()


def test_a_hugging_face_mxfp4_export_loads_as_mlx_lm_reads_it(params, tmp_path):
    """OpenAI's layout: MXFP4 ``*_blocks``/``*_scales`` experts under ``quant_method: mxfp4``
    (with the list of modules left dense), bit-equal to mlx-lm over a greedy run."""
    from mlx_loom.testing.parity import compare_with_mlx_lm

    config = {
        **TINY,
        "quantization_config": {
            "quant_method": "mxfp4",
            "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router"],
        },
    }
    path = write(tmp_path / "mxfp4", config, mxfp4_layout(params))
    experts = load_ours(path).module.model.layers[0].mlp.experts
    assert experts.down_proj.mode == "mxfp4" and "bias" in experts.down_proj
    compare_with_mlx_lm(path, steps=12)


def test_transformers_transposed_experts_are_refused_naming_the_tensors(params, tmp_path):
    stored = hf_layout(params)
    # transformers' own parameter: no .weight, stored [experts, in, 2 * hidden].
    for name in [n for n in stored if n.endswith("gate_up_proj.weight")]:
        stored[name[: -len(".weight")]] = stored.pop(name).swapaxes(-1, -2)
    with pytest.raises(WeightsError, match="experts.gate_proj"):
        load_ours(write(tmp_path / "tf", TINY, stored))


def test_a_missing_sink_is_refused(params, tmp_path):
    stored = {k: v for k, v in params.items() if k != "model.layers.1.self_attn.sinks"}
    with pytest.raises(WeightsError, match=r"model\.layers\.1\.self_attn\.sinks"):
        load_ours(write(tmp_path / "nosink", TINY, stored))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("layer_types", ["full_attention"], "has 1 entries"),
        ("num_experts_per_tok", 9, "exceeds num_local_experts"),
        ("num_key_value_heads", 3, "must divide num_attention_heads"),
        ("tie_word_embeddings", True, "tie_word_embeddings"),
        ("rope_scaling", {"rope_type": "llama3", "factor": 8.0}, "rope_scaling"),
    ],
)
def test_a_bad_config_field_is_one_config_error_naming_it(params, tmp_path, field, value, message):
    path = write(tmp_path / field, {**TINY, field: value}, params)
    with pytest.raises(ConfigError, match=message):
        load_ours(path)


def test_absent_fields_take_the_published_defaults(params, tmp_path):
    from mlx_loom_gpt_oss import GptOssConfig

    cfg = {k: v for k, v in TINY.items() if k not in ("layer_types", "sliding_window")}
    parsed = GptOssConfig.model_validate(cfg)
    assert parsed.layer_types == ["sliding_attention", "full_attention"] * 2
    assert parsed.sliding_window == 128 and parsed.swiglu_limit == 7.0
    path = write(tmp_path / "defaults", cfg, params)
    kinds = [type(c).__name__ for c in load_ours(path).make_cache()]
    assert kinds == ["RotatingKVCache", "KVCache"] * 2
    assert json.loads((path / "config.json").read_text()).get("layer_types") is None
