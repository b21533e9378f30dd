"""A Llama, Mistral or Ministral 3 checkpoint in, the graph with its lazy weights out, strictly.

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
The Mistral 3 wrapper's layouts (``model.language_model.*``, mlx-lm's
``language_model.model.*``, the vision tower) are mapped by the core's config
view before :func:`sanitize` sees the tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from mlx_loom.nn import Entry, graph_checkpoint_tensors, load_checkpoint
from mlx_loom.plugin import BuildContext, WeightsError

from .config import MiniCPM5Config, Ministral3Config, Mistral3Config, MistralConfig
from .graph import Model

T = TypeVar("T")


def sanitize(weights: Mapping[str, T], cfg: MiniCPM5Config) -> dict[str, T]:
    """Drop tensors Hugging Face may store that the graph does not read."""
    fp8 = sorted(k for k in weights if k.endswith(".weight_scale_inv"))
    if fp8:
        # mlx-lm multiplies FP8 weights by these scales at load; this loader
        # reads floats and MLX-quantized weights only, and never guesses.
        raise WeightsError(
            f"the checkpoint stores FP8 weights with block scales ({fp8[0]} and "
            f"{len(fp8) - 1} more), which this plugin does not load",
            fix="use the checkpoint's BF16 release, or convert it with mlx_lm.convert "
            "(optionally -q) and load the result",
        )
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


#: The schema of each model type this graph serves (``mistral3``: its ``text_config``).
SCHEMAS: dict[str, type[MiniCPM5Config]] = {
    "llama": MiniCPM5Config,
    "mistral": MistralConfig,
    "ministral3": Ministral3Config,
    "mistral3": Mistral3Config,
}


def _validate(config: Mapping[str, Any]) -> MiniCPM5Config:
    if config.get("model_type") == "mistral3":
        return Mistral3Config.model_validate(config.get("text_config") or {})
    return SCHEMAS.get(str(config.get("model_type")), MiniCPM5Config).model_validate(config)


def _hf_names(manifest: list[tuple[str, Entry]], cfg: MiniCPM5Config) -> list[tuple[str, Entry]]:
    """The Mistral 3 wrapper stores the text model under ``model.language_model.``."""
    if not isinstance(cfg, Mistral3Config):
        return manifest
    return [
        ("model.language_model." + n.removeprefix("model.") if n.startswith("model.") else n, e)
        for n, e in manifest
    ]


#: The Hugging Face-layout tensors of an unquantized checkpoint for a config
#: (what the conformance kit writes): the graph's own, as the names agree.
checkpoint_tensors = graph_checkpoint_tensors(_validate, Model, to_checkpoint=_hf_names)
