"""Specification of the artifact and config fingerprints."""

from __future__ import annotations

import hashlib
import json
import re

import mlx.core as mx
import pytest

from mlx_loom.artifacts import TensorInfo, artifact_fingerprint, config_fingerprint, read_manifest
from mlx_loom.errors import ConfigError

SHA = re.compile(r"^sha256:[0-9a-f]{64}$")
MANIFEST = {"b.weight": TensorInfo("BF16", (4, 8)), "a.scales": TensorInfo("F32", (4, 1))}


def test_artifact_fingerprint_is_sha256_of_the_sorted_name_dtype_shape_rows():
    rows = [["a.scales", "F32", [4, 1]], ["b.weight", "BF16", [4, 8]]]
    expected = hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()
    assert artifact_fingerprint(MANIFEST) == f"sha256:{expected}"
    assert SHA.match(artifact_fingerprint(MANIFEST))


def test_artifact_fingerprint_ignores_key_order_sharding_and_values(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    mx.save_safetensors(
        str(one / "model.safetensors"), {"x": mx.zeros((2, 3)), "y": mx.zeros((5,), dtype=mx.int32)}
    )
    mx.save_safetensors(str(two / "a.safetensors"), {"y": mx.full((5,), 7, dtype=mx.int32)})
    mx.save_safetensors(str(two / "b.safetensors"), {"x": mx.random.normal((2, 3))})
    assert artifact_fingerprint(read_manifest(one)) == artifact_fingerprint(read_manifest(two))


@pytest.mark.parametrize(
    "changed",
    [
        {"b.weight": TensorInfo("F16", (4, 8)), "a.scales": TensorInfo("F32", (4, 1))},
        {"b.weight": TensorInfo("BF16", (8, 4)), "a.scales": TensorInfo("F32", (4, 1))},
        {"c.weight": TensorInfo("BF16", (4, 8)), "a.scales": TensorInfo("F32", (4, 1))},
        {"b.weight": TensorInfo("BF16", (4, 8))},
    ],
    ids=["dtype", "shape", "name", "missing tensor"],
)
def test_artifact_fingerprint_changes_with_any_geometry_change(changed):
    assert artifact_fingerprint(changed) != artifact_fingerprint(MANIFEST)


def test_loaded_arrays_fingerprint_like_their_manifest():
    arrays = {"b.weight": mx.zeros((4, 8), dtype=mx.bfloat16), "a.scales": mx.zeros((4, 1))}
    assert artifact_fingerprint(arrays) == artifact_fingerprint(MANIFEST)


def test_config_fingerprint_is_sha256_of_canonical_json():
    fields = {"num_layers": 2, "hidden_size": 64, "layer_types": ("full", "linear")}
    canonical = '{"hidden_size":64,"layer_types":["full","linear"],"num_layers":2}'
    assert config_fingerprint(fields) == "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def test_config_fingerprint_ignores_key_order_but_not_values():
    a = config_fingerprint({"x": 1, "y": [1, 2]})
    assert a == config_fingerprint({"y": [1, 2], "x": 1})
    assert a != config_fingerprint({"x": 1, "y": [2, 1]})
    assert a != config_fingerprint({"x": 1.5, "y": [1, 2]})
    assert SHA.match(a)


def test_config_fingerprint_refuses_values_that_are_not_json_naming_the_field():
    with pytest.raises(ConfigError, match=r"\['dtype'\]"):
        config_fingerprint({"hidden_size": 8, "dtype": mx.float16})
    with pytest.raises(ConfigError, match=r"\['eps'\]"):
        config_fingerprint({"eps": float("nan")})
