"""A model built on one thread runs on another (the server builds on the main thread and
generates on its own): nothing the graph keeps may be left unevaluated on the builder's stream."""

from __future__ import annotations

import threading

import mlx.core as mx
import pytest

import mlx_loom
from mlx_loom.testing.checkpoints import write_checkpoint

FAMILIES = ["llama", "qwen3_next", "qwen3_5", "gemma4_text", "gemma4"]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_a_model_loaded_here_runs_a_forward_on_another_thread(model_type, tmp_path):
    claim = mlx_loom.default_host().registry.model_types[model_type]
    path = write_checkpoint(
        tmp_path / "ckpt", claim.tiny_config, claim.checkpoint_tensors(claim.tiny_config)
    )
    model, _ = mlx_loom.load(path)
    outcome: list = []

    def run() -> None:
        try:
            logits = model(mx.array([[1, 2, 3]]), cache=model.make_cache())
            mx.eval(logits)
            outcome.append(logits)
        except Exception as err:  # reported below, on the test's thread
            outcome.append(err)
        finally:
            mx.synchronize()
            mx.clear_streams()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)
    assert not isinstance(outcome[0], Exception), outcome[0]
    # The first forward ran there; this thread gets the same logits.
    assert mx.array_equal(outcome[0], model(mx.array([[1, 2, 3]]), cache=model.make_cache()))
