"""A Hugging Face Llama checkpoint in, the graph with its (lazy) weights out — strictly.

The graph uses Hugging Face's tensor names, so :func:`sanitize` only drops
what the checkpoint stores but the graph does not read, and the tensor rule
is the graph itself: the core's strict loader reads the expected shapes from
the (lazily built) graph and compares the checkpoint with them before any
weight is attached. Any difference (a missing layer, a stray tensor, a
``q_proj`` whose shape contradicts ``num_attention_heads * head_dim``) is one
``WeightsError`` listing all of them; a layer count the checkpoint cannot
back is refused before the graph is built. Float tensors must all share the final norm's dtype:
tensors load in the dtype they are stored in, so a checkpoint mixing float
dtypes would compute in whichever dtype promotion picks; it is refused instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

from mlx_loom.nn import graph_checkpoint_tensors, load_checkpoint
from mlx_loom.plugin import BuildContext

from .config import MiniCPM5Config
from .graph import Model

T = TypeVar("T")


def sanitize(weights: Mapping[str, T], cfg: MiniCPM5Config) -> dict[str, T]:
    """Drop tensors Hugging Face may store that the graph does not read."""
    out = {k: v for k, v in weights.items() if not k.endswith("self_attn.rotary_emb.inv_freq")}
    if cfg.tie_word_embeddings:
        # Tied means lm_head *is* embed_tokens; transformers overwrites a stored
        # copy at load, so ignoring it here matches how the checkpoint is meant.
        out.pop("lm_head.weight", None)
    return out


def build(ctx: BuildContext) -> Model:
    """The implementation's factory: what :func:`mlx_loom.load` calls."""
    cfg = ctx.family_config
    assert isinstance(cfg, MiniCPM5Config)
    return load_checkpoint(
        ctx.model_dir,
        ctx.config,
        build=lambda: Model(cfg),
        layers=("model.layers", cfg.num_hidden_layers),
        sanitize=lambda weights: sanitize(weights, cfg),
        uniform_dtype_of="model.norm.weight",
    )


#: The Hugging Face-layout tensors of an unquantized checkpoint for a config
#: (what the conformance kit writes): the graph's own, as the names agree.
checkpoint_tensors = graph_checkpoint_tensors(MiniCPM5Config.model_validate, Model)
