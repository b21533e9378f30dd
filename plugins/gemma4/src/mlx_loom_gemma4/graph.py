"""The Gemma 4 text graph: one module per concept.

Module names mirror mlx-lm's converted layout (``model.layers.N.self_attn.q_proj``,
``model.layers.N.experts.switch_glu.gate_proj`` ...) so MLX-quantized
checkpoints and their per-module quantization overrides address our modules
directly (a ``gemma4`` wrapper's ``language_model.`` prefix is the core's
config view's business). Op order follows mlx-lm's ``gemma4_text`` step for
step (same compiled activations, same scalar multiplies), which is what makes
fp32 and quantized logits bit-equal to it. The GeGLU MLP, the routed experts
and RoPE (default and proportional) are the core's shared layers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlx_loom.cache import (
    DonorView,
    KVCache,
    QuantizedKVCache,
    QuantizedRotatingKVCache,
    RotatingKVCache,
    append_kv,
    create_attention_mask,
)
from mlx_loom.nn import (
    AttentionGeometry,
    GatedMLP,
    SwitchGLU,
    gelu_approx_mul,
    geglu,
    make_rope,
    merge_heads,
    mix_experts,
    project,
    rms_norm,
    softcap,
    split_heads,
)
from mlx_loom.nn.experts import ExpertKernel
from mlx_loom.parallel import SINGLE_STAGE, Stage
from mlx_loom_gemma4.config import FULL, SLIDING, Gemma4TextConfig


# --- small building blocks ----------------------------------------------------


class WeightlessRMSNorm(nn.Module):
    """RMSNorm with no gain (Gemma 4's value norm): ``rms_norm(x, None, eps)`` (native
    in a native forward: :func:`mlx_loom.nn.rms_norm`)."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return rms_norm(x, None, self.eps)


# --- attention ------------------------------------------------------------------


class Attention(nn.Module):
    """Self-attention of one layer; a KV-shared layer has only q/o and reads a donor."""

    def __init__(self, cfg: Gemma4TextConfig, layer: int) -> None:
        super().__init__()
        kind = cfg.kinds[layer]
        self.n_heads = cfg.num_attention_heads
        self.head_dim = cfg.head_dim_for(kind)
        self.n_kv_heads = cfg.kv_heads_for(kind)
        self.geometry = AttentionGeometry(
            self.n_heads,
            self.n_kv_heads,
            self.head_dim,
            window=cfg.sliding_window if kind == SLIDING else None,
        )
        self.k_eq_v = cfg.k_eq_v_for(kind)
        self.owns_kv = not cfg.is_shared(layer)
        dim, eps = cfg.hidden_size, cfg.rms_norm_eps

        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=False)
        if self.owns_kv:
            self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
            if not self.k_eq_v:
                self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=False)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=eps)
        if self.owns_kv:
            self.k_norm = nn.RMSNorm(self.head_dim, eps=eps)
            self.v_norm = WeightlessRMSNorm(eps)
        rope = cfg.rope_for(kind)
        self.rope = make_rope(
            self.head_dim,
            base=rope.rope_theta,
            traditional=cfg.rope_traditional,
            scaling=rope.scaling,
        )

    def _projections(self, x: mx.array) -> tuple[mx.array, mx.array | None, mx.array | None]:
        """Queries, and this layer's own raw keys and values (``None`` where it borrows them;
        values ``None`` too with ``attention_k_eq_v``)."""
        if not self.owns_kv:
            return self.q_proj(x), None, None
        if self.k_eq_v:
            queries, keys = project(x, self.q_proj, self.k_proj)
            return queries, keys, None
        queries, keys, values = project(x, self.q_proj, self.k_proj, self.v_proj)
        return queries, keys, values

    def _own_kv(self, keys: mx.array, values: mx.array | None, cache: Any) -> DonorView:
        # attention_k_eq_v: values are the raw key projection (before k_norm).
        raw_values = keys if values is None else values
        offset = mx.array(cache.offset) if cache is not None else 0
        keys = self.rope(split_heads(keys, self.n_kv_heads, norm=self.k_norm), offset=offset)
        values = split_heads(raw_values, self.n_kv_heads, norm=self.v_norm)
        # The cache's view (whatever its codec) is what this layer and the
        # layers sharing its keys/values attend through; offsets ride along.
        return DonorView(append_kv(cache, keys, values), offset)

    def __call__(
        self, x: mx.array, mask: Any, cache: Any, share: DonorView | None
    ) -> tuple[mx.array, DonorView]:
        queries, keys, values = self._projections(x)
        queries = split_heads(queries, self.n_heads, norm=self.q_norm)
        if keys is not None:
            share = self._own_kv(keys, values, cache)
        elif share is None:
            raise RuntimeError("a KV-shared layer ran without its donor's keys/values")
        queries = self.rope(queries, offset=share.offset)
        # Gemma 4's attention scale is 1.0: q and k are RMS-normed instead.
        out = share.attend(queries, scale=1.0, mask=mask)
        return self.o_proj(merge_heads(out)), share


# --- feed-forward -------------------------------------------------------------


