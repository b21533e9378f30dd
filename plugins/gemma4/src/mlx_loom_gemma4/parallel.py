"""How the Gemma 4 and Gemma 3 text graphs split across processes.

Tensor parallel, layer by layer (the kinds differ in head width and, with
``attention_k_eq_v``, in key/value heads): query heads, the key/value heads
they read (one whole head per rank when there are fewer than ranks), and
``o_proj``'s inputs, summed there. A KV-shared layer splits its query heads
exactly as its donor does, so on every rank it reads the donor's keys and
values for the same heads. The dense GeGLU MLP splits by hidden units and
sums at ``down_proj`` (its output is normed next, so it must be whole); the
expert block keeps every expert with a slice of each one's width and sums at
its output. The router, the per-layer-input gate and projection and every
norm stay whole on every rank (small, and the per-layer input's norm needs
the whole vector).

Pipeline parallel: contiguous layer ranges, except that a stage boundary
never falls between a KV donor and the layers that read it — those read the
donor's cache, which lives on the donor's rank. With deep KV sharing the
last stage therefore holds more layers.

Both split the token embedding (tied: also the head) and the per-layer
embedding table by vocabulary rows.
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
from mlx_loom_gemma4.config import Gemma3TextConfig, Gemma4TextConfig


def _layer(cfg: Gemma4TextConfig, i: int) -> tuple[Rule, ...]:
    kind, p = cfg.kinds[i], f"model.layers.{i}"
    global_kv = cfg.k_eq_v_for(kind) and cfg.num_global_key_value_heads is not None
    kv_field = "num_global_key_value_heads" if global_kv else "num_key_value_heads"
    kv = () if cfg.is_shared(i) else ("k_proj",) if cfg.k_eq_v_for(kind) else ("k_proj", "v_proj")
    rules: tuple[Rule, ...] = (
        *attention(
            f"{p}.self_attn",
            heads=Units("num_attention_heads", cfg.num_attention_heads),
            kv_heads=Units(kv_field, cfg.kv_heads_for(kind), replicable=True),
            kv=kv,
        ),
        *gated_mlp(f"{p}.mlp", Units("intermediate_size", cfg.intermediate_size)),
    )
    if cfg.enable_moe_block:
        width = Units("moe_intermediate_size", cfg.moe_intermediate_size)  # type: ignore[arg-type]
        rules += (*switch_glu(f"{p}.experts.switch_glu", width), Reduce(f"{p}.experts"))
    return rules


def plan(cfg: Gemma4TextConfig) -> ParallelPlan:
    n = cfg.num_hidden_layers
    keep: tuple[tuple[int, int], ...] = ()
    if cfg.num_kv_shared_layers:
        first_donor = min(cfg.kv_donor(i) for i in range(cfg.first_shared_layer, n))
        keep = ((first_donor, n),)
    tables: tuple[str, ...] = ("model.embed_tokens",)
    if cfg.per_layer_width:
        tables += ("model.embed_tokens_per_layer",)
    return ParallelPlan(
        vocab=Vocab(embeddings=tables, head=None if cfg.tie_word_embeddings else "lm_head"),
        tensor=tuple(rule for i in range(n) for rule in _layer(cfg, i)),
        pipeline=Pipeline(
            layers="model.layers",
            keep_together=keep,
            reason="KV-shared layers read their donor layer's cache",
            fields=("num_hidden_layers", "num_kv_shared_layers"),
        ),
    )


def plan_gemma3(cfg: Gemma3TextConfig) -> ParallelPlan:
    """Gemma 3: query heads and the key/value heads they read, the GeGLU by hidden units
    (summed at ``down_proj``, whose output is normed next); contiguous layer ranges."""
    p = "model.layers.*"
    return ParallelPlan(
        vocab=Vocab(
            embeddings=("model.embed_tokens",),
            head=None if cfg.tie_word_embeddings else "lm_head",
        ),
        tensor=(
            *attention(
                f"{p}.self_attn",
                heads=Units("num_attention_heads", cfg.num_attention_heads),
                kv_heads=Units("num_key_value_heads", cfg.num_key_value_heads, replicable=True),
            ),
            *gated_mlp(f"{p}.mlp", Units("intermediate_size", cfg.intermediate_size)),
        ),
        pipeline=Pipeline(layers="model.layers"),
    )
