"""The Qwen3 graphs: pre-norm GQA attention with per-head query/key RMSNorm, dense or routed MLPs.

Module and attribute names are the checkpoint's (``model.layers.0.self_attn.q_norm``,
``model.layers.1.mlp.switch_mlp.gate_proj`` in MLX's stacked-expert layout),
so tensors load by name. The op graph is mlx-lm's ``qwen3``/``qwen3_moe`` op
for op — the query/key norm on each head *before* the transpose and RoPE, the
same fused attention, RoPE and RMSNorm calls, the compiled SwiGLU, and the
router's precise softmax, ``argpartition`` and score weighting — which is
what makes the bit-equal parity tests possible. The routed experts are the
core's :class:`~mlx_loom.nn.SwitchGLU`, computed by the per-backend kernel
the core resolved for this device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlx_loom.cache import KVCache, append_kv, create_attention_mask
from mlx_loom.nn import (
    GatedMLP,
    SwitchGLU,
    make_rope,
    merge_heads,
    mix_experts,
    project,
    split_heads,
    switch_glu,
)
from mlx_loom.parallel import SINGLE_STAGE, Stage

from .config import Qwen3Config, Qwen3MoeConfig

__all__ = ["Model"]


class Attention(nn.Module):
    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        D, H, KV, hd = (
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        bias = cfg.attention_bias
        self.n_heads, self.n_kv_heads, self.scale = H, KV, hd**-0.5
        self.q_proj = nn.Linear(D, H * hd, bias=bias)
        self.k_proj = nn.Linear(D, KV * hd, bias=bias)
        self.v_proj = nn.Linear(D, KV * hd, bias=bias)
        self.o_proj = nn.Linear(H * hd, D, bias=bias)
        self.q_norm = nn.RMSNorm(hd, eps=cfg.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=cfg.rms_norm_eps)
        self.rope = make_rope(
            hd,
            base=cfg.rope_theta,
            traditional=False,  # Hugging Face rotates halves
            scaling=cfg.rope_scaling,
            max_position_embeddings=cfg.max_position_embeddings,
        )

    def __call__(self, x: mx.array, mask: Any, cache: Any = None) -> mx.array:
        q, k, v = project(x, self.q_proj, self.k_proj, self.v_proj)
        # Each head is normalised on its own, before the heads move to axis 1.
        q = split_heads(q, self.n_heads, norm=self.q_norm)
        k = split_heads(k, self.n_kv_heads, norm=self.k_norm)
        v = split_heads(v, self.n_kv_heads)
        offset = cache.offset if cache is not None else 0  # an array for batch caches
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        # The cache's view owns the attention arithmetic of its storage codec.
        out = append_kv(cache, k, v).attend(q, scale=self.scale, mask=mask)
        return self.o_proj(merge_heads(out))


class SparseMoe(nn.Module):
    """Top-k routed experts, no shared expert; ``norm_topk_prob`` renormalises the k scores."""

    def __init__(self, cfg: Qwen3MoeConfig, kernel: Callable[..., mx.array]) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(d, cfg.num_experts, bias=False)
        self.switch_mlp = SwitchGLU(d, cfg.moe_intermediate_size, cfg.num_experts, kernel=kernel)

    def __call__(self, x: mx.array) -> mx.array:
        k = self.top_k
        probs = mx.softmax(self.gate(x), axis=-1, precise=True)
        inds = mx.argpartition(probs, kth=-k, axis=-1)[..., -k:]
        scores = mx.take_along_axis(probs, inds, axis=-1)
        if self.norm_topk_prob:
            scores = scores / scores.sum(axis=-1, keepdims=True)
        y = self.switch_mlp(x, inds)
        return mix_experts(y, scores).astype(y.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3Config, i: int, expert_kernel: Callable[..., mx.array]) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        if isinstance(cfg, Qwen3MoeConfig) and cfg.mlp_kind(i) == "moe":
            self.mlp: SparseMoe | GatedMLP = SparseMoe(cfg, expert_kernel)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def __call__(self, x: mx.array, mask: Any, cache: Any = None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen3Model(nn.Module):
    """Embeddings, decoder layers and the final norm (Hugging Face's ``model.*``).

    Split into pipeline stages, ``layers`` holds this rank's layers and
    ``stage`` hands activations between ranks (one process: both no-ops).
    """

    stage: Stage = SINGLE_STAGE

    def __init__(self, cfg: Qwen3Config, expert_kernel: Callable[..., mx.array]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [
            DecoderLayer(cfg, i, expert_kernel) for i in range(cfg.num_hidden_layers)
        ]
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None) -> mx.array:
        h = self.embed_tokens(inputs)
        cache = cache if cache is not None else [None] * len(self.layers)
        # Every layer attends causally over a full cache: one mask serves all.
        mask = create_attention_mask(h, cache[0])
        h = self.stage.enter(h)
        for layer, c in zip(self.layers, cache, strict=True):
            h = layer(h, mask, cache=c)
        return self.norm(self.stage.leave(h))


class Model(nn.Module):
    """The :class:`mlx_loom.plugin.CausalLM` this plugin builds, for either config.

    ``expert_kernel`` computes the routed experts (``qwen3_moe`` only); the
    factory passes the one the core resolved for this backend. The default,
    the core's MLX-ops kernel, serves graphs built for their shapes alone.
    """

    def __init__(
        self, cfg: Qwen3Config, expert_kernel: Callable[..., mx.array] = switch_glu
    ) -> None:
        super().__init__()
        self.config = cfg
        self.model = Qwen3Model(cfg, expert_kernel)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None) -> mx.array:
        h = self.model(inputs, cache)
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    def make_cache(self) -> list[Any]:
        """A full KV cache per layer (no Qwen3 layer slides)."""
        return [KVCache() for _ in self.model.layers]

    @property
    def quant_predicate(self) -> Callable[[str, nn.Module], bool | dict[str, int]] | None:
        """``loom convert``: the router stays at 8 bits (mlx-lm's choice): its few
        outputs decide which experts run, and 4-bit routing changes the choice."""
        if not isinstance(self.config, Qwen3MoeConfig):
            return None

        def predicate(path: str, _: nn.Module) -> bool | dict[str, int]:
            return {"group_size": 64, "bits": 8} if path.endswith("mlp.gate") else True

        return predicate