class Router(nn.Module):
    """Expert choice: scaled RMS norm -> scores -> top-k -> softmax -> per-expert scale."""

    def __init__(self, cfg: Gemma4TextConfig) -> None:
        super().__init__()
        # Built only with enable_moe_block, whose config check sets both fields.
        assert cfg.num_experts is not None and cfg.top_k_experts is not None
        self.eps = cfg.rms_norm_eps
        self.top_k = cfg.top_k_experts
        self.proj = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.scale = mx.ones((cfg.hidden_size,))
        self.per_expert_scale = mx.ones((cfg.num_experts,))
        self._root_size = cfg.hidden_size**-0.5

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        x = rms_norm(x, self.scale * self._root_size, self.eps)
        scores = self.proj(x)
        k = self.top_k
        indices = mx.stop_gradient(mx.argpartition(scores, kth=-k, axis=-1)[..., -k:])
        weights = mx.softmax(mx.take_along_axis(scores, indices, axis=-1), axis=-1)
        return indices, weights * self.per_expert_scale[indices]


class Experts(nn.Module):
    """The sparse expert block: router-weighted sum of the chosen experts' outputs."""

    def __init__(self, cfg: Gemma4TextConfig, kernel: ExpertKernel) -> None:
        super().__init__()
        self.switch_glu = SwitchGLU(
            cfg.hidden_size,
            cfg.moe_intermediate_size,  # type: ignore[arg-type]
            cfg.num_experts,  # type: ignore[arg-type]
            kernel=kernel,
            activation=geglu,
        )

    def __call__(self, x: mx.array, indices: mx.array, weights: mx.array) -> mx.array:
        return mix_experts(self.switch_glu(x, indices), weights)


# --- decoder layer ---------------------------------------------------------------


class DecoderLayer(nn.Module):
    """Attention, dense MLP (plus the expert block beside it), per-layer input, layer scalar."""

    def __init__(self, cfg: Gemma4TextConfig, layer: int, kernel: ExpertKernel | None) -> None:
        super().__init__()
        dim, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.kind = cfg.kinds[layer]
        self.self_attn = Attention(cfg, layer)
        self.mlp = GatedMLP(dim, cfg.mlp_width(layer), activation=geglu)
        self.input_layernorm = nn.RMSNorm(dim, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(dim, eps=eps)
        self.pre_feedforward_layernorm = nn.RMSNorm(dim, eps=eps)
        self.post_feedforward_layernorm = nn.RMSNorm(dim, eps=eps)
        self.moe = cfg.enable_moe_block
        if self.moe:
            if kernel is None:
                raise ValueError("an MoE layer needs the gemma4.switch_glu kernel")
            self.router = Router(cfg)
            self.experts = Experts(cfg, kernel)
            self.post_feedforward_layernorm_1 = nn.RMSNorm(dim, eps=eps)
            self.post_feedforward_layernorm_2 = nn.RMSNorm(dim, eps=eps)
            self.pre_feedforward_layernorm_2 = nn.RMSNorm(dim, eps=eps)
        self.per_layer = bool(cfg.per_layer_width)
        if self.per_layer:
            self.per_layer_input_gate = nn.Linear(dim, cfg.per_layer_width, bias=False)
            self.per_layer_projection = nn.Linear(cfg.per_layer_width, dim, bias=False)
            self.post_per_layer_input_norm = nn.RMSNorm(dim, eps=eps)
        self.layer_scalar = mx.ones((1,))

    def _feed_forward(self, h: mx.array) -> mx.array:
        if not self.moe:
            return self.mlp(self.pre_feedforward_layernorm(h))
        dense = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(h)))
        indices, weights = self.router(h)
        sparse = self.experts(self.pre_feedforward_layernorm_2(h), indices, weights)
        return dense + self.post_feedforward_layernorm_2(sparse)

    def __call__(
        self,
        x: mx.array,
        mask: Any,
        cache: Any,
        per_layer_input: mx.array | None,
        share: DonorView | None,
    ) -> tuple[mx.array, DonorView]:
        attn, share = self.self_attn(self.input_layernorm(x), mask, cache, share)
        h = x + self.post_attention_layernorm(attn)
        h = h + self.post_feedforward_layernorm(self._feed_forward(h))
        if self.per_layer and per_layer_input is not None:
            # mlx-lm's two operations (one native node in a native float32 forward).
            gate = gelu_approx_mul(self.per_layer_input_gate(h), per_layer_input)
            gate = self.per_layer_projection(gate)
            h = h + self.post_per_layer_input_norm(gate)
        return h * self.layer_scalar, share


# --- the text model ----------------------------------------------------------------


