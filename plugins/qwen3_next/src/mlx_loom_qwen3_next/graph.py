"""The Qwen3-Next / Qwen3.5 graphs: gated delta nets, gated attention, sparse MoE.

Numerics follow mlx-lm's ``qwen3_next`` / ``qwen3_5`` op for op (same fused
functions, same dtypes, same reduction order) so fp32 and quantized
checkpoints produce bit-identical logits. The MLPs, the routed experts and
RoPE are the core's shared layers (:mod:`mlx_loom.nn`); the recurrence, the
causal convolution and the expert GLU go through the per-backend kernels in
:mod:`mlx_loom_qwen3_next.kernels`, resolved by the core for this device.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import partial
from types import ModuleType
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlx_loom.cache import KVCache, append_kv, create_attention_mask
from mlx_loom.cache.recurrent import RecurrentCache
from mlx_loom.nn import (
    AttentionGeometry,
    GatedMLP,
    SwitchGLU,
    make_rope,
    merge_heads,
    mix_experts,
    project,
    rms_norm,
    split_heads,
    swiglu,
)
from mlx_loom.parallel import SINGLE_STAGE, Stage
from mlx_loom_qwen3_next.config import HybridConfig, Qwen3_5Config
from mlx_loom_qwen3_next.kernels import (
    CAUSAL_CONV,
    GATED_DELTA,
    GATED_DELTA_MASKED,
    GATED_DELTA_REPLAY,
    SWITCH_GLU,
    native_cpu_kernels,
)

__all__ = ["NO_MTP_WEIGHTS", "Kernels", "Model", "MtpHead"]


@dataclass(frozen=True)
class Kernels:
    """The kernel callables this graph runs, resolved for one backend."""

    gated_delta: Callable[..., Any]
    gated_delta_masked: Callable[..., Any]
    gated_delta_replay: Callable[..., Any]
    causal_conv: Callable[..., Any]
    switch_glu: Callable[..., Any]

    @classmethod
    def from_mapping(cls, kernels: Mapping[str, Callable[..., Any]]) -> Kernels:
        return cls(
            gated_delta=kernels[GATED_DELTA],
            gated_delta_masked=kernels[GATED_DELTA_MASKED],
            gated_delta_replay=kernels[GATED_DELTA_REPLAY],
            causal_conv=kernels[CAUSAL_CONV],
            switch_glu=kernels[SWITCH_GLU],
        )


# --- fused elementwise pieces (compiled like mlx-lm's, so they round alike) ---


@partial(mx.compile, shapeless=True)
def _gate_normed(h: mx.array, gate: mx.array, normed: mx.array) -> mx.array:
    # The output gate is applied in fp32 and rounded once to the input dtype.
    return (nn.silu(gate.astype(mx.float32)) * normed.astype(mx.float32)).astype(h.dtype)


@partial(mx.compile, shapeless=True)
def _decay(A_log: mx.array, a: mx.array, dt_bias: mx.array) -> mx.array:
    """g = exp(-exp(A_log) * softplus(a + dt_bias)), in fp32 (A_log is upcast)."""
    return mx.exp(-mx.exp(A_log.astype(mx.float32)) * nn.softplus(a + dt_bias))


def _l2_normalise(q: mx.array, k: mx.array, head_k_dim: int) -> tuple[mx.array, mx.array]:
    """L2-normalise q and k (eps 1e-6 on sum(x^2)) and fold the Dk^-1/2 readout into q.

    ``rms_norm`` adds its eps to mean(x^2), so the reference eps is scaled by
    1/Dk; q gets (Dk^-1/2)^2 = 1/Dk (l2 normalisation times the readout scale).
    """
    inv = head_k_dim**-0.5
    eps = 1e-6 * inv**2
    return (inv**2) * rms_norm(q, None, eps), inv * rms_norm(k, None, eps)


class GatedRMSNorm(nn.Module):
    """RMSNorm of the delta net's output, gated by SiLU(z). Its gain is not zero-centred."""

    def __init__(self, dims: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = mx.ones(dims)

    def __call__(self, x: mx.array, gate: mx.array) -> mx.array:
        normed = rms_norm(x, self.weight, self.eps)
        if x.dtype == gate.dtype == normed.dtype == mx.float32:
            # The same arithmetic as _gate_normed (its casts are no-ops in
            # float32), through swiglu: on a native kernel set one vectorised
            # node, where MLX's compiled kernel takes a scalar exp per element.
            return swiglu(gate, normed)
        return _gate_normed(x, gate, normed)


# --- attention ----------------------------------------------------------------


class GatedAttention(nn.Module):
    """Full attention whose output is gated by sigmoid(gate); q and gate share one projection."""

    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.geometry = AttentionGeometry(self.n_heads, self.n_kv_heads, self.head_dim)
        self.scale = self.head_dim**-0.5
        bias = cfg.attention_bias
        d = cfg.hidden_size
        self.q_proj = nn.Linear(d, self.n_heads * self.head_dim * 2, bias=bias)
        self.k_proj = nn.Linear(d, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, d, bias=bias)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.rope = make_rope(
            cfg.rope_dims,
            base=cfg.rope_theta,
            scaling=cfg.rope_scaling,
            max_position_embeddings=cfg.max_position_embeddings,
        )

    def __call__(self, x: mx.array, mask: Any, cache: Any) -> mx.array:
        B, L, _ = x.shape
        q, k, v = project(x, self.q_proj, self.k_proj, self.v_proj)
        q, gate = mx.split(q.reshape(B, L, self.n_heads, -1), 2, axis=-1)
        gate = gate.reshape(B, L, -1)
        v = split_heads(v, self.n_kv_heads)
        q = self.q_norm(q).transpose(0, 2, 1, 3)
        k = split_heads(k, self.n_kv_heads, norm=self.k_norm)
        offset = cache.offset if cache is not None else 0
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        # The cache's view owns the attention arithmetic of its storage codec.
        out = append_kv(cache, k, v).attend(q, scale=self.scale, mask=mask)
        return self.o_proj(merge_heads(out) * mx.sigmoid(gate))


# --- gated delta net ------------------------------------------------------------


class GatedDeltaNet(nn.Module):
    """Linear attention: causal conv -> L2-normalised q/k -> gated delta rule -> gated norm.

    Subclasses differ only in how the input projections are laid out
    (:meth:`project` returns ``qkv [B,S,C]``, ``z [B,S,Hv,Dv]``, ``b``, ``a [B,S,Hv]``).
    """

    def __init__(self, cfg: HybridConfig, kernels: Kernels) -> None:
        super().__init__()
        self.n_k_heads, self.n_v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim, self.conv_dim = cfg.key_dim, cfg.value_dim, cfg.conv_dim
        self.conv_width = cfg.linear_conv_kernel_dim
        self.conv1d = nn.Conv1d(
            self.conv_dim,
            self.conv_dim,
            self.conv_width,
            padding=0,
            groups=self.conv_dim,
            bias=False,
        )
        self.dt_bias = mx.ones(self.n_v_heads)
        self.A_log = mx.zeros(self.n_v_heads)
        self.norm = GatedRMSNorm(self.head_v_dim, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, cfg.hidden_size, bias=False)
        self._kernels = kernels

    def project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        raise NotImplementedError

    def use_native_cpu_kernels(self, native: ModuleType) -> None:
        """On the core's native CPU kernel sets: the recurrence and the conv as native nodes.

        Called by the core after it swaps its own layers; the forward, the
        padded forward and the replay change together, so they keep one
        arithmetic (:func:`~mlx_loom_qwen3_next.kernels.native_cpu_kernels`).
        """
        current = {
            "gated_delta": self._kernels.gated_delta,
            "gated_delta_masked": self._kernels.gated_delta_masked,
            "gated_delta_replay": self._kernels.gated_delta_replay,
        }
        self._kernels = replace(self._kernels, **native_cpu_kernels(native, current))

    def _recurrence_inputs(self, conv_out: mx.array, a: mx.array, b: mx.array):
        B, S, _ = conv_out.shape
        q, k, v = mx.split(conv_out, [self.key_dim, 2 * self.key_dim], axis=-1)
        q = q.reshape(B, S, self.n_k_heads, self.head_k_dim)
        k = k.reshape(B, S, self.n_k_heads, self.head_k_dim)
        v = v.reshape(B, S, self.n_v_heads, self.head_v_dim)
        q, k = _l2_normalise(q, k, self.head_k_dim)
        g = _decay(self.A_log, a, self.dt_bias)
        beta = mx.sigmoid(b)
        return q, k, v, g, beta

    def __call__(self, x: mx.array, mask: mx.array | None, cache: RecurrentCache | None):
        B, S, _ = x.shape
        kn = self._kernels
        qkv, z, b, a = self.project(x)
        if mask is not None:
            qkv = mx.where(mask[..., None], qkv, 0)
        width = self.conv_width - 1
        if cache is not None:
            tail = cache.conv_tail(B, width, self.conv_dim, x.dtype)
            ends = cache.tail_ends(S)
        else:
            tail, ends = mx.zeros((B, width, self.conv_dim), dtype=x.dtype), None
        conv_out, new_tail = kn.causal_conv(qkv, tail, self.conv1d.weight, ends)
        q, k, v, g, beta = self._recurrence_inputs(conv_out, a, b)
        state = cache.recurrent_state if cache is not None else None
        if state is None:
            state = mx.zeros((B, self.n_v_heads, self.head_v_dim, self.head_k_dim), mx.float32)
        if cache is not None:
            cache.record(
                conv_input=qkv, inputs=(q, k, v, g, beta), mask=mask, replay=kn.gated_delta_replay
            )
        if mask is None:
            out, state = kn.gated_delta(q, k, v, g, beta, state)
        else:
            out, state = kn.gated_delta_masked(q, k, v, g, beta, state, mask)
        if cache is not None:
            cache.update(conv_state=new_tail, recurrent_state=state, n=S)
        out = self.norm(out, z)
        return self.out_proj(out.reshape(B, S, -1))


class FusedGatedDeltaNet(GatedDeltaNet):
    """Qwen3-Next: ``in_proj_qkvz`` and ``in_proj_ba``, each grouped by key head."""

    def __init__(self, cfg: HybridConfig, kernels: Kernels) -> None:
        super().__init__(cfg, kernels)
        d = cfg.hidden_size
        self.in_proj_qkvz = nn.Linear(d, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(d, 2 * self.n_v_heads, bias=False)

    def project(self, x):
        B, S, _ = x.shape
        nk, dk, dv = self.n_k_heads, self.head_k_dim, self.head_v_dim
        per_k = self.n_v_heads // nk  # value heads served by each key head
        qkvz, ba = project(x, self.in_proj_qkvz, self.in_proj_ba)
        qkvz, ba = qkvz.reshape(B, S, nk, -1), ba.reshape(B, S, nk, -1)
        q, k, v, z = mx.split(qkvz, [dk, 2 * dk, 2 * dk + per_k * dv], axis=-1)
        b, a = mx.split(ba, [per_k], axis=-1)
        qkv = mx.concatenate(
            [q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], axis=-1
        )
        z = z.reshape(B, S, -1, dv)
        return qkv, z, b.reshape(B, S, self.n_v_heads), a.reshape(B, S, self.n_v_heads)


class SplitGatedDeltaNet(GatedDeltaNet):
    """Qwen3.5: separate ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``."""

    def __init__(self, cfg: HybridConfig, kernels: Kernels) -> None:
        super().__init__(cfg, kernels)
        d = cfg.hidden_size
        self.in_proj_qkv = nn.Linear(d, 2 * self.key_dim + self.value_dim, bias=False)
        self.in_proj_z = nn.Linear(d, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(d, self.n_v_heads, bias=False)
        self.in_proj_a = nn.Linear(d, self.n_v_heads, bias=False)

    def project(self, x):
        B, S, _ = x.shape
        qkv, z, b, a = project(x, self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)
        return qkv, z.reshape(B, S, self.n_v_heads, self.head_v_dim), b, a


# --- mixture of experts -----------------------------------------------------------


class SparseMoe(nn.Module):
    """Top-k routed experts plus a shared expert scaled by sigmoid(shared_expert_gate)."""

    def __init__(self, cfg: HybridConfig, kernels: Kernels) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(d, cfg.num_experts, bias=False)
        self.switch_mlp = SwitchGLU(
            d, cfg.moe_intermediate_size, cfg.num_experts, kernel=kernels.switch_glu
        )
        self.shared_expert = GatedMLP(d, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(d, 1, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        k = self.top_k
        probs = mx.softmax(self.gate(x), axis=-1, precise=True)
        inds = mx.argpartition(probs, kth=-k, axis=-1)[..., -k:]
        scores = mx.take_along_axis(probs, inds, axis=-1)
        if self.norm_topk_prob:
            scores = scores / scores.sum(axis=-1, keepdims=True)
        return mix_experts(
            self.switch_mlp(x, inds),
            scores,
            shared=self.shared_expert(x),
            shared_weight=mx.sigmoid(self.shared_expert_gate(x)),
        )


# --- layers and model ----------------------------------------------------------------


class DecoderLayer(nn.Module):
    def __init__(
        self, cfg: HybridConfig, i: int, kernels: Kernels, fused: bool, *, attention: bool = False
    ) -> None:
        super().__init__()
        self.is_linear = not attention and cfg.layer_kind(i) == "linear"
        if self.is_linear:
            delta_net = FusedGatedDeltaNet if fused else SplitGatedDeltaNet
            self.linear_attn = delta_net(cfg, kernels)
        else:
            self.self_attn = GatedAttention(cfg)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        if cfg.mlp_kind(i) == "moe":
            self.mlp: SparseMoe | GatedMLP = SparseMoe(cfg, kernels)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def __call__(self, x: mx.array, mask: Any, cache: Any) -> mx.array:
        mixer = self.linear_attn if self.is_linear else self.self_attn
        h = x + mixer(self.input_layernorm(x), mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class HybridModel(nn.Module):
    """Embeddings, the hybrid layer stack and the final norm.

    Split into pipeline stages, ``layers`` holds this rank's layers and
    ``stage`` hands activations between ranks (one process: both no-ops);
    each kind's mask comes from the first cache of that kind among them.
    """

    stage: Stage = SINGLE_STAGE

    def __init__(self, cfg: HybridConfig, kernels: Kernels, fused: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [DecoderLayer(cfg, i, kernels, fused) for i in range(cfg.num_hidden_layers)]
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def __call__(self, inputs: mx.array, cache: list[Any] | None) -> mx.array:
        h = self.embed_tokens(inputs)
        if cache is None:
            cache = [None] * len(self.layers)
        pairs = list(zip(self.layers, cache, strict=True))
        attn_cache = next((c for layer, c in pairs if not layer.is_linear), None)
        lin_cache = next((c for layer, c in pairs if layer.is_linear), None)
        attn_mask = create_attention_mask(h, attn_cache)
        lin_mask = lin_cache.make_mask(h.shape[1]) if lin_cache is not None else None
        h = self.stage.enter(h)
        for layer, c in pairs:
            h = layer(h, lin_mask if layer.is_linear else attn_mask, c)
        return self.norm(self.stage.leave(h))


class MtpHead(nn.Module):
    """The multi-token-prediction head (``mtp.*``): from the model's hidden state at
    position t and the embedding of token t+1, a hidden state that predicts token t+2.

    Each input gets its own zero-centred RMSNorm, the two are concatenated
    (embedding first, as Qwen3-Next's reference implementations do), ``fc``
    projects them back to ``hidden_size``, one full-attention decoder layer
    with the MLP of layer 0 runs over them with its own KV cache, and a final
    norm gives the state the shared ``lm_head`` reads — and the hidden state
    the next drafting step takes in place of the model's.
    """

    def __init__(self, cfg: HybridConfig, kernels: Kernels, fused: bool) -> None:
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.pre_fc_norm_embedding = nn.RMSNorm(d, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(d, eps=eps)
        self.fc = nn.Linear(2 * d, d, bias=False)
        self.layers = [DecoderLayer(cfg, 0, kernels, fused, attention=True)]
        self.norm = nn.RMSNorm(d, eps=eps)

    def __call__(self, hidden: mx.array, embeddings: mx.array, cache: list[Any]) -> mx.array:
        x = mx.concatenate(
            [self.pre_fc_norm_embedding(embeddings), self.pre_fc_norm_hidden(hidden)], axis=-1
        )
        x = self.fc(x)
        mask = create_attention_mask(x, cache[0])
        for layer, c in zip(self.layers, cache, strict=True):
            x = layer(x, mask, c)
        return self.norm(x)


#: Why a graph built without ``mtp_missing`` has no MTP head.
NO_MTP_WEIGHTS = "the checkpoint holds no mtp.* tensors"


class Model(nn.Module):
    """The whole causal LM; satisfies :class:`mlx_loom.plugin.CausalLM`, and
    :class:`mlx_loom.plugin.MultiTokenPredictor` (drafting with its ``mtp.*`` head) when
    the checkpoint ships one.

    ``mtp_missing`` is why the graph has no MTP head (``None``: it has one).
    """

    def __init__(
        self,
        cfg: HybridConfig,
        kernels: Kernels,
        *,
        fused: bool,
        mtp_missing: str | None = NO_MTP_WEIGHTS,
    ) -> None:
        super().__init__()
        self.config = cfg
        self.model = HybridModel(cfg, kernels, fused)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._mtp_missing = mtp_missing
        if mtp_missing is None:
            self.mtp = MtpHead(cfg, kernels, fused)

    def _logits(self, h: mx.array) -> mx.array:
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None) -> mx.array:
        return self._logits(self.model(inputs, cache))

    # --- multi-token prediction (mlx_loom.plugin.MultiTokenPredictor) ---

    def mtp_refusal(self) -> str | None:
        return self._mtp_missing

    def forward_hidden(
        self, inputs: mx.array, cache: list[Any] | None = None
    ) -> tuple[mx.array, mx.array]:
        """Logits and the final-normed hidden states the MTP head reads."""
        h = self.model(inputs, cache)
        return self._logits(h), h

    def make_mtp_cache(self) -> list[Any]:
        return [KVCache() for _ in self.mtp.layers]

    def mtp_forward(
        self, hidden: mx.array, tokens: mx.array, cache: list[Any]
    ) -> tuple[mx.array, mx.array]:
        """The head's logits at the last position and its hidden states."""
        h = self.mtp(hidden, self.model.embed_tokens(tokens), cache)
        return self._logits(h[:, -1, :]), h

    @property
    def layers(self) -> list[DecoderLayer]:
        return self.model.layers

    def make_cache(self) -> list[Any]:
        """A :class:`RecurrentCache` per delta-net layer, a :class:`KVCache` per attention layer."""
        return [RecurrentCache() if layer.is_linear else KVCache() for layer in self.layers]

    # --- conversion (``loom convert``): mlx-lm's choices for these families ---

    @property
    def quant_predicate(self) -> Callable[[str, nn.Module], bool | dict[str, int]] | None:
        """The expert router and the shared expert's gate stay at 8 bits: their few
        outputs decide which experts run, and 4-bit routing changes the choice."""
        if isinstance(self.config, Qwen3_5Config) and self.config.num_experts <= 0:
            return None

        def predicate(path: str, _: nn.Module) -> bool | dict[str, int]:
            if path.endswith("mlp.gate") or path.endswith("shared_expert_gate"):
                return {"group_size": 64, "bits": 8}
            return True

        return predicate

    @property
    def cast_predicate(self) -> Callable[[str], bool]:
        """Qwen3.5 keeps ``A_log`` in its stored precision when the rest is cast."""
        keep = isinstance(self.config, Qwen3_5Config)
        return lambda path: not (keep and path.endswith("A_log"))
