"""Specification of quantization parsing and of swapping layers to match a checkpoint."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from mlx_loom.artifacts import (
    QuantizationConfig,
    QuantSpec,
    TensorInfo,
    apply_quantization,
    load_weights,
    parse_quantization,
    read_config,
    read_manifest,
)
from mlx_loom.errors import ConfigError, WeightsError

SRC = Path("/models/q/config.json")
MODES = {
    "mxfp4": {"group_size": 32, "bits": 4},
    "nvfp4": {"group_size": 16, "bits": 4},
    "mxfp8": {"group_size": 32, "bits": 8},
}
Q4 = QuantSpec(group_size=64, bits=4)


def parse(config: dict) -> QuantizationConfig | None:
    return parse_quantization(config, source=SRC)


def parse_error(config: dict) -> str:
    with pytest.raises(ConfigError) as info:
        parse(config)
    assert str(SRC) in info.value.message and info.value.fix
    return info.value.message


# --- parsing -------------------------------------------------------------------


def test_no_quantization_key_means_unquantized():
    assert parse({"model_type": "llama"}) is None


def test_mlx_lm_global_spec_applies_to_every_module():
    q = parse({"quantization": {"group_size": 64, "bits": 4, "mode": "affine"}})
    assert q.for_module("model.layers.3.self_attn.q_proj") == QuantSpec(group_size=64, bits=4)
    assert q.source_key == "quantization"


def test_mode_defaults_to_affine():
    assert parse({"quantization": {"group_size": 32, "bits": 8}}).default.mode == "affine"


def test_a_module_override_replaces_the_global_spec_for_that_module_only():
    q = parse(
        {
            "quantization": {
                "group_size": 64,
                "bits": 4,
                "model.layers.0.mlp.down_proj": {"group_size": 32, "bits": 8},
            }
        }
    )
    assert q.for_module("model.layers.0.mlp.down_proj") == QuantSpec(group_size=32, bits=8)
    assert q.for_module("model.layers.1.mlp.down_proj") == QuantSpec(group_size=64, bits=4)


def test_false_leaves_a_module_unquantized():
    q = parse({"quantization": {"group_size": 64, "bits": 4, "lm_head": False}})
    assert q.for_module("lm_head") is None


def test_hf_style_quantization_config_in_mlx_affine_form_is_accepted():
    q = parse({"quantization_config": {"group_size": 128, "bits": 6, "mode": "affine"}})
    assert q.default == QuantSpec(group_size=128, bits=6)
    assert q.source_key == "quantization_config"


def test_quantization_wins_over_quantization_config():
    q = parse(
        {
            "quantization": {"group_size": 32, "bits": 4},
            "quantization_config": {"group_size": 64, "bits": 8},
        }
    )
    assert q.default == QuantSpec(group_size=32, bits=4)


def test_wrapper_layouts_may_keep_quantization_config_in_text_config():
    q = parse({"text_config": {"quantization_config": {"group_size": 64, "bits": 3}}})
    assert q.default.bits == 3 and q.source_key == "text_config.quantization_config"


@pytest.mark.parametrize("bits", [1, 7, 16, True])
def test_unsupported_bit_widths_are_refused(bits):
    assert "bits" in parse_error({"quantization": {"group_size": 64, "bits": bits}})


@pytest.mark.parametrize("group_size", [16, 48, 256])
def test_unsupported_group_sizes_are_refused(group_size):
    text = parse_error({"quantization": {"group_size": group_size, "bits": 4}})
    assert f"group_size = {group_size}" in text


@pytest.mark.parametrize("mode", list(MODES))
def test_microscaling_modes_parse_with_the_packing_they_fix(mode):
    written = parse({"quantization": {**MODES[mode], "mode": mode}})
    implied = parse({"quantization": {"mode": mode}})  # MLX's layers fill these in alike
    want = QuantSpec(**MODES[mode], mode=mode)
    assert written.default == implied.default == want
    assert not want.has_biases and want.describe() == mode


def test_modes_mix_per_module_as_mlx_lm_writes_them():
    router = {"group_size": 64, "bits": 8}
    q = parse({"quantization": {"group_size": 32, "bits": 4, "mode": "mxfp4", "router": router}})
    assert q.for_module("up").mode == "mxfp4"
    assert q.for_module("router") == QuantSpec(group_size=64, bits=8, mode="affine")


@pytest.mark.parametrize("key, value", [("group_size", 64), ("bits", 8)])
def test_a_microscaling_mode_with_another_packing_is_refused(key, value):
    text = parse_error({"quantization": {"mode": "mxfp4", key: value}})
    assert f"quantization.{key} = {value}, but mode 'mxfp4' packs group size 32 at 4 bits" in text


def test_an_unknown_mode_is_refused_by_name():
    text = parse_error({"quantization": {"group_size": 32, "bits": 4, "mode": "fp6"}})
    assert "mode = 'fp6' is an unsupported quantization mode" in text


@pytest.mark.parametrize("method", ["awq", "gptq", "fp8", "bitnet"])
def test_other_hf_quantization_methods_are_refused_by_name(method):
    text = parse_error({"quantization_config": {"quant_method": method, "bits": 4}})
    assert f"quant_method = '{method}' is an unsupported quantization method" in text


def test_an_override_must_say_both_group_size_and_bits():
    text = parse_error({"quantization": {"group_size": 32, "bits": 4, "lm_head": {"bits": 8}}})
    assert "quantization['lm_head'].group_size is missing" in text


def test_an_override_that_is_neither_an_object_nor_false_is_refused():
    assert "quantization['lm_head'] = True" in parse_error(
        {"quantization": {"group_size": 32, "bits": 4, "lm_head": True}}
    )


def test_bad_values_inside_an_override_are_named_with_the_module():
    override = {"group_size": 32, "bits": 9}
    text = parse_error({"quantization": {"group_size": 32, "bits": 4, "x.proj": override}})
    assert "quantization['x.proj'].bits = 9" in text


# --- apply_quantization --------------------------------------------------------


class Tiny(nn.Module):
    """Embedding, two projections, and a norm: enough shapes to exercise every rule."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 64)
        self.up = nn.Linear(64, 128, bias=False)
        self.down = nn.Linear(128, 64, bias=True)
        self.norm = nn.RMSNorm(64)

    def __call__(self, tokens: mx.array) -> mx.array:
        return self.norm(self.down(self.up(self.embed(tokens))))