class TextModel(nn.Module):
    """Embeddings (scaled by sqrt(hidden)), per-layer inputs, the layer stack, final norm.

    Split into pipeline stages, ``layers`` holds this rank's layers (from
    ``stage.start``) and ``stage`` hands activations between ranks (one
    process: both no-ops). A stage always holds a KV-shared layer's donor.
    """

    stage: Stage = SINGLE_STAGE

    def __init__(self, cfg: Gemma4TextConfig, kernel: ExpertKernel | None) -> None:
        super().__init__()
        self.cfg = cfg
        dim, n = cfg.hidden_size, cfg.num_hidden_layers
        self.embed_tokens = nn.Embedding(cfg.vocab_size, dim)
        self.embed_scale = dim**0.5
        self.layers = [DecoderLayer(cfg, i, kernel) for i in range(n)]
        self.norm = nn.RMSNorm(dim, eps=cfg.rms_norm_eps)
        self.donors = [cfg.kv_donor(i) for i in range(n)]
        width = cfg.per_layer_width
        if width:
            self.embed_tokens_per_layer = nn.Embedding(cfg.vocab_size_per_layer_input, n * width)
            self.per_layer_model_projection = nn.Linear(dim, n * width, bias=False)
            self.per_layer_projection_norm = nn.RMSNorm(width, eps=cfg.rms_norm_eps)

    def _per_layer_inputs(self, inputs: mx.array, h: mx.array) -> mx.array:
        """``[B, L, layers, width]``: token-indexed embeddings mixed with a projection of ``h``."""
        cfg = self.cfg
        n, width = cfg.num_hidden_layers, cfg.per_layer_width
        if cfg.vocab_size_per_layer_input < cfg.vocab_size:
            # transformers maps ids outside the per-layer vocabulary to 0.
            inputs = mx.where(inputs < cfg.vocab_size_per_layer_input, inputs, 0)
        token_part = self.embed_tokens_per_layer(inputs) * (width**0.5)
        token_part = mx.unflatten(token_part, -1, (n, width))
        projected = self.per_layer_model_projection(h) * (cfg.hidden_size**-0.5)
        projected = self.per_layer_projection_norm(mx.unflatten(projected, -1, (n, width)))
        return (projected + token_part) * (2.0**-0.5)

    def _masks(self, h: mx.array, caches: list[Any]) -> list[Any]:
        """One mask per attention kind, built from the first cache of that kind
        (every cache of a kind has the same offsets and padding)."""
        by_kind: dict[str, Any] = {}
        for layer, c in zip(self.layers, caches, strict=True):
            if layer.kind not in by_kind:
                window = self.cfg.sliding_window if layer.kind == SLIDING else None
                by_kind[layer.kind] = create_attention_mask(h, c, window_size=window)
        return [by_kind[layer.kind] for layer in self.layers]

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None) -> mx.array:
        h = self.embed_tokens(inputs) * self.embed_scale
        n = len(self.layers)
        per_layer = self._per_layer_inputs(inputs, h) if self.cfg.per_layer_width else None
        caches = [None] * n if cache is None else list(cache) + [None] * (n - len(cache))
        masks = self._masks(h, caches)
        shares: list[DonorView | None] = [None] * n
        start = self.stage.start
        h = self.stage.enter(h, per_layer)
        for i, layer in enumerate(self.layers):
            pli = per_layer[:, :, start + i, :] if per_layer is not None else None
            share = shares[self.donors[start + i] - start]
            h, shares[i] = layer(h, masks[i], caches[i], pli, share)
        return self.norm(self.stage.leave(h))


def _router_at_8_bits(path: str, _: nn.Module) -> bool | dict[str, int]:
    """``loom convert``: the expert router stays at 8 bits (mlx-lm's choice for Gemma 4)."""
    if path.endswith("router.proj"):
        return {"group_size": 64, "bits": 8}
    return True


class Model(nn.Module):
    """The text model plus the (tied or separate) head and logit soft-cap (``gemma4_text``,
    and the text tower of ``gemma4``)."""

    def __init__(self, cfg: Gemma4TextConfig, kernel: ExpertKernel | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = TextModel(cfg, kernel)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None) -> mx.array:
        out = self.model(inputs, cache)
        if self.cfg.tie_word_embeddings:
            out = self.model.embed_tokens.as_linear(out)
        else:
            out = self.lm_head(out)
        if self.cfg.final_logit_softcapping is not None:
            out = softcap(out, self.cfg.final_logit_softcapping)
        return out

    @property
    def quant_predicate(self) -> Callable[[str, nn.Module], bool | dict[str, int]]:
        return _router_at_8_bits

    def make_cache(self, *, kv_bits: int | None = None, kv_group_size: int = 64) -> list[Any]:
        """One cache per layer that owns keys/values (KV-shared layers own none).

        Full-attention layers get a growing cache, sliding layers a rotating
        window of ``sliding_window`` slots; with ``kv_bits`` both are
        affine-quantized (sliding ones too, which mlx-lm cannot do).
        """
        caches: list[Any] = []
        owners = [layer.kind for layer in self.model.layers if layer.self_attn.owns_kv]
        for kind in owners:
            window = self.cfg.sliding_window
            if kv_bits is None:
                caches.append(KVCache() if kind == FULL else RotatingKVCache(window, 0))
            elif kind == FULL:
                caches.append(QuantizedKVCache(group_size=kv_group_size, bits=kv_bits))
            else:
                caches.append(
                    QuantizedRotatingKVCache(window, 0, group_size=kv_group_size, bits=kv_bits)
                )
        return caches
