"""A Hugging Face Llama checkpoint in, the graph with its (lazy) weights out — strictly.

The graph uses Hugging Face's tensor names, so :func:`sanitize` only drops
what the checkpoint stores but the graph does not read. The core's strict
loader compares the result with :func:`~.manifest.tensors` before the graph
exists: any difference (a missing layer, a stray tensor, a ``q_proj`` whose
shape contradicts ``num_attention_heads * head_dim``) is one ``WeightsError``
listing all of them. Float tensors must all share the final norm's dtype:
tensors load in the dtype they are stored in, so a checkpoint mixing float
dtypes would compute in whichever dtype promotion picks; it is refused instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

from mlx_loom.nn import load_checkpoint
from mlx_loom.plugin import BuildContext

from .config import MiniCPM5Config
from .graph import Model
from .manifest import tensors

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
        manifest=tensors(cfg),
        build=lambda: Model(cfg),
        sanitize=lambda weights: sanitize(weights, cfg),
        uniform_dtype_of="model.norm.weight",
    )
