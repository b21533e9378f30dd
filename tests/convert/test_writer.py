"""The streaming safetensors writer: exact bytes, mlx-lm's sharding, one tensor at a time."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from mlx_loom.artifacts import load_weights, read_manifest, read_safetensors_header
from mlx_loom.artifacts.writer import plan_shards, write_weights
from mlx_loom.errors import WeightsError


def _tensors() -> dict[str, mx.array]:
    return {
        "bf16": mx.random.normal((3, 5), key=mx.random.key(0)).astype(mx.bfloat16),
        "u32": mx.arange(7, dtype=mx.uint32),
        "transposed": mx.random.normal((4, 6), key=mx.random.key(1)).T,
        "bool": mx.array([True, False, True]),
        "empty": mx.zeros((0, 3)),
        "f16": mx.ones((2, 2), mx.float16),
    }


def test_every_tensor_reads_back_with_its_values_shape_and_dtype(tmp_path):
    want = {k: mx.array(v) for k, v in _tensors().items()}
    write_weights(tmp_path, _tensors())
    back = load_weights(tmp_path)
    assert set(back) == set(want)
    for name, value in want.items():
        assert back[name].dtype == value.dtype and mx.array_equal(back[name], value), name


def test_shards_follow_mlx_lms_rule_and_the_index_names_each_tensor(tmp_path):
    tensors = {f"t{i}": mx.zeros((10,), mx.float32) for i in range(5)}  # 40 bytes each
    index = write_weights(tmp_path, dict(tensors), max_shard_bytes=100)
    files = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert index["weight_map"] == {
        "t0": files[0],
        "t1": files[0],
        "t2": files[1],
        "t3": files[1],
        "t4": files[2],
    }
    assert json.loads((tmp_path / "model.safetensors.index.json").read_text()) == index
    assert index["metadata"]["total_size"] == 200
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == files
    assert set(read_manifest(tmp_path)) == set(tensors)


def test_a_tensor_over_the_limit_gets_a_shard_of_its_own():
    tensors = {"small": mx.zeros((2,)), "huge": mx.zeros((100,)), "tail": mx.zeros((2,))}
    assert plan_shards(tensors, 16) == [["small"], ["huge"], ["tail"]]


def test_one_shard_is_named_model_safetensors_with_mlx_metadata(tmp_path):
    write_weights(tmp_path, _tensors())
    header = read_safetensors_header(tmp_path / "model.safetensors")
    assert header.metadata == {"format": "mlx"}


def test_the_mapping_is_consumed_so_written_tensors_can_be_freed(tmp_path):
    tensors = _tensors()
    write_weights(tmp_path, tensors)
    assert tensors == {}


def test_peak_memory_stays_near_one_tensor_not_the_whole_set(tmp_path):
    n, size = 24, 1 << 20  # 24 lazily computed tensors of 4 MiB each
    tensors = {f"t{i}": mx.full((size,), float(i)) * 2.0 for i in range(n)}
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    write_weights(tmp_path, tensors)
    peak = mx.get_peak_memory() - before
    assert peak < 4 * (4 * size), f"peak {peak / 2**20:.1f} MiB for {n} tensors of 4 MiB"


def test_a_dtype_mlx_could_not_load_back_is_refused_before_writing(tmp_path):
    with pytest.raises(WeightsError, match="cannot write a tensor of dtype"):
        write_weights(tmp_path, {"f64": mx.array([1.0], dtype=mx.float64)})
    assert not (tmp_path / "model.safetensors").exists()
