"""The Llama graph MiniCPM5, Mistral and Ministral 3 run: pre-norm GQA attention, SwiGLU MLP.

Module and attribute names are the Hugging Face ones (``model.layers.0.self_attn.q_proj``),
so checkpoint tensors load by name with no renaming. The op graph is mlx-lm's
``llama`` op for op — the same fused attention, RoPE and RMSNorm calls, the
same compiled SwiGLU (``mlx_loom.nn.swiglu``), the same mask shortcuts — which
is what makes the bit-equal parity tests possible. Ministral 3 adds one step,
Llama 4's query scaling by position (:func:`llama4_query_scale`), as mlx-lm's
``ministral3`` does.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlx_loom.cache import (
    KVCache,
    RotatingKVCache,
    append_kv,
    create_attention_mask,
)
from mlx_loom.nn import AttentionGeometry, GatedMLP, make_rope, merge_heads, project, split_heads
from mlx_loom.parallel import SINGLE_STAGE, Stage

from .config import MiniCPM5Config


def llama4_query_scale(
    length: int, offset: int | mx.array, beta: float, original_max: int, dtype: mx.Dtype
) -> mx.array:
    """Per-position query factors ``1 + beta * log(1 + floor(pos / original_max))``.

    ``pos`` runs over the ``length`` new tokens from ``offset`` (one offset per
    row for batch caches). Shaped to multiply queries ``[B, heads, L, D]``:
    ``[L, 1]``, or ``[B, 1, L, 1]`` for per-row offsets. Computed in float32
    and cast to the activations' dtype, which is mlx-lm's arithmetic.
    """
    positions = mx.arange(length)
    if isinstance(offset, mx.array) and offset.ndim > 0:
        positions = positions + offset[:, None]
    else:
        positions = positions + offset
    factors = 1 + beta * mx.log(1 + mx.floor(positions / original_max))
    shaped = factors[:, None, :, None] if factors.ndim == 2 else factors[:, None]
    return shaped.astype(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: MiniCPM5Config, window: int | None = None) -> None:
        super().__init__()
        D, H, KV, hd = (
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        bias = cfg.attention_bias
        self.n_heads, self.n_kv_heads, self.scale = H, KV, hd**-0.5
        self.geometry = AttentionGeometry(H, KV, hd, window=window)
        self.q_proj = nn.Linear(D, H * hd, bias=bias)
        self.k_proj = nn.Linear(D, KV * hd, bias=bias)
        self.v_proj = nn.Linear(D, KV * hd, bias=bias)
        self.o_proj = nn.Linear(H * hd, D, bias=bias)
        self.rope = make_rope(
            hd,
            base=cfg.rope_theta,
            traditional=cfg.rope_traditional,
            scaling=cfg.rope_scaling,
            max_position_embeddings=cfg.max_position_embeddings,
        )

    def __call__(
        self, x: mx.array, mask: Any, cache: Any = None, q_scale: mx.array | None = None
    ) -> mx.array:
        q, k, v = project(x, self.q_proj, self.k_proj, self.v_proj)
        q = split_heads(q, self.n_heads)
        k = split_heads(k, self.n_kv_heads)
        v = split_heads(v, self.n_kv_heads)
        offset = cache.offset if cache is not None else 0  # an array for batch caches
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        if q_scale is not None:
            q = q * q_scale
        # The cache's view owns the attention arithmetic of its storage codec.
        out = append_kv(cache, k, v).attend(q, scale=self.scale, mask=mask)
        return self.o_proj(merge_heads(out))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: MiniCPM5Config, sliding: bool) -> None:
        super().__init__()
        self.sliding = sliding
        self.self_attn = Attention(cfg, cfg.sliding_window if sliding else None)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def __call__(
        self, x: mx.array, mask: Any, cache: Any = None, q_scale: mx.array | None = None
    ) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), mask, cache, q_scale)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    """Embeddings, decoder layers and the final norm (Hugging Face's ``model.*``).

    Split into pipeline stages, ``layers`` holds this rank's layers and
    ``stage`` hands activations between ranks (one process: both no-ops).
    """

    stage: Stage = SINGLE_STAGE

    def __init__(self, cfg: MiniCPM5Config) -> None:
        super().__init__()
        self.sliding_window = cfg.sliding_window
        # Plain attributes (a tuple would become a module child): beta None = no scaling.
        scaling = cfg.llama4_scaling
        self.llama4_beta: float | None = scaling[0] if scaling else None
        self.llama4_max: int = scaling[1] if scaling else 0
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [DecoderLayer(cfg, sliding) for sliding in cfg.sliding]
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None) -> mx.array:
        h = self.embed_tokens(inputs)
        cache = cache if cache is not None else [None] * len(self.layers)
        # One mask per attention kind, built from the first layer of that kind
        # (all layers of a kind share offsets and padding).
        masks: dict[bool, Any] = {}
        for layer, c in zip(self.layers, cache, strict=True):
            if layer.sliding not in masks:
                window = self.sliding_window if layer.sliding else None
                masks[layer.sliding] = create_attention_mask(h, c, window_size=window)
        q_scale = None
        if self.llama4_beta is not None:
            offset = cache[0].offset if cache[0] is not None else 0
            q_scale = llama4_query_scale(
                inputs.shape[1], offset, self.llama4_beta, self.llama4_max, h.dtype
            )
        h = self.stage.enter(h)
        for layer, c in zip(self.layers, cache, strict=True):
            h = layer(h, masks[layer.sliding], cache=c, q_scale=q_scale)
        return self.norm(self.stage.leave(h))


class Model(nn.Module):
    """The :class:`mlx_loom.plugin.CausalLM` this plugin builds."""

    def __init__(self, cfg: MiniCPM5Config) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None) -> mx.array:
        h = self.model(inputs, cache)
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    def make_cache(self) -> list[Any]:
        """One cache per layer: a rotating window for sliding layers, else a full cache."""
        window = self.model.sliding_window  # set whenever a layer slides (config check)
        return [
            RotatingKVCache(max_size=window) if layer.sliding and window else KVCache()
            for layer in self.model.layers
        ]
