"""The prefill chunk a request gets when nobody sets one: 512 where the native
CPU kernels run, mlx-lm's 2048 on MLX's own operations — decided in one place
(``prefill_step_for``) and changing no result on the native path."""

from __future__ import annotations

import mlx.core as mx
import pytest

import mlx_loom
from mlx_loom.engine import Engine, EngineSettings
from mlx_loom.engine.settings import (
    DEFAULT_PREFILL_STEP,
    NATIVE_CPU_PREFILL_STEP,
    prefill_step_for,
)
from mlx_loom.generation.loop import generate_tokens
from mlx_loom.testing.checkpoints import write_checkpoint

from .conftest import ids, request


@pytest.mark.parametrize(
    ("kernels", "step"),
    [
        ("cpu-native", NATIVE_CPU_PREFILL_STEP),
        ("cpu-native-int8-act", NATIVE_CPU_PREFILL_STEP),
        ("cpu-ops", DEFAULT_PREFILL_STEP),
        (None, DEFAULT_PREFILL_STEP),  # Metal, CUDA: no CPU kernel set
    ],
)
def test_the_default_chunk_follows_the_kernel_set(kernels, step):
    assert prefill_step_for(kernels) == step


@pytest.mark.parametrize(("kernels", "step"), [("cpu-native", 512), ("cpu-ops", 2048)])
def test_a_request_without_a_chunk_gets_the_models_and_one_that_sets_it_keeps_it(
    checkpoints, kernels, step
):
    model, _ = mlx_loom.load(checkpoints("llama"), cpu_kernels=kernels)
    engine = Engine(model)
    assert engine._step(request(model, prompt=ids(4, 0))) == step
    assert engine._step(request(model, prompt=ids(4, 0), prefill_step_size=64)) == 64
    pinned = Engine(model, EngineSettings(prefill_step_size=300))
    assert pinned._step(request(model, prompt=ids(4, 0))) == 300


@pytest.mark.parametrize(
    # full attention, a rotating window, recurrent state with routed experts,
    # a rotating window with KV-shared layers (Gemma 4's dense MLP: its tiny
    # experts would see chunks of at most 32 rows, below)
    ("model_type", "overrides"),
    [
        ("llama", {}),
        ("llama", {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 6}),
        ("qwen3_next", {}),
        ("gemma4_text", {"enable_moe_block": False}),
    ],
)
def test_the_native_default_chunk_gives_the_tokens_of_one_whole_chunk(
    tmp_path, model_type, overrides
):
    """A prompt of 1100 tokens, prefilled in the default 512-token chunks
    (512 + 512 + 76) and in one 2048-token chunk: the same greedy tokens and
    the same log-probabilities bit for bit, for every cache kind (the native
    GEMM and attention compute every row on its own, a recurrence goes token
    by token). A chunk of at most 32 rows takes the matrix-vector kernel,
    which sums in another order (docs/cpu.md), at any chunk size."""
    claim = mlx_loom.default_host().registry.model_types[model_type]
    # The tiny checkpoint with room for the prompt.
    config = {**claim.tiny_config, "max_position_embeddings": 2048, **overrides}
    path = write_checkpoint(tmp_path / "ckpt", config, claim.checkpoint_tensors(config))
    model, _ = mlx_loom.load(path, cpu_kernels="cpu-native")
    prompt = ids(1100, 7)

    def run(step):
        out = generate_tokens(
            model, prompt, sampler=lambda lp: mx.argmax(lp, -1), max_tokens=6,
            prefill_step_size=step,
        )
        return [(t, lp.tolist()) for t, lp in out]

    assert run(None) == run(2048)
