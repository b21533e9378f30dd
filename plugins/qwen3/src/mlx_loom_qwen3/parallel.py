"""How the Qwen3 graphs split across processes: by heads and MLP columns, or by layers.

Tensor parallel: each rank runs a slice of every layer's query heads, the
key/value heads those queries read (one whole key/value head per rank when
there are fewer key/value heads than ranks) and the per-head query/key norms
on whole heads; ``o_proj`` sums the partial products. A dense MLP splits by
hidden units. A routed block keeps every expert on every rank with a slice of
each expert's width (the router is replicated, so every rank routes each
token alike) and sums once, at the block's output, after the scores have
weighted the partial rows. Pipeline parallel: contiguous layer ranges. Both
split the embedding and the head by vocabulary rows.
"""

from __future__ import annotations

from mlx_loom.parallel import (
    ParallelPlan,
    Pipeline,
    Reduce,
    Rule,
    Units,
    Vocab,
    attention,
    gated_mlp,
    switch_glu,
)

from .config import Qwen3Config, Qwen3MoeConfig


def _mlps(cfg: Qwen3Config) -> tuple[Rule, ...]:
    dense = Units("intermediate_size", cfg.intermediate_size)
    if not isinstance(cfg, Qwen3MoeConfig):
        return gated_mlp("model.layers.*.mlp", dense)
    width = Units("moe_intermediate_size", cfg.moe_intermediate_size)
    rules: list[Rule] = []
    for i in range(cfg.num_hidden_layers):
        mlp = f"model.layers.{i}.mlp"
        if cfg.mlp_kind(i) == "dense":
            rules += gated_mlp(mlp, dense)
        else:
            rules += [*switch_glu(f"{mlp}.switch_mlp", width), Reduce(mlp)]
    return tuple(rules)


def plan(cfg: Qwen3Config) -> ParallelPlan:
    heads = Units("num_attention_heads", cfg.num_attention_heads)
    kv_heads = Units("num_key_value_heads", cfg.num_key_value_heads, replicable=True)
    return ParallelPlan(
        vocab=Vocab(
            embeddings=("model.embed_tokens",),
            head=None if cfg.tie_word_embeddings else "lm_head",
        ),
        tensor=(
            *attention("model.layers.*.self_attn", heads=heads, kv_heads=kv_heads),
            *_mlps(cfg),
        ),
        pipeline=Pipeline(layers="model.layers"),
    )