def quantized_checkpoint(
    specs: dict[str, tuple[int, int]], dtype: mx.Dtype = mx.bfloat16
) -> dict[str, mx.array]:
    """Weights of a Tiny in ``dtype``, with the modules in ``specs`` packed (group, bits)."""
    mx.random.seed(0)
    source = Tiny()
    source.set_dtype(dtype)
    for path, (group, bits) in specs.items():
        module = dict(source.named_modules())[path]
        quantized = module.to_quantized(group_size=group, bits=bits)
        parent, _, leaf = path.rpartition(".")
        (dict(source.named_modules())[parent] if parent else source)[leaf] = quantized
    weights = dict(tree_flatten(source.parameters()))
    mx.eval(weights)
    return weights


def test_layers_are_swapped_exactly_where_the_checkpoint_has_scales():
    weights = quantized_checkpoint({"embed": (64, 4), "up": (64, 4)})
    model = Tiny()
    q = QuantizationConfig(default=QuantSpec(group_size=64, bits=4))
    assert apply_quantization(model, q, weights) == ["embed", "up"]
    assert isinstance(model.embed, nn.QuantizedEmbedding)
    assert isinstance(model.up, nn.QuantizedLinear)
    assert type(model.down) is nn.Linear  # no scales: left as it is


def test_loaded_weights_keep_their_stored_dtype_and_give_the_reference_output():
    weights = quantized_checkpoint({"up": (32, 4), "down": (64, 8)})
    q = QuantizationConfig(
        default=QuantSpec(group_size=32, bits=4),
        overrides={"down": QuantSpec(group_size=64, bits=8)},
    )
    model = Tiny()
    apply_quantization(model, q, weights)
    model.load_weights(list(weights.items()), strict=True)
    loaded = dict(tree_flatten(model.parameters()))
    assert all(loaded[k].dtype == weights[k].dtype for k in weights)
    assert loaded["up.scales"].dtype == mx.bfloat16
    assert (model.up.bits, model.up.group_size) == (4, 32)
    assert (model.down.bits, model.down.group_size) == (8, 64)

    tokens = mx.array([[1, 5, 9]])
    h = weights["embed.weight"][tokens]
    h = mx.quantized_matmul(
        h,
        weights["up.weight"],
        weights["up.scales"],
        weights["up.biases"],
        transpose=True,
        group_size=32,
        bits=4,
    )
    h = mx.quantized_matmul(
        h,
        weights["down.weight"],
        weights["down.scales"],
        weights["down.biases"],
        transpose=True,
        group_size=64,
        bits=8,
    )
    h = h + weights["down.bias"]
    expected = mx.fast.rms_norm(h, weights["norm.weight"], 1e-5)
    assert mx.array_equal(model(tokens), expected).item()


