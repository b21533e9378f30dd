"""The strict loader: the config's manifest against the headers first, the graph after, lazily."""

from __future__ import annotations

import itertools
import json
import logging
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlx_loom.artifacts import read_config
from mlx_loom.errors import WeightsError
from mlx_loom.nn import Matrix, Tensor, dense_tensors, load_checkpoint

DIMS, OUT, VOCAB = 64, 32, 16


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIMS)
        self.proj = nn.Linear(DIMS, OUT, bias=True)
        self.norm = nn.RMSNorm(OUT)

    def __call__(self, x):
        return self.norm(self.proj(self.embed(x)))


def manifest():
    yield "embed", Matrix((VOCAB, DIMS))
    yield "proj", Matrix((OUT, DIMS), bias=True)
    yield "norm.weight", Tensor((OUT,))


def _checkpoint(path: Path, tensors: dict[str, mx.array], config: dict | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), tensors)
    (path / "config.json").write_text(json.dumps(config or {"model_type": "toy"}))
    return path


def _tensors(dtype=mx.float32, **changes) -> dict[str, mx.array]:
    out = {
        name: mx.random.normal(shape, key=mx.random.key(i)).astype(dtype)
        for i, (name, (shape, _)) in enumerate(dense_tensors(manifest()).items())
    }
    out.update(changes)
    return {k: v for k, v in out.items() if v is not None}


