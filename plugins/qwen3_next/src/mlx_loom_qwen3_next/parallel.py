"""How the hybrid graphs split across processes.

Tensor parallel, per layer kind:

* gated attention — query heads (each head's query and output gate sit side
  by side in ``q_proj``, so whole heads split cleanly), the key/value heads
  they read, and ``o_proj``'s inputs, summed there;
* gated delta net — whole *key* heads per rank, and with each key head the
  value heads it serves (``linear_num_value_heads`` is a multiple of
  ``linear_num_key_heads``). The fused ``in_proj_qkvz``/``in_proj_ba`` are
  laid out per key head, so a contiguous block of rows is a block of heads;
  Qwen3.5's ``in_proj_qkv`` and the causal convolution's channels stack q, k
  and v, so each of the three splits on its own. The recurrence runs per
  head, so each rank's state holds its heads alone; ``out_proj`` sums;
* MLP — hidden units; a sparse MoE block keeps every expert on every rank
  (the router is replicated, so all ranks route alike) with a slice of each
  expert's and the shared expert's width, and sums once, at the block's
  output, where the routed and shared partial sums meet.

Pipeline parallel: contiguous layer ranges (attention and delta-net layers
alike). Both split the embedding and head by vocabulary rows.
"""

from __future__ import annotations

from mlx_loom.parallel import (
    ParallelPlan,
    Pipeline,
    Reduce,
    Resize,
    Rule,
    Segment,
    Split,
    Units,
    Vocab,
    attention,
    gated_mlp,
    switch_glu,
)
from mlx_loom_qwen3_next.config import HybridConfig, Qwen3NextConfig


def _delta_net(cfg: HybridConfig, key_heads: Units, value_heads: Units) -> tuple[Rule, ...]:
    la = "model.layers.*.linear_attn"
    qkv = (
        Segment(key_heads, cfg.key_dim),
        Segment(key_heads, cfg.key_dim),
        Segment(value_heads, cfg.value_dim),
    )
    if isinstance(cfg, Qwen3NextConfig):
        projections: tuple[Rule, ...] = (
            Split(f"{la}.in_proj_qkvz", key_heads),
            Split(f"{la}.in_proj_ba", key_heads),
        )
    else:
        projections = (
            Split(f"{la}.in_proj_qkv", qkv),
            Split(f"{la}.in_proj_z", value_heads),
            Split(f"{la}.in_proj_b", value_heads),
            Split(f"{la}.in_proj_a", value_heads),
        )
    return (
        *projections,
        Split(f"{la}.conv1d.weight", qkv, axis=0),
        Split(f"{la}.dt_bias", value_heads, axis=0),
        Split(f"{la}.A_log", value_heads, axis=0),
        Split(f"{la}.out_proj", value_heads, dim="in", reduce=True),
        Resize(
            la,
            {
                "n_k_heads": key_heads,
                "n_v_heads": value_heads,
                "key_dim": key_heads,
                "value_dim": value_heads,
                # q, k and v channels all scale by the same 1/size.
                "conv_dim": key_heads,
            },
        ),
    )


def _mlps(cfg: HybridConfig) -> tuple[Rule, ...]:
    rules: list[Rule] = []
    for i in range(cfg.num_hidden_layers):
        mlp = f"model.layers.{i}.mlp"
        if cfg.mlp_kind(i) == "dense":
            rules += gated_mlp(mlp, Units("intermediate_size", cfg.intermediate_size))
            continue
        rules += switch_glu(
            f"{mlp}.switch_mlp", Units("moe_intermediate_size", cfg.moe_intermediate_size)
        )
        shared = Units("shared_expert_intermediate_size", cfg.shared_expert_intermediate_size)
        rules += gated_mlp(f"{mlp}.shared_expert", shared, reduce=False)
        rules.append(Reduce(mlp))
    return tuple(rules)


def plan(cfg: HybridConfig) -> ParallelPlan:
    heads = Units("num_attention_heads", cfg.num_attention_heads)
    kv_heads = Units("num_key_value_heads", cfg.num_key_value_heads, replicable=True)
    key_heads = Units("linear_num_key_heads", cfg.linear_num_key_heads)
    value_heads = Units("linear_num_value_heads", cfg.linear_num_value_heads)
    return ParallelPlan(
        vocab=Vocab(
            embeddings=("model.embed_tokens",),
            head=None if cfg.tie_word_embeddings else "lm_head",
        ),
        tensor=(
            *attention("model.layers.*.self_attn", heads=heads, kv_heads=kv_heads),
            *_delta_net(cfg, key_heads, value_heads),
            *_mlps(cfg),
        ),
        pipeline=Pipeline(layers="model.layers"),
    )
