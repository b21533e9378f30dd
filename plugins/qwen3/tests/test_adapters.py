"""Adapters: ``mlx_loom.load(base, adapter_path=...)`` equals mlx-lm's load of the same pair.

A LoRA adapter written by mlx-lm's own tuner on every layer — the attention
and dense projections and, on ``qwen3_moe``, the router and the stacked
expert projections — gives bit-equal logits at the prompt and every greedy
step on the oracle's arithmetic, on a 4-bit base.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm import load as lm_load
from mlx_lm.models import cache as lm_cache
from qwen3_testkit import PROMPT, STEPS, write_checkpoint, write_lora

import mlx_loom
from mlx_loom.testing import parity


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_lora_on_every_layer_matches_mlx_lm(tmp_path, model_type):
    base = write_checkpoint(tmp_path / "base", model_type, "mlx-q4")
    adapter = write_lora(base, tmp_path / "lora")
    ours = mlx_loom.load(base, adapter_path=adapter, compute_dtype="checkpoint",
                         cpu_kernels="cpu-ops")[0]
    theirs = lm_load(str(base), adapter_path=str(adapter))[0]
    if model_type == "qwen3_moe":
        assert any(".switch_mlp." in p for p in ours.adapter.modules), ours.adapter.modules
    x = mx.array([PROMPT])
    plain = mlx_loom.load(base, compute_dtype="checkpoint", cpu_kernels="cpu-ops")[0]
    assert not mx.array_equal(ours(x), plain(x)), "the adapter changed nothing"
    parity.assert_same_run(
        parity.greedy(ours, x, ours.make_cache(), steps=STEPS),
        parity.greedy(theirs, x, lm_cache.make_prompt_cache(theirs), steps=STEPS),
    )