class Builds:
    """A ``build`` that records whether it ran."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> Toy:
        self.calls += 1
        return Toy()


def _load(path: Path, build=None, **kwargs):
    return load_checkpoint(
        path, read_config(path), manifest=manifest(), build=build or Toy, **kwargs
    )


def test_a_matching_checkpoint_loads_with_every_tensor_attached(tmp_path):
    tensors = _tensors()
    model = _load(_checkpoint(tmp_path / "m", tensors))
    assert mx.array_equal(model.proj.weight, tensors["proj.weight"])
    assert mx.array_equal(model.norm.weight, tensors["norm.weight"])


def test_weights_are_attached_lazily_not_read(tmp_path):
    big = {"embed.weight": mx.ones((VOCAB, DIMS))}
    path = _checkpoint(tmp_path / "m", _tensors(**big))
    mx.clear_cache()
    before = mx.get_active_memory()
    model = _load(path)
    loaded = mx.get_active_memory()
    mx.eval(model.parameters())
    evaluated = mx.get_active_memory()
    nbytes = sum(v.nbytes for v in _tensors().values())
    assert loaded - before < nbytes // 2  # nothing of the checkpoint was read
    assert evaluated - before >= nbytes  # ... until the caller evaluates


def test_every_mismatch_is_reported_together_before_the_graph_is_built(tmp_path):
    tensors = _tensors(**{"proj.bias": None, "stray.weight": mx.zeros((2,))})
    tensors["norm.weight"] = mx.zeros((OUT + 1,))
    build = Builds()
    with pytest.raises(WeightsError) as err:
        _load(_checkpoint(tmp_path / "m", tensors), build)
    message = str(err.value)
    assert "missing (1): proj.bias" in message
    assert "unexpected (1): stray.weight" in message
    assert f"norm.weight ({OUT + 1},) (expected ({OUT},))" in message
    assert build.calls == 0


def test_integer_tensors_where_floats_belong_are_refused(tmp_path):
    tensors = _tensors()
    tensors["norm.weight"] = mx.zeros((OUT,), mx.int32)
    with pytest.raises(WeightsError, match=r"norm.weight I32 \(expected BF16 or F16 or F32\)"):
        _load(_checkpoint(tmp_path / "m", tensors))


def test_mixed_float_dtypes_load_unless_the_family_asks_for_one(tmp_path):
    tensors = _tensors()
    tensors["norm.weight"] = tensors["norm.weight"].astype(mx.bfloat16)
    path = _checkpoint(tmp_path / "m", tensors)
    assert _load(path).norm.weight.dtype == mx.bfloat16
    with pytest.raises(WeightsError, match=r"proj.weight F32 \(expected BF16\)"):
        _load(path, uniform_dtype_of="norm.weight")


def test_a_manifest_longer_than_the_checkpoint_is_cut_off(tmp_path):
    def endless():
        yield from manifest()
        for i in itertools.count():
            yield f"layers.{i}.weight", Tensor((DIMS,))

    path = _checkpoint(tmp_path / "m", _tensors())
    build = Builds()
    with pytest.raises(WeightsError, match="describes more than .* the checkpoint holds 4"):
        load_checkpoint(path, read_config(path), manifest=endless(), build=build)
    assert build.calls == 0


def _quantized(dtype=mx.float32) -> dict[str, mx.array]:
    tensors = _tensors(dtype)
    w, s, b = mx.quantize(tensors.pop("proj.weight"), 32, 4)
    return tensors | {"proj.weight": w, "proj.scales": s, "proj.biases": b}


QCONFIG = {"model_type": "toy", "quantization": {"group_size": 32, "bits": 4}}


def test_quantized_modules_are_expected_where_scales_are_stored(tmp_path):
    model = _load(_checkpoint(tmp_path / "m", _quantized(), QCONFIG))
    assert isinstance(model.proj, nn.QuantizedLinear)
    assert (model.proj.bits, model.proj.group_size) == (4, 32)
    assert isinstance(model.embed, nn.Embedding)  # no scales stored: stays dense


def test_scales_without_a_quantization_config_are_refused_before_building(tmp_path):
    build = Builds()
    with pytest.raises(WeightsError, match="proj: the checkpoint has scales but config.json"):
        _load(_checkpoint(tmp_path / "m", _quantized()), build)
    assert build.calls == 0


def test_a_packing_the_config_contradicts_is_refused(tmp_path):
    config = {"model_type": "toy", "quantization": {"group_size": 64, "bits": 8}}
    with pytest.raises(WeightsError, match=r"proj.weight \(32, 8\) \(expected \(32, 16\)\)"):
        _load(_checkpoint(tmp_path / "m", _quantized(), config))


WRAPPER = {
    "model_type": "wrapper",
    "text_config": {"model_type": "toy"},
    "quantization": {"group_size": 32, "bits": 4, "language_model.model.embed": False},
}


@pytest.mark.parametrize("prefix", ["model.language_model.", "language_model.model."])
def test_wrapper_layouts_reach_the_family_under_text_model_names(tmp_path, prefix, caplog):
    def renamed(name: str) -> str:
        return prefix + name.removeprefix("model.")

    tensors = {renamed("model." + k): v for k, v in _quantized().items()}
    tensors["model.vision_tower.patch.weight"] = mx.ones((4,))
    tensors["model.multi_modal_projector.weight"] = mx.ones((4,))

    def sanitize(weights):
        assert set(weights) == {
            "model.embed.weight",
            "model.proj.weight",
            "model.proj.scales",
            "model.proj.biases",
            "model.proj.bias",
            "model.norm.weight",
        }
        return {k.removeprefix("model."): v for k, v in weights.items()}

    path = _checkpoint(tmp_path / "m", tensors, WRAPPER)
    with caplog.at_level(logging.WARNING, logger="mlx_loom.artifacts"):
        model = _load(path, sanitize=sanitize)
    assert isinstance(model.proj, nn.QuantizedLinear)
    (notice,) = [r.getMessage() for r in caplog.records]
    assert "dropped 2 non-text tensor(s)" in notice and "vision_tower: 1" in notice


def test_wrapper_quantization_overrides_are_keyed_by_text_model_paths(tmp_path):
    path = _checkpoint(tmp_path / "m", {}, WRAPPER)
    view = read_config(path).view()
    assert view.quantization.overrides == {"model.embed": None}


def test_other_towers_in_a_flat_checkpoint_are_unexpected_not_dropped(tmp_path):
    tensors = _tensors() | {"vision_tower.patch.weight": mx.ones((4,))}
    with pytest.raises(WeightsError, match="unexpected \\(1\\): vision_tower.patch.weight"):
        _load(_checkpoint(tmp_path / "m", tensors))
