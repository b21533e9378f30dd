"""The Gemma 3 text graph: alternating sliding and global attention, GeGLU, four norms a layer.

Module names are the checkpoint's (``model.layers.N.self_attn.q_proj`` ...).
The arithmetic follows mlx-lm's ``gemma3_text`` step for step — gains applied
as ``1 + w``, per-head q/k norms before RoPE, a local RoPE base on sliding
layers and the configured scaling on global ones, the embedding scaled by
``sqrt(hidden)`` rounded to bf16, residual sums clipped to fp16's range when
computing in fp16 — which is what makes its logits bit-equal to mlx-lm's.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlx_loom.cache import KVCache, RotatingKVCache, append_kv, create_attention_mask
from mlx_loom.nn import AttentionGeometry, make_rope, merge_heads, project, split_heads
from mlx_loom.parallel import SINGLE_STAGE, Stage
from mlx_loom_gemma4.config import FULL, Gemma3TextConfig


class OffsetRMSNorm(nn.Module):
    """RMSNorm whose stored gain is ``w`` and applied gain ``1 + w`` (Gemma's convention)."""

    def __init__(self, dims: int, eps: float) -> None:
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, 1.0 + self.weight, self.eps)


@partial(mx.compile, shapeless=True)
def residual(x: mx.array, y: mx.array) -> mx.array:
    """``x + y``; in fp16 the sum is taken in fp32 and clipped to fp16's range (no infinities)."""
    if x.dtype != mx.float16:
        return x + y
    bound = mx.finfo(mx.float16).max
    return mx.clip(x.astype(mx.float32) + y.astype(mx.float32), -bound, bound).astype(mx.float16)


class Attention(nn.Module):
    def __init__(self, cfg: Gemma3TextConfig, sliding: bool) -> None:
        super().__init__()
        D, H, KV, hd = (
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.n_heads, self.n_kv_heads = H, KV
        self.scale = cfg.query_pre_attn_scalar**-0.5
        # What backends' speculative verify rules read (docs/plugin-authors.md).
        self.geometry = AttentionGeometry(H, KV, hd, window=cfg.sliding_window if sliding else None)
        self.q_proj = nn.Linear(D, H * hd, bias=False)
        self.k_proj = nn.Linear(D, KV * hd, bias=False)
        self.v_proj = nn.Linear(D, KV * hd, bias=False)
        self.o_proj = nn.Linear(H * hd, D, bias=False)
        self.q_norm = OffsetRMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(hd, cfg.rms_norm_eps)
        if sliding:
            self.rope = make_rope(hd, base=cfg.rope_local_base_freq)
        else:
            self.rope = make_rope(
                hd,
                base=cfg.rope_theta,
                scaling=cfg.rope_scaling,
                max_position_embeddings=cfg.max_position_embeddings,
            )

    def __call__(self, x: mx.array, mask: Any, cache: Any = None) -> mx.array:
        q, k, v = project(x, self.q_proj, self.k_proj, self.v_proj)
        q = self.q_norm(split_heads(q, self.n_heads))
        k = self.k_norm(split_heads(k, self.n_kv_heads))
        v = split_heads(v, self.n_kv_heads)
        offset = cache.offset if cache is not None else 0
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        out = append_kv(cache, k, v).attend(q, scale=self.scale, mask=mask)
        return self.o_proj(merge_heads(out))


class MLP(nn.Module):
    """``down(gelu_tanh(gate(x)) * up(x))``, in mlx-lm's op order (uncompiled GELU)."""

    def __init__(self, dims: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dims, hidden, bias=False)
        self.up_proj = nn.Linear(dims, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dims, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.gelu_approx(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Gemma3TextConfig, kind: str) -> None:
        super().__init__()
        self.sliding = kind != FULL
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Attention(cfg, self.sliding)
        self.mlp = MLP(D, cfg.intermediate_size)
        self.input_layernorm = OffsetRMSNorm(D, eps)
        self.post_attention_layernorm = OffsetRMSNorm(D, eps)
        self.pre_feedforward_layernorm = OffsetRMSNorm(D, eps)
        self.post_feedforward_layernorm = OffsetRMSNorm(D, eps)

    def __call__(self, x: mx.array, mask: Any, cache: Any = None) -> mx.array:
        h = residual(x, self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), mask, cache)))
        return residual(h, self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h))))


class TextModel(nn.Module):
    """Embeddings (scaled), decoder layers and the final norm (``model.*``)."""

    stage: Stage = SINGLE_STAGE

    def __init__(self, cfg: Gemma3TextConfig) -> None:
        super().__init__()
        self.hidden_size = cfg.hidden_size
        self.sliding_window = cfg.sliding_window
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [DecoderLayer(cfg, kind) for kind in cfg.kinds]
        self.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None) -> mx.array:
        h = self.embed_tokens(inputs)
        h = h * mx.array(self.hidden_size**0.5, mx.bfloat16).astype(h.dtype)
        cache = cache if cache is not None else [None] * len(self.layers)
        # One mask per attention kind, from the first layer of that kind.
        masks: dict[bool, Any] = {}
        for layer, c in zip(self.layers, cache, strict=True):
            if layer.sliding not in masks:
                window = self.sliding_window if layer.sliding else None
                masks[layer.sliding] = create_attention_mask(h, c, window_size=window)
        h = self.stage.enter(h)
        for layer, c in zip(self.layers, cache, strict=True):
            h = layer(h, masks[layer.sliding], cache=c)
        return self.norm(self.stage.leave(h))


class Gemma3Model(nn.Module):
    """The :class:`mlx_loom.plugin.CausalLM` of the ``gemma4.gemma3-text`` graph."""

    def __init__(self, cfg: Gemma3TextConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = TextModel(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None) -> mx.array:
        h = self.model(inputs, cache)
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    @property
    def layers(self) -> list[DecoderLayer]:
        return self.model.layers

    def make_cache(self) -> list[Any]:
        """A rotating window per sliding layer, a full cache per global layer."""
        window = self.config.sliding_window
        return [RotatingKVCache(max_size=window) if layer.sliding else KVCache() for layer in self.layers]
