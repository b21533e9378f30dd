"""Adapters that do not fit are refused before the model changes, naming what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest

import mlx_loom
from mlx_loom.adapters import AdaptedLayer, load_adapter, read_adapter
from mlx_loom.errors import (
    AdapterError,
    CapabilityRefused,
    SafetensorsHeaderError,
)

from . import adapterkit as kit

Q_PROJ = "model.layers.1.self_attn.q_proj"


@pytest.fixture
def llama(base):
    return base("llama")


@pytest.fixture
def adapter(llama, tmp_path) -> Path:
    return kit.write_adapter(llama, tmp_path / "adapter", num_layers=1)


def _edit_tensors(adapter: Path, edit) -> None:
    path = adapter / "adapters.safetensors"
    tensors = dict(mx.load(str(path)))
    edit(tensors)
    mx.save_safetensors(str(path), tensors)


def _edit_config(adapter: Path, edit) -> None:
    path = adapter / "adapter_config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


def _refusal(llama, adapter) -> AdapterError:
    model, _ = mlx_loom.load(llama)
    with pytest.raises(AdapterError) as info:
        load_adapter(model, adapter)
    assert not any(isinstance(m, AdaptedLayer) for _, m in model.module.named_modules())
    assert model.adapter is None
    assert info.value.fix
    return info.value


def test_a_tensor_for_a_module_the_model_lacks_is_refused_by_name(llama, adapter):
    name = "model.layers.1.self_attn.rotary.lora_a"
    _edit_tensors(adapter, lambda t: t.update({name: mx.zeros((64, 4))}))
    err = _refusal(llama, adapter)
    assert "unexpected" in err.message and name in err.message


def test_a_tensor_for_a_layer_the_config_does_not_select_is_refused(llama, adapter):
    name = "model.layers.0.self_attn.q_proj.lora_a"  # num_layers=1 selects layer 1 only
    _edit_tensors(adapter, lambda t: t.update({name: mx.zeros((64, 4))}))
    assert name in _refusal(llama, adapter).message


def test_a_missing_factor_is_refused_by_name(llama, adapter):
    _edit_tensors(adapter, lambda t: t.pop(f"{Q_PROJ}.lora_b"))
    err = _refusal(llama, adapter)
    assert "missing (1)" in err.message and f"{Q_PROJ}.lora_b" in err.message


def test_a_factor_of_another_rank_is_refused_naming_both_ranks(llama, adapter):
    _edit_tensors(adapter, lambda t: t.update({f"{Q_PROJ}.lora_a": mx.zeros((64, 6))}))
    err = _refusal(llama, adapter)
    assert f"{Q_PROJ}.lora_a (64, 6), expected (64, 4)" in err.message
    assert "rank 6; adapter_config.json says rank 4" in err.message


def test_a_factor_for_another_width_is_refused_with_both_shapes(llama, adapter):
    _edit_tensors(adapter, lambda t: t.update({f"{Q_PROJ}.lora_b": mx.zeros((4, 32))}))
    assert f"{Q_PROJ}.lora_b (4, 32), expected (4, 64)" in _refusal(llama, adapter).message


def test_an_integer_factor_is_refused(llama, adapter):
    _edit_tensors(adapter, lambda t: t.update({f"{Q_PROJ}.lora_a": mx.zeros((64, 4), mx.int32)}))
    assert "wrong dtype" in _refusal(llama, adapter).message


def test_a_key_naming_a_norm_is_refused_naming_the_module(llama, tmp_path):
    adapter = kit.write_adapter(llama, tmp_path / "a", keys=["self_attn.q_proj"])
    _edit_config(adapter, lambda c: c["lora_parameters"].update(keys=["input_layernorm"]))
    err = _refusal(llama, adapter)
    assert "model.layers.1.input_layernorm" in err.message and "RMSNorm" in err.message


def test_keys_that_select_nothing_are_refused(llama, adapter):
    _edit_config(adapter, lambda c: c["lora_parameters"].update(keys=["feed_forward.w1"]))
    assert "selects no module" in _refusal(llama, adapter).message


def test_dora_on_routed_experts_is_refused_like_mlx_lm(base, tmp_path):
    path = base("qwen3_next")
    adapter = kit.write_adapter(path, tmp_path / "a", keys=["self_attn.q_proj"])
    _edit_config(adapter, lambda c: c.update(fine_tune_type="dora"))
    _edit_config(adapter, lambda c: c["lora_parameters"].update(keys=["mlp.switch_mlp.up_proj"]))
    err = _refusal(path, adapter)
    assert "DoRA" in err.message and "switch_mlp.up_proj" in err.message


def test_scale_missing_is_refused_with_mlx_lms_hint_about_alpha(llama, adapter):
    def edit(config):
        config["lora_parameters"].pop("scale")
        config["lora_parameters"]["alpha"] = 16

    _edit_config(adapter, edit)
    err = _refusal(llama, adapter)
    assert "lora_parameters.scale is missing" in err.message and "'alpha'" in err.message


def test_num_layers_missing_is_refused_mentioning_the_older_name(llama, adapter):
    _edit_config(adapter, lambda c: c.update(lora_layers=c.pop("num_layers")))
    err = _refusal(llama, adapter)
    assert "num_layers is missing" in err.message and "lora_layers" in err.message


@pytest.mark.parametrize(
    "field, value",
    [("rank", 0), ("rank", "8"), ("scale", float("inf")), ("dropout", 1.5), ("keys", [""])],
)
def test_bad_lora_parameters_are_refused_naming_the_field(llama, adapter, field, value):
    _edit_config(adapter, lambda c: c["lora_parameters"].update({field: value}))
    assert f"lora_parameters.{field}" in _refusal(llama, adapter).message


def test_an_unknown_fine_tune_type_is_refused(llama, adapter):
    _edit_config(adapter, lambda c: c.update(fine_tune_type="qlora"))
    assert "fine_tune_type" in _refusal(llama, adapter).message


@pytest.mark.parametrize(
    "text, expected",
    [("{not json", "not valid JSON"), ("[1, 2]", "not an object"), ("[" * 100_000, "")],
)
def test_a_malformed_config_file_is_refused(llama, adapter, text, expected):
    (adapter / "adapter_config.json").write_text(text)
    assert expected in _refusal(llama, adapter).message


def test_an_oversized_config_file_is_refused_before_parsing(llama, adapter):
    (adapter / "adapter_config.json").write_text(" " * (2 << 20) + "{}")
    assert "the limit for this file is" in _refusal(llama, adapter).message


def test_a_directory_without_weights_is_refused(llama, adapter):
    (adapter / "adapters.safetensors").unlink()
    assert "no adapters.safetensors" in _refusal(llama, adapter).message


def test_a_path_that_does_not_exist_is_refused(llama, tmp_path):
    err = _refusal(llama, tmp_path / "nowhere")
    assert "does not exist" in err.message


def test_a_truncated_weights_file_is_refused_by_the_header_check(adapter):
    path = adapter / "adapters.safetensors"
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(SafetensorsHeaderError):
        read_adapter(adapter)


def test_a_second_adapter_on_the_same_model_is_refused(llama, adapter):
    model, _ = mlx_loom.load(llama, adapter_path=adapter)
    with pytest.raises(AdapterError, match="already runs an adapter"):
        load_adapter(model, adapter)


def test_a_family_without_the_adapters_capability_refuses(tmp_path):
    from mlx_loom.host import PluginHost
    from mlx_loom.loader import build_model

    from ..core.toyfamily import ToyPlugin, write_toy_checkpoint

    ckpt = write_toy_checkpoint(tmp_path / "toy")
    host = PluginHost(plugins=[("toy", ToyPlugin())], entry_points=False)
    model = build_model(mlx_loom.resolve_model(ckpt, host=host))
    with pytest.raises(CapabilityRefused, match="'adapters'"):
        load_adapter(model, tmp_path / "any")


def test_a_graph_without_decoder_layers_is_refused_even_with_the_capability(tmp_path, llama):
    from mlx_loom.host import PluginHost
    from mlx_loom.loader import build_model

    from ..core.toyfamily import ToyPlugin, family_profile, write_toy_checkpoint

    ckpt = write_toy_checkpoint(tmp_path / "toy")
    caps = ("generate", "adapters")
    plugin = ToyPlugin(capabilities=caps, profiles=[family_profile(capabilities=frozenset(caps))])
    host = PluginHost(plugins=[("toy", plugin)], entry_points=False)
    model = build_model(mlx_loom.resolve_model(ckpt, host=host))
    adapter = kit.write_adapter(llama, tmp_path / "a")
    with pytest.raises(AdapterError, match="decoder layers"):
        load_adapter(model, adapter)


def test_a_model_split_across_processes_refuses_adapters(base, tmp_path, monkeypatch):
    from types import SimpleNamespace

    from mlx_loom.adapters import AdapterSet, load_adapter

    path = base("llama")
    adapter = kit.write_adapter(path, tmp_path / "adapter")
    model = mlx_loom.load(path)[0]
    # What load(..., parallel="tensor") records on each rank's part.
    monkeypatch.setattr(model, "parallel", SimpleNamespace(mode="tensor", rank=0, size=2))
    with pytest.raises(AdapterError, match="split across processes"):
        load_adapter(model, adapter)
    with pytest.raises(AdapterError, match="split across processes"):
        AdapterSet(model, {"a": adapter})
    assert model.adapter is None and model.adapter_set is None
