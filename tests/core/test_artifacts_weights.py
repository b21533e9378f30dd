"""Specification of shard discovery, manifests, lazy loading and the weight check."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest

from mlx_loom.artifacts import (
    INDEX_FILE,
    TensorInfo,
    check_weights,
    list_weight_files,
    load_weights,
    read_manifest,
)
from mlx_loom.artifacts import weights as weights_module
from mlx_loom.errors import SafetensorsHeaderError, WeightsError


def save(path: Path, arrays: dict[str, mx.array]) -> Path:
    mx.save_safetensors(str(path), arrays)
    return path


def write_index(model_dir: Path, weight_map: dict[str, str]) -> None:
    (model_dir / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def two_shard_model(model_dir: Path) -> dict[str, mx.array]:
    a = {"embed.weight": mx.arange(12, dtype=mx.bfloat16).reshape(3, 4)}
    b = {"head.weight": mx.ones((2, 4)), "head.bias": mx.zeros((2,), dtype=mx.float16)}
    save(model_dir / "model-00001-of-00002.safetensors", a)
    save(model_dir / "model-00002-of-00002.safetensors", b)
    write_index(
        model_dir,
        {
            "embed.weight": "model-00001-of-00002.safetensors",
            "head.weight": "model-00002-of-00002.safetensors",
            "head.bias": "model-00002-of-00002.safetensors",
        },
    )
    return {**a, **b}


# --- list_weight_files ---------------------------------------------------------


def test_without_an_index_every_safetensors_file_is_a_shard(tmp_path):
    save(tmp_path / "b.safetensors", {"x": mx.zeros(1)})
    save(tmp_path / "a.safetensors", {"y": mx.zeros(1)})
    (tmp_path / "notes.txt").write_text("not weights")
    assert list_weight_files(tmp_path) == [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]


def test_with_an_index_only_the_named_shards_are_listed(tmp_path):
    two_shard_model(tmp_path)
    save(tmp_path / "consolidated.safetensors", {"other": mx.zeros(1)})
    assert [p.name for p in list_weight_files(tmp_path)] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]


def test_index_naming_a_missing_shard_is_an_error(tmp_path):
    two_shard_model(tmp_path)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(WeightsError, match="model-00002-of-00002.safetensors") as info:
        list_weight_files(tmp_path)
    assert "re-download" in info.value.fix


def test_index_pointing_outside_the_directory_is_refused(tmp_path):
    write_index(tmp_path, {"w": "../elsewhere.safetensors"})
    with pytest.raises(WeightsError, match="not a plain file name"):
        list_weight_files(tmp_path)


def test_malformed_index_is_reported_with_line_and_column(tmp_path):
    (tmp_path / INDEX_FILE).write_text('{"weight_map": {\n  "w": oops}}')
    with pytest.raises(WeightsError, match="line 2, column 8"):
        list_weight_files(tmp_path)


def test_directory_without_weights_is_an_error(tmp_path):
    with pytest.raises(WeightsError, match=r"no \*\.safetensors"):
        list_weight_files(tmp_path)


# --- read_manifest -------------------------------------------------------------


def test_manifest_merges_every_shard_from_headers(tmp_path):
    two_shard_model(tmp_path)
    manifest = read_manifest(tmp_path)
    assert manifest == {
        "embed.weight": TensorInfo("BF16", (3, 4)),
        "head.weight": TensorInfo("F32", (2, 4)),
        "head.bias": TensorInfo("F16", (2,)),
    }
    assert manifest["head.bias"].file == tmp_path / "model-00002-of-00002.safetensors"


def test_a_tensor_in_two_shards_is_an_error_naming_both_files(tmp_path):
    save(tmp_path / "a.safetensors", {"w": mx.zeros(1)})
    save(tmp_path / "b.safetensors", {"w": mx.zeros(1)})
    with pytest.raises(WeightsError) as info:
        read_manifest(tmp_path)
    assert "a.safetensors" in str(info.value) and "b.safetensors" in str(info.value)


def test_a_shard_holding_a_tensor_the_index_puts_elsewhere_is_an_error(tmp_path):
    two_shard_model(tmp_path)
    save(
        tmp_path / "model-00001-of-00002.safetensors",
        {
            "embed.weight": mx.zeros((3, 4), dtype=mx.bfloat16),
            "head.bias": mx.zeros((2,), dtype=mx.float16),
        },
    )
    save(tmp_path / "model-00002-of-00002.safetensors", {"head.weight": mx.ones((2, 4))})
    with pytest.raises(WeightsError) as info:
        read_manifest(tmp_path)
    assert (
        "'head.bias' is in model-00001-of-00002.safetensors but the index assigns it to "
        "model-00002-of-00002.safetensors"
    ) in str(info.value)


def test_an_index_entry_whose_shard_lacks_the_tensor_is_an_error(tmp_path):
    two_shard_model(tmp_path)
    write_index(
        tmp_path,
        {
            "embed.weight": "model-00002-of-00002.safetensors",
            "head.weight": "model-00002-of-00002.safetensors",
            "head.bias": "model-00002-of-00002.safetensors",
            "lost.weight": "model-00001-of-00002.safetensors",
        },
    )
    with pytest.raises(WeightsError) as info:
        read_manifest(tmp_path)
    text = str(info.value)
    assert "'embed.weight' is in model-00001-of-00002.safetensors but the index assigns it" in text
    assert (
        "'lost.weight' is assigned to model-00001-of-00002.safetensors but that shard lacks it"
    ) in text


def test_a_shard_tensor_absent_from_the_index_is_an_error(tmp_path):
    two_shard_model(tmp_path)
    write_index(
        tmp_path,
        {
            "embed.weight": "model-00001-of-00002.safetensors",
            "head.weight": "model-00002-of-00002.safetensors",
        },
    )
    message = "'head.bias' is in model-00002-of-00002.safetensors but not in the index"
    with pytest.raises(WeightsError, match=message):
        read_manifest(tmp_path)


# --- load_weights --------------------------------------------------------------


def test_load_weights_returns_every_tensor_with_its_stored_dtype_and_values(tmp_path):
    saved = two_shard_model(tmp_path)
    loaded = load_weights(tmp_path)
    assert loaded.keys() == saved.keys()
    for name, array in saved.items():
        assert loaded[name].dtype == array.dtype
        assert mx.array_equal(loaded[name], array).item()


def test_load_weights_matches_mx_load_of_each_file(tmp_path):
    # mlx-lm loads with mx.load per file and merges; our path must give the same arrays.
    two_shard_model(tmp_path)
    reference: dict[str, mx.array] = {}
    for file in sorted(tmp_path.glob("model*.safetensors")):
        reference.update(mx.load(str(file)))
    ours = load_weights(tmp_path)
    assert ours.keys() == reference.keys()
    assert all(mx.array_equal(ours[k], reference[k]).item() for k in ours)


def test_a_hostile_header_is_refused_before_mx_load_is_called(tmp_path, monkeypatch):
    save(tmp_path / "good.safetensors", {"a": mx.zeros(2)})
    bad = tmp_path / "zbad.safetensors"
    bad.write_bytes((2**63).to_bytes(8, "little") + b"{}")
    calls: list[str] = []
    monkeypatch.setattr(weights_module.mx, "load", lambda *a, **k: calls.append(a[0]) or {})
    with pytest.raises(SafetensorsHeaderError, match="zbad.safetensors"):
        load_weights(tmp_path)
    assert calls == []


# --- check_weights -------------------------------------------------------------


MANIFEST = {
    "a": TensorInfo("BF16", (4, 8)),
    "b": TensorInfo("F32", (8,)),
    "c": TensorInfo("U32", (4, 1)),
}


def test_an_exact_match_passes(tmp_path):
    check_weights(MANIFEST, {"a": ((4, 8), "BF16"), "b": ([8], mx.float32), "c": ((4, 1), None)})


def test_every_kind_of_mismatch_is_reported_in_one_error():
    expected = {
        "a": ((4, 9), "BF16"),  # wrong shape
        "b": ((8,), mx.float16),  # wrong dtype
        "d": ((1,), "F32"),  # missing
    }  # "c" is unexpected
    with pytest.raises(WeightsError) as info:
        check_weights(MANIFEST, expected, source="ckpt")
    text = str(info.value)
    assert "ckpt: " in text
    assert "1 missing, 1 unexpected, 1 wrong shape, 1 wrong dtype" in text
    assert "missing (1): d" in text
    assert "unexpected (1): c" in text
    assert "a (4, 8) (expected (4, 9))" in text
    assert "b F32 (expected float16)" in text
    assert info.value.fix


def test_long_lists_are_capped_with_a_count():
    expected = {f"layer.{i:02d}": ((1,), "F32") for i in range(25)}
    with pytest.raises(WeightsError) as info:
        check_weights({}, expected)
    text = str(info.value)
    assert "25 missing" in text
    assert "layer.09" in text and "layer.10" not in text
    assert "(15 more)" in text


def test_non_strict_check_ignores_unexpected_tensors_only():
    check_weights(MANIFEST, {"a": ((4, 8), "BF16")}, strict=False)
    with pytest.raises(WeightsError, match="missing"):
        check_weights(MANIFEST, {"z": ((1,), "F32")}, strict=False)


def test_loaded_arrays_are_checked_like_a_manifest():
    arrays = {"a": mx.zeros((2, 3), dtype=mx.bfloat16)}
    check_weights(arrays, {"a": ((2, 3), "BF16")})
    check_weights(arrays, {"a": ((2, 3), mx.bfloat16)})
    with pytest.raises(WeightsError, match="wrong dtype"):
        check_weights(arrays, {"a": ((2, 3), "F16")})


def test_fp8_codes_match_the_uint8_mlx_loads_them_as_but_not_the_u8_code():
    manifest = {"w": TensorInfo("F8_E4M3", (4,))}
    check_weights(manifest, {"w": ((4,), mx.uint8)})
    with pytest.raises(WeightsError, match="w F8_E4M3 \\(expected U8\\)"):
        check_weights(manifest, {"w": ((4,), "U8")})
