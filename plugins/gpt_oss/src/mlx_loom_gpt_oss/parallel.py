"""How the gpt-oss graph splits across processes: by heads and expert width, or by layers.

Tensor parallel: each rank runs a slice of every layer's query heads (with
their sinks), the key/value heads those queries read, and a slice of every
expert's hidden width — every rank keeps every expert, and the router is
replicated, so all ranks route each token alike. The experts' ``down_proj``
leaves partial sums that meet once, at the MoE block's output; its
per-expert bias stays on rank 0 so the sum adds it once. Pipeline parallel:
contiguous layer ranges. Both split the embedding and the head by
vocabulary rows.
"""

from __future__ import annotations

from mlx_loom.parallel import (
    ParallelPlan,
    Pipeline,
    Reduce,
    Split,
    Units,
    Vocab,
    attention,
    switch_glu,
)

from .config import GptOssConfig


def plan(cfg: GptOssConfig) -> ParallelPlan:
    heads = Units("num_attention_heads", cfg.num_attention_heads)
    kv_heads = Units("num_key_value_heads", cfg.num_key_value_heads, replicable=True)
    hidden = Units("intermediate_size", cfg.intermediate_size)
    attn = "model.layers.*.self_attn"
    return ParallelPlan(
        vocab=Vocab(embeddings=("model.embed_tokens",), head="lm_head"),
        tensor=(
            *attention(attn, heads=heads, kv_heads=kv_heads),
            Split(f"{attn}.sinks", heads, axis=0),
            *switch_glu("model.layers.*.mlp.experts", hidden),
            Reduce("model.layers.*.mlp"),
        ),
        pipeline=Pipeline(layers="model.layers"),
    )
