"""The tiny Llama config of the MiniCPM5 tests, and its checkpoints written by mlx-lm's class.

Checkpoints come from the core's parity harness (:mod:`mlx_loom.testing.parity`):
weights shaped by mlx-lm's own ``llama`` model, stored in Hugging Face layout.
Imported by name (conftest puts this folder on ``sys.path``); the name is
unique so it cannot clash with another plugin's helpers.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlx_loom.testing import parity

# head_dim 32 is deliberately not hidden/heads (16): q_proj is 64 -> 128.
TINY: dict[str, Any] = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 256,
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
}


def write_tiny(
    path: Path,
    *,
    dtype: mx.Dtype = mx.float32,
    seed: int = 0,
    edit: Callable[[dict[str, mx.array]], None] | None = None,
    **overrides: Any,
) -> Path:
    """A Hugging Face-layout checkpoint of ``TINY | overrides``; ``edit`` may change its tensors."""

    def to_hf(weights: dict[str, mx.array]) -> dict[str, mx.array]:
        if edit is not None:
            edit(weights)
        return weights

    cfg = copy.deepcopy(TINY) | overrides
    return parity.write_hf_checkpoint(path, cfg, dtype=dtype, seed=seed, to_hf=to_hf)
