"""How the Llama graph splits across processes: by heads and MLP columns, or by layers.

Tensor parallel: each rank runs a slice of every layer's query heads, the
key/value heads those queries read (one whole key/value head per rank when
there are fewer key/value heads than ranks, which grouped-query attention
allows) and a slice of the MLP's hidden units; the output projections sum
the partial products (:mod:`mlx_loom.parallel`). Pipeline parallel: each
rank runs a contiguous range of layers. Both split the embedding and the
head by vocabulary rows.
"""

from __future__ import annotations

from mlx_loom.parallel import ParallelPlan, Pipeline, Units, Vocab, attention, gated_mlp

from .config import MiniCPM5Config


def plan(cfg: MiniCPM5Config) -> ParallelPlan:
    heads = Units("num_attention_heads", cfg.num_attention_heads)
    kv_heads = Units("num_key_value_heads", cfg.num_key_value_heads, replicable=True)
    hidden = Units("intermediate_size", cfg.intermediate_size)
    return ParallelPlan(
        vocab=Vocab(
            embeddings=("model.embed_tokens",),
            head=None if cfg.tie_word_embeddings else "lm_head",
        ),
        tensor=(
            *attention("model.layers.*.self_attn", heads=heads, kv_heads=kv_heads),
            *gated_mlp("model.layers.*.mlp", hidden),
        ),
        pipeline=Pipeline(layers="model.layers"),
    )
