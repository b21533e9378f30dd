"""Every tensor a Llama checkpoint holds, from the config alone: the family's one tensor rule.

The graph uses Hugging Face's names, so the rule is also the Hugging Face
layout: the strict loader compares checkpoints with it, and the conformance
kit writes tiny checkpoints from it (``checkpoint_tensors``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from mlx_loom.nn import Entry, Matrix, Tensor, dense_tensors

from .config import MiniCPM5Config


def tensors(cfg: MiniCPM5Config) -> Iterator[tuple[str, Entry]]:
    """The graph's tensors, layer by layer (a generator: the loader may stop early)."""
    D, inter, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim  # type: ignore[operator]
    ab, mb = cfg.attention_bias, cfg.mlp_bias
    yield "model.embed_tokens", Matrix((V, D))
    for i in range(cfg.num_hidden_layers):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        yield f"{attn}.q_proj", Matrix((q, D), ab)
        yield f"{attn}.k_proj", Matrix((kv, D), ab)
        yield f"{attn}.v_proj", Matrix((kv, D), ab)
        yield f"{attn}.o_proj", Matrix((D, q), ab)
        yield f"{mlp}.gate_proj", Matrix((inter, D), mb)
        yield f"{mlp}.up_proj", Matrix((inter, D), mb)
        yield f"{mlp}.down_proj", Matrix((D, inter), mb)
        yield f"model.layers.{i}.input_layernorm.weight", Tensor((D,))
        yield f"model.layers.{i}.post_attention_layernorm.weight", Tensor((D,))
    yield "model.norm.weight", Tensor((D,))
    if not cfg.tie_word_embeddings:
        yield "lm_head", Matrix((V, D))


def checkpoint_tensors(
    config: Mapping[str, Any] | MiniCPM5Config, dtype: str = "F32"
) -> dict[str, tuple[tuple[int, ...], str]]:
    """The Hugging Face-layout tensors of an unquantized checkpoint for ``config``."""
    cfg = config if isinstance(config, MiniCPM5Config) else MiniCPM5Config.model_validate(config)
    return dense_tensors(tensors(cfg), dtype)
