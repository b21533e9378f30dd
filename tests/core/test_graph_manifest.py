"""The tensor rule read from the graph: shapes from lazy parameters, layer counts held to the checkpoint."""

from __future__ import annotations

import json
import time

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlx_loom.artifacts.config import read_config
from mlx_loom.errors import WeightsError
from mlx_loom.nn import (
    GatedMLP,
    Matrix,
    SwitchLinear,
    Tensor,
    graph_checkpoint_tensors,
    graph_manifest,
    load_checkpoint,
)


class Block(nn.Module):
    def __init__(self, dims: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(dims)
        self.proj = nn.Linear(dims, 2 * dims, bias=True)
        self.mlp = GatedMLP(dims, 3 * dims)
        self.experts = SwitchLinear(dims, dims, 4)
        self.conv = nn.Conv1d(dims, dims, 3, groups=dims, bias=False)


class Tiny(nn.Module):
    def __init__(self, layers: int, dims: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, dims)
        self.layers = [Block(dims) for _ in range(layers)]
        self.head_gain = mx.ones((dims,))


def test_every_parameter_is_listed_once_with_quantizable_modules_as_matrices():
    manifest = dict(graph_manifest(Tiny(2)))
    assert manifest["embed"] == Matrix((64, 32))
    assert manifest["layers.1.proj"] == Matrix((64, 32), bias=True)
    assert manifest["layers.0.mlp.gate_proj"] == Matrix((96, 32))
    assert manifest["layers.0.experts"] == Matrix((4, 32, 32))
    assert manifest["layers.0.norm.weight"] == Tensor((32,))
    assert manifest["layers.0.conv.weight"] == Tensor((32, 3, 1))
    assert manifest["head_gain"] == Tensor((32,))
    assert "layers.1.proj.bias" not in manifest and "layers.1.proj.weight" not in manifest
    assert len(manifest) == 1 + 2 * 7 + 1


def test_reading_the_manifest_allocates_nothing():
    """Parameters are lazy: a model of billions of weights costs only its Python objects."""
    before = mx.get_active_memory()
    manifest = dict(graph_manifest(Tiny(1, dims=1 << 15)))
    assert manifest["layers.0.proj"] == Matrix((1 << 16, 1 << 15), bias=True)
    assert mx.get_active_memory() - before < 1 << 20


def _checkpoint(tmp_path, layers: int):
    model = Tiny(layers)
    from mlx.utils import tree_flatten

    mx.save_safetensors(str(tmp_path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "tiny"}))
    return read_config(tmp_path)


def test_a_checkpoint_loads_against_the_graph_it_was_saved_from(tmp_path):
    config = _checkpoint(tmp_path, 2)
    model = load_checkpoint(tmp_path, config, build=lambda: Tiny(2), layers=("layers", 2))
    assert model.layers[1].proj.weight.shape == (64, 32)


def test_a_mismatch_is_reported_from_the_derived_rule(tmp_path):
    config = _checkpoint(tmp_path, 2)
    with pytest.raises(WeightsError, match="layers.0.proj.weight"):
        load_checkpoint(tmp_path, config, build=lambda: Tiny(2, dims=48), layers=("layers", 2))


def test_a_hostile_layer_count_is_refused_before_the_graph_is_built(tmp_path):
    config = _checkpoint(tmp_path, 2)
    built: list[int] = []

    def build() -> Tiny:
        built.append(1)
        return Tiny(65536)

    start = time.perf_counter()
    with pytest.raises(WeightsError, match=r"describes 65536 layers under layers .* holds 2"):
        load_checkpoint(tmp_path, config, build=build, layers=("layers", 65536))
    assert not built
    assert time.perf_counter() - start < 5


def test_checkpoint_tensors_come_from_the_graph_and_its_layout_mapping():
    tensors = graph_checkpoint_tensors(lambda raw: int(raw["layers"]), Tiny)
    out = tensors({"layers": 1}, "BF16")
    assert out["layers.0.proj.bias"] == ((64,), "BF16")
    assert out["embed.weight"] == ((64, 32), "BF16")

    def per_expert(manifest, layers):
        for name, entry in manifest:
            if isinstance(entry, Matrix) and name.endswith("experts"):
                for e in range(entry.shape[0]):
                    yield f"{name}.{e}", Matrix(entry.shape[1:])
            else:
                yield name, entry

    split = graph_checkpoint_tensors(lambda raw: int(raw["layers"]), Tiny, to_checkpoint=per_expert)
    out = split({"layers": 1})
    assert out["layers.0.experts.3.weight"] == ((32, 32), "F32")
    assert "layers.0.experts.weight" not in out
