"""Qwen3-Next and Qwen3.5 for mlx-loom: gated delta nets interleaved with gated attention.

Two graphs share one set of modules: ``qwen3_next`` (fused ``in_proj_qkvz`` /
``in_proj_ba`` projections, sparse MoE with a shared expert beside dense
layers) and ``qwen3_5`` (separate ``in_proj_qkv``/``z``/``b``/``a``, dense MLP
or MoE on every layer). The linear-attention layers keep their state in
:class:`mlx_loom.cache.recurrent.RecurrentCache`.
"""

from mlx_loom_qwen3_next.config import Qwen3NextConfig

__all__ = ["Qwen3NextConfig"]
