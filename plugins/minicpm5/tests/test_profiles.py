"""Registration and profile resolution: the MiniCPM5-1B exact profile versus the family profile."""

from __future__ import annotations

import json
import math
import struct

from mlx_loom.artifacts import TensorInfo, artifact_fingerprint, config_fingerprint
from mlx_loom.host import PluginHost, resolve_model
from mlx_loom.host._profiles import validate_profile
from mlx_loom_minicpm5 import checkpoint_tensors, plugin
from mlx_loom_minicpm5.config import FINGERPRINT_FIELDS, MiniCPM5Config

# The published openbmb/MiniCPM5-1B geometry (see plugin.py for where each number comes from).
MINICPM5_1B = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 1536,
    "intermediate_size": 4608,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "vocab_size": 130560,
    "tie_word_embeddings": False,
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
}
_ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4}


def headers_only_checkpoint(directory, config, dtype="BF16"):
    """config.json plus a safetensors file whose data section is a sparse hole.

    Resolution reads headers only, so a 2 GB checkpoint costs a few KB on disk.
    """
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    manifest = checkpoint_tensors(config, dtype)
    header, offset = {}, 0
    for name, (shape, code) in sorted(manifest.items()):
        size = math.prod(shape) * _ITEMSIZE[code]
        header[name] = {
            "dtype": code,
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path = directory / "model.safetensors"
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(blob)) + blob)
        fh.truncate(8 + len(blob) + offset)
    return directory


def test_plugin_is_discovered_through_its_entry_point():
    host = PluginHost()
    assert host.record("minicpm5").status == "loaded"
    assert host.registry.model_type("llama").schema is MiniCPM5Config
    assert {p.id for p in host.registry.profiles} >= {"minicpm5/llama", "minicpm5/minicpm5-1b"}


def test_profiles_pass_the_core_validation_rules():
    for profile in plugin.FAMILY.registrations().profiles:
        validate_profile(profile)


def test_exact_profile_fingerprints_derive_from_the_published_geometry():
    cfg = MiniCPM5Config.model_validate(MINICPM5_1B)
    manifest = {
        name: TensorInfo(dtype=code, shape=tuple(shape))
        for name, (shape, code) in checkpoint_tensors(cfg, "BF16").items()
    }
    # The published parameter count, to the unit.
    assert sum(info.numel for info in manifest.values()) == 1_080_632_832
    profile = plugin.MINICPM5_1B_PROFILE
    assert profile.artifact_fingerprint == artifact_fingerprint(manifest)
    assert profile.config_fingerprint == config_fingerprint(
        {f: MINICPM5_1B.get(f) for f in FINGERPRINT_FIELDS}
    )


def test_minicpm5_1b_checkpoint_resolves_to_the_exact_profile(tmp_path):
    resolved = resolve_model(headers_only_checkpoint(tmp_path / "1b", MINICPM5_1B))
    assert resolved.summary.profile == "minicpm5/minicpm5-1b"
    assert resolved.summary.implementation == "minicpm5.llama"
    assert "exact-artifact" in resolved.summary.profile_reason


def test_same_geometry_in_another_dtype_resolves_to_the_family_profile(tmp_path):
    resolved = resolve_model(headers_only_checkpoint(tmp_path / "fp16", MINICPM5_1B, "F16"))
    assert resolved.summary.profile == "minicpm5/llama"


def test_tiny_llama_resolves_to_the_family_profile(make_checkpoint):
    resolved = resolve_model(make_checkpoint())
    assert resolved.summary.profile == "minicpm5/llama"
    assert "exact-artifact profiles exist but their fingerprints differ" in (
        resolved.summary.profile_reason
    )