def test_a_header_manifest_is_enough_to_plan_the_swap(tmp_path):
    weights = quantized_checkpoint({"up": (64, 4)})
    manifest = {k: TensorInfo("BF16", tuple(v.shape)) for k, v in weights.items()}
    model = Tiny()
    q = QuantizationConfig(default=QuantSpec(group_size=64, bits=4))
    assert apply_quantization(model, q, manifest) == ["up"]


@pytest.mark.parametrize("mode", ["mxfp4", "nvfp4", "mxfp8"])
def test_a_microscaling_checkpoint_loads_without_biases_and_runs_mlx_products(mode):
    source = Tiny()
    source.up = source.up.to_quantized(mode=mode)
    source.embed = source.embed.to_quantized(mode=mode)
    weights = dict(tree_flatten(source.parameters()))
    assert "up.biases" not in weights and weights["up.scales"].dtype == mx.uint8
    model = Tiny()
    q = QuantizationConfig(default=QuantSpec(**MODES[mode], mode=mode))
    assert apply_quantization(model, q, weights) == ["embed", "up"]
    model.load_weights(list(weights.items()), strict=True)
    tokens = mx.array([[1, 5, 9]])
    assert mx.array_equal(model(tokens), source(tokens)).item()


def test_a_checkpoint_packed_in_another_mode_than_declared_is_a_weights_error():
    source = Tiny()
    source.up = source.up.to_quantized(mode="mxfp4")
    weights = dict(tree_flatten(source.parameters()))
    affine = QuantizationConfig(default=QuantSpec(group_size=32, bits=4))
    with pytest.raises(WeightsError) as info:
        apply_quantization(Tiny(), affine, weights)
    assert "uint8 scales (a microscaling mode)" in str(info.value)


@pytest.mark.parametrize("count", [1, 2, 3])
def test_nvfp4_lookups_mlx_cannot_dequantize_row_by_row_give_the_tables_rows(count):
    # An 80-wide nvfp4 table packs 10 words a row: MLX 0.32.4's dequantize fails
    # on an odd number of such rows; the loader's lookup pairs them.
    table = nn.Embedding(8, 80).to_quantized(mode="nvfp4")
    model = nn.Sequential(nn.Embedding(8, 80))
    weights = {f"layers.0.{k}": v for k, v in tree_flatten(table.parameters())}
    nvfp4 = QuantizationConfig(default=QuantSpec(**MODES["nvfp4"], mode="nvfp4"))
    apply_quantization(model, nvfp4, weights)
    model.load_weights(list(weights.items()), strict=True)
    full = mx.dequantize(table.weight, table.scales, mode="nvfp4")
    tokens = mx.array([[3, 7, 1][:count]])
    assert mx.array_equal(model(tokens), full[tokens]).item()


def test_config_and_packed_shapes_that_disagree_are_a_weights_error_with_a_hint():
    weights = quantized_checkpoint({"up": (64, 8)})
    with pytest.raises(WeightsError) as info:
        apply_quantization(Tiny(), QuantizationConfig(default=Q4), weights)
    text = str(info.value)
    assert "up: config declares 4-bit group 64" in text
    assert "fit 8-bit, group size 64" in text


