"""A model loaded on one thread generates on another, for every family.

MLX binds a lazy array to the stream of the thread that built it; the server
loads on the main thread and generates on its worker thread. Every array a
graph holds — parameters and the private ones (precomputed RoPE frequencies)
— must therefore be evaluated by ``load``.
"""

from __future__ import annotations

import threading

import pytest

import mlx_loom
from mlx_loom.testing.checkpoints import write_checkpoint

FAMILIES = ["llama", "qwen3_next", "qwen3_5", "gemma4_text", "gemma4"]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_generation_on_another_thread_than_the_load(model_type, tmp_path):
    claim = mlx_loom.default_host().registry.model_types[model_type]
    path = write_checkpoint(
        tmp_path / "ckpt", claim.tiny_config, claim.checkpoint_tensors(claim.tiny_config)
    )
    model, tokenizer = mlx_loom.load(path)
    outcome: list = []

    def run() -> None:
        import mlx.core as mx

        try:
            outcome.append(mlx_loom.generate(model, tokenizer, "the cat", max_tokens=4))
        except Exception as err:  # reported below, with its message
            outcome.append(err)
        finally:
            mx.clear_streams()  # a thread that used MLX destroys its streams before exiting

    worker = threading.Thread(target=run)
    worker.start()
    worker.join(60)
    assert outcome == [mlx_loom.generate(model, tokenizer, "the cat", max_tokens=4)]
