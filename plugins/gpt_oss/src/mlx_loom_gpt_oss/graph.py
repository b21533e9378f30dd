"""The gpt-oss graph: attention with learned sinks over alternating window/full layers,
and a mixture of biased experts behind a clamped SwiGLU.

Module and attribute names are the converted ones mlx-lm reads
(``model.layers.0.self_attn.sinks``, ``model.layers.0.mlp.experts.gate_proj``);
:mod:`.loader` maps a Hugging Face checkpoint's fused ``gate_up_proj`` onto
them. The op graph is mlx-lm's ``gpt_oss`` op for op — top-k by
``argpartition``, softmax over the selected logits only, the same compiled
activation, the per-kind masks — which is what the bit-equal parity tests
rely on.

What is particular to gpt-oss, and why it is written as it is:

* **Sinks**: one learned logit per query head joins every softmax row, so a
  head may attend to "nothing". ``mx.fast.scaled_dot_product_attention``
  takes them (``sinks=``); the cache's view passes them through.
* **Layers alternate** a sliding window (rotating cache) and full attention;
  each kind gets its own mask, built once per forward from its first layer.
* **Experts carry biases** (``SwitchGLU(bias=True)`` in :mod:`mlx_loom.nn`),
  and the activation clamps: the gate from above, the linear part on both
  sides, then ``(up + 1) * gate * sigmoid(alpha * gate)``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlx_loom.cache import KVCache, RotatingKVCache, append_kv, create_attention_mask
from mlx_loom.nn import (
    AttentionGeometry,
    SwitchGLU,
    make_rope,
    merge_heads,
    mix_experts,
    project,
    split_heads,
)
from mlx_loom.parallel import SINGLE_STAGE, Stage

from .config import GptOssConfig

#: The kernel name of the routed-expert GLU (registered per backend in :mod:`.plugin`).
SWITCH_GLU = "gpt_oss.switch_glu"

#: The sigmoid's slope of gpt-oss's SwiGLU variant (a constant of the architecture).
SWIGLU_ALPHA = 1.702


@partial(mx.compile, shapeless=True)
def clamped_swiglu(gate: mx.array, up: mx.array, alpha: float, limit: float) -> mx.array:
    """gpt-oss's SwiGLU: gate clamped above at ``limit``, ``up`` to ``[-limit, limit]``.

    Compiled shapeless, as mlx-lm compiles its ``swiglu_oai``: fused and
    unfused graphs round bf16 intermediates differently.
    """
    gate = mx.minimum(gate, limit)
    up = mx.clip(up, -limit, limit)
    return (up + 1.0) * (gate * mx.sigmoid(alpha * gate))


def top_k(logits: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """The ``k`` largest logits and their indices (unordered), by ``argpartition``.

    The order of the k indices decides the order the experts' outputs are
    summed in, so it is mlx-lm's (the last ``k`` after partitioning).
    """
    indices = mx.stop_gradient(mx.argpartition(logits, kth=-k, axis=-1)[..., -k:])
    return mx.take_along_axis(logits, indices, axis=-1), indices


class Attention(nn.Module):
    def __init__(self, cfg: GptOssConfig, window: int | None = None) -> None:
        super().__init__()
        D, H, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        KV = cfg.num_key_value_heads
        self.n_heads, self.n_kv_heads, self.scale = H, KV, hd**-0.5
        self.geometry = AttentionGeometry(H, KV, hd, window=window)
        self.sinks = mx.zeros((H,))
        self.q_proj = nn.Linear(D, H * hd, bias=True)
        self.k_proj = nn.Linear(D, KV * hd, bias=True)
        self.v_proj = nn.Linear(D, KV * hd, bias=True)
        self.o_proj = nn.Linear(H * hd, D, bias=True)
        self.rope = make_rope(
            hd,
            base=cfg.rope_theta,
            traditional=False,
            scaling=cfg.rope_scaling,
            max_position_embeddings=cfg.max_position_embeddings,
        )

    def __call__(self, x: mx.array, mask: Any, cache: Any = None) -> mx.array:
        q, k, v = project(x, self.q_proj, self.k_proj, self.v_proj)
        q = split_heads(q, self.n_heads)
        k = split_heads(k, self.n_kv_heads)
        v = split_heads(v, self.n_kv_heads)
        offset = cache.offset if cache is not None else 0  # an array for batch caches
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        out = append_kv(cache, k, v).attend(q, scale=self.scale, mask=mask, sinks=self.sinks)
        return self.o_proj(merge_heads(out))


class MoE(nn.Module):
    """Router, top-k softmax over the chosen experts' logits, biased expert GLUs."""

    def __init__(self, cfg: GptOssConfig, switch_glu: Callable[..., mx.array]) -> None:
        super().__init__()
        self.k = cfg.num_experts_per_tok
        self.router = nn.Linear(cfg.hidden_size, cfg.num_local_experts, bias=True)
        self.experts = SwitchGLU(
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.num_local_experts,
            kernel=switch_glu,
            activation=partial(clamped_swiglu, alpha=SWIGLU_ALPHA, limit=cfg.swiglu_limit),
            bias=True,
        )

    def __call__(self, x: mx.array) -> mx.array:
        logits, indices = top_k(self.router(x), self.k)
        weights = mx.softmax(logits, axis=-1, precise=True)
        return mix_experts(self.experts(x, indices), weights)


class DecoderLayer(nn.Module):
    def __init__(
        self, cfg: GptOssConfig, sliding: bool, switch_glu: Callable[..., mx.array]
    ) -> None:
        super().__init__()
        self.sliding = sliding
        self.self_attn = Attention(cfg, cfg.sliding_window if sliding else None)
        self.mlp = MoE(cfg, switch_glu)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def __call__(self, x: mx.array, mask: Any, cache: Any = None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class GptOssModel(nn.Module):
    """Embeddings, decoder layers and the final norm (``model.*``).

    Split into pipeline stages, ``layers`` holds this rank's layers and
    ``stage`` hands activations between ranks (one process: both no-ops).
    """

    stage: Stage = SINGLE_STAGE

    def __init__(self, cfg: GptOssConfig, switch_glu: Callable[..., mx.array]) -> None:
        super().__init__()
        self.sliding_window = cfg.sliding_window
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [DecoderLayer(cfg, sliding, switch_glu) for sliding in cfg.sliding]
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None) -> mx.array:
        h = self.embed_tokens(inputs)
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


def _router_at_8_bits(path: str, _: nn.Module) -> bool | dict[str, int]:
    """``loom convert``: the router stays at 8 bits, group 64 (mlx-lm's recipe for gpt-oss)."""
    if path.endswith("router"):
        return {"group_size": 64, "bits": 8}
    return True


class Model(nn.Module):
    """The :class:`mlx_loom.plugin.CausalLM` this plugin builds."""

    def __init__(self, cfg: GptOssConfig, kernels: Mapping[str, Callable[..., Any]]) -> None:
        super().__init__()
        self.config = cfg
        self.model = GptOssModel(cfg, kernels[SWITCH_GLU])
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None) -> mx.array:
        return self.lm_head(self.model(inputs, cache))

    @property
    def quant_predicate(self) -> Callable[[str, nn.Module], bool | dict[str, int]]:
        return _router_at_8_bits

    def make_cache(self) -> list[Any]:
        """One cache per layer: a rotating window for sliding layers, else a full cache."""
        window = self.model.sliding_window
        return [
            RotatingKVCache(max_size=window) if layer.sliding else KVCache()
            for layer in self.model.layers
        ]