def test_scales_for_a_module_the_config_leaves_unquantized_are_an_error():
    weights = quantized_checkpoint({"up": (64, 4)})
    q = QuantizationConfig(default=QuantSpec(group_size=64, bits=4), overrides={"up": None})
    with pytest.raises(WeightsError, match=r"up: config leaves it unquantized"):
        apply_quantization(Tiny(), q, weights)


def test_scales_without_any_quantization_in_the_config_are_an_error():
    weights = quantized_checkpoint({"up": (64, 4)})
    with pytest.raises(WeightsError, match="config.json has no quantization"):
        apply_quantization(Tiny(), None, weights)


def test_an_explicit_override_without_scales_in_the_checkpoint_is_an_error():
    weights = quantized_checkpoint({})
    q = QuantizationConfig(
        default=QuantSpec(group_size=64, bits=4),
        overrides={"down": QuantSpec(group_size=64, bits=8)},
    )
    message = "down: config declares 8-bit group 64 but the checkpoint has no scales"
    with pytest.raises(WeightsError, match=message):
        apply_quantization(Tiny(), q, weights)


def test_every_disagreeing_module_is_listed_in_one_error():
    weights = quantized_checkpoint({"up": (64, 8), "down": (64, 4)})
    q = QuantizationConfig(default=QuantSpec(group_size=64, bits=4), overrides={"down": None})
    with pytest.raises(WeightsError, match=r"\(2 module\(s\)\)"):
        apply_quantization(Tiny(), q, weights)


def test_a_global_claim_with_no_scales_anywhere_leaves_every_module_dense():
    # mlx-lm's rule: a module is quantized exactly when its scales are present.
    # ``mlx_lm.convert -q`` writes such a config when no input width divides
    # the group size, and mlx-lm loads it as the dense model it is.
    model = Tiny()
    q = QuantizationConfig(default=QuantSpec(group_size=64, bits=4), source_key="quantization")
    assert apply_quantization(model, q, quantized_checkpoint({})) == []
    assert type(model.up) is nn.Linear and type(model.embed) is nn.Embedding


def test_unquantized_checkpoint_with_no_quantization_changes_nothing():
    model = Tiny()
    assert apply_quantization(model, None, quantized_checkpoint({})) == []
    assert type(model.up) is nn.Linear


# --- parity with mlx-lm ----------------------------------------------------------


def test_mixed_precision_llama_loads_bit_identical_to_mlx_lm(tmp_path):
    from mlx_lm.models import llama
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    config = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": 96,
        "tie_word_embeddings": False,
    }
    mx.random.seed(3)
    source = llama.Model(llama.ModelArgs.from_dict(config))
    source.set_dtype(mx.bfloat16)

    def mixed(path: str, module: nn.Module):
        # down projections at 8 bits / group 32, lm_head left in bf16, the rest default
        if path == "lm_head":
            return False
        if path.endswith("down_proj"):
            return {"group_size": 32, "bits": 8, "mode": "affine"}
        return True

    source, qconfig = quantize_model(source, config, 64, 4, quant_predicate=mixed)
    save_model(tmp_path, source)
    save_config(qconfig, tmp_path / "config.json")

    oracle, _ = load_model(tmp_path)

    ours_config = read_config(tmp_path)
    weights = load_weights(tmp_path)
    ours = llama.Model(llama.ModelArgs.from_dict(ours_config.raw))
    swapped = apply_quantization(ours, ours_config.quantization, read_manifest(tmp_path))
    ours.load_weights(list(weights.items()), strict=True)
    ours.eval()

    assert "lm_head" not in swapped and "model.layers.0.mlp.down_proj" in swapped
    assert ours.model.layers[0].mlp.down_proj.bits == 8
    tokens = mx.array([[3, 17, 42, 5, 88]])
    assert mx.array_equal(ours(tokens), oracle(tokens)).item()
