"""The mlx-lm parity harness (``mlx_loom.testing.parity``) on a family other than the Llama one.

Gemma 4 (MoE experts fused in its Hugging Face layout, sliding and global
layers, KV sharing) in both layouts proves the harness is not Llama-shaped;
different weights on each side prove it can fail.
"""

from __future__ import annotations

import subprocess
import sys

import mlx.core as mx
import pytest

from mlx_loom.testing import parity

pytest.importorskip("mlx_loom_gemma4")
from mlx_loom_gemma4.plugin import TINY_TEXT_CONFIG  # noqa: E402

STEPS = 16


def gemma4_to_hf(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """mlx-lm's stacked ``switch_glu`` experts -> Hugging Face's fused ``gate_up_proj``."""
    out = {}
    for name, value in weights.items():
        if ".switch_glu." not in name:
            out[name] = value
            continue
        base = name.split(".switch_glu.")[0]
        if name.endswith("gate_proj.weight"):
            up = weights[f"{base}.switch_glu.up_proj.weight"]
            out[f"{base}.gate_up_proj"] = mx.concatenate([value, up], axis=-2)
        elif name.endswith("down_proj.weight"):
            out[f"{base}.down_proj"] = value
    return out


def test_the_testing_package_imports_without_mlx_lm():
    code = "import sys; sys.modules['mlx_lm'] = None; import mlx_loom.testing.parity"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_gemma4_hugging_face_layout_matches_mlx_lm(tmp_path):
    path = parity.write_hf_checkpoint(tmp_path / "hf", TINY_TEXT_CONFIG, to_hf=gemma4_to_hf)
    ours, _ = parity.compare_with_mlx_lm(path, steps=STEPS, chunks=(7, 5))
    assert len(ours.tokens[0]) == STEPS + 1


def test_gemma4_quantized_mlx_layout_matches_mlx_lm(tmp_path):
    path = parity.write_mlx_checkpoint(tmp_path / "q4", TINY_TEXT_CONFIG, bits=4, group_size=32)
    assert parity.load_ours(path).module.model.embed_tokens.weight.dtype == mx.uint32
    parity.compare_with_mlx_lm(path, steps=STEPS)


def test_different_weights_fail_the_comparison(tmp_path):
    write = parity.write_hf_checkpoint
    ours = parity.load_ours(write(tmp_path / "a", TINY_TEXT_CONFIG, seed=0, to_hf=gemma4_to_hf))
    oracle = parity.load_oracle(write(tmp_path / "b", TINY_TEXT_CONFIG, seed=1, to_hf=gemma4_to_hf))
    prompt = mx.array([list(parity.PROMPT)])
    mine = parity.greedy(ours, prompt, ours.make_cache(), steps=2)
    ref = parity.greedy(oracle, prompt, oracle.make_cache(), steps=2)
    with pytest.raises(AssertionError, match="differ"):
        parity.assert_same_run(mine, ref)
