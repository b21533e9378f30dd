"""The adapted layers: a base layer plus its low-rank factors, for inference.

Each class wraps the layer the family built (kept as ``base``, untouched) and
adds the update mlx-lm's tuner computes, with the same expressions in the same
order, so logits are bit-equal to ``mlx_lm.load(..., adapter_path=...)``:

* LoRA linear: ``y = base(x) + (scale * ((x @ A) @ B)).astype(x.dtype)``
  with ``A [in, r]``, ``B [r, out]`` (mlx-lm's ``LoRALinear``);
* DoRA linear: ``W`` is the (dequantized) base weight,
  ``y = (m / ||W + scale * B^T A^T||_row).astype(x.dtype) * (x @ W^T + lora)``
  plus the base bias (mlx-lm's ``DoRALinear``);
* routed-expert LoRA: the same delta per routed expert, ``A [E, r, in]``,
  ``B [E, out, r]`` gathered by the router's indices (``LoRASwitchLinear``);
* embeddings, LoRA and DoRA, both as a lookup and as the tied output head.

Dropout is a training device: at inference mlx-lm's dropout layers are the
identity, so it is not modelled here at all.

Two inference-only shortcuts, neither changing a bit: the DoRA magnitude
ratio ``m / ||W + ΔW||`` depends only on weights, so it is computed once
when the adapter is applied instead of on every call (same ops, same inputs,
same result); and nothing here is trainable (every layer is frozen).

``fused()`` returns the tensors of the equivalent plain layer (``weight``,
``bias``, and ``scales``/``biases`` when re-quantized), which is what ``loom
fuse`` writes; the arithmetic is mlx-lm's ``fuse()``, except that a fused DoRA
weight is rounded back to the base weight's dtype (mlx-lm leaves it in the
magnitude vector's dtype, usually fp32, inside an otherwise bf16 checkpoint).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

__all__ = [
    "AdaptedLayer",
    "DoRAEmbedding",
    "DoRALinear",
    "LoRAEmbedding",
    "LoRAExpertLinear",
    "LoRALinear",
    "adapted_layers",
    "dense_weight",
    "is_quantized",
]


def is_quantized(layer: nn.Module) -> bool:
    """Whether ``layer`` stores an affine-packed weight (``scales`` beside ``weight``)."""
    return "scales" in layer


def dense_weight(layer: nn.Module) -> mx.array:
    """The layer's weight as a dense matrix (dequantized when it is packed)."""
    weight = layer["weight"]
    if not is_quantized(layer):
        return weight
    return mx.dequantize(
        weight,
        layer["scales"],
        layer.get("biases"),
        group_size=layer.group_size,
        bits=layer.bits,
        mode=getattr(layer, "mode", "affine"),
    )


def _requantized(weight: mx.array, like: nn.Module) -> dict[str, mx.array]:
    """``weight`` packed with ``like``'s group size, bits and mode."""
    packed = mx.quantize(weight, like.group_size, like.bits, mode=getattr(like, "mode", "affine"))
    out = {"weight": packed[0], "scales": packed[1]}
    if len(packed) > 2 and packed[2] is not None:
        out["biases"] = packed[2]
    return out


def _plain_tensors(weight: mx.array, base: nn.Module, *, dequantize: bool) -> dict[str, mx.array]:
    out = (
        _requantized(weight, base) if is_quantized(base) and not dequantize else {"weight": weight}
    )
    if "bias" in base:
        out["bias"] = base["bias"]
    return out


class AdaptedLayer(nn.Module):
    """Common face of the adapted layers: the wrapped ``base`` and the update's ``scale``."""

    kind = "lora"

    def __init__(self, base: nn.Module, scale: float) -> None:
        super().__init__()
        self.base = base
        self.scale = scale

    def fused(self, *, dequantize: bool = False) -> dict[str, mx.array]:
        """The tensors of the plain layer with the update folded into its weight."""
        raise NotImplementedError


class LoRALinear(AdaptedLayer):
    """A dense or quantized ``nn.Linear`` plus ``scale * (x @ A) @ B``."""

    def __init__(self, base: nn.Module, lora_a: mx.array, lora_b: mx.array, scale: float):
        super().__init__(base, scale)
        self.lora_a = lora_a
        self.lora_b = lora_b
        self.freeze()

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)
        z = (x @ self.lora_a) @ self.lora_b
        return y + (self.scale * z).astype(x.dtype)

    def fused(self, *, dequantize: bool = False) -> dict[str, mx.array]:
        weight = dense_weight(self.base)
        delta = ((self.scale * self.lora_b.T) @ self.lora_a.T).astype(weight.dtype)
        return _plain_tensors(weight + delta, self.base, dequantize=dequantize)


class DoRALinear(AdaptedLayer):
    """Weight-decomposed LoRA: the adapted output rescaled to the learned row magnitudes ``m``."""

    kind = "dora"

    def __init__(
        self, base: nn.Module, lora_a: mx.array, lora_b: mx.array, m: mx.array, scale: float
    ):
        super().__init__(base, scale)
        self.lora_a = lora_a
        self.lora_b = lora_b
        self.m = m
        self.freeze()
        self._ratio = self.m / mx.linalg.norm(self._adapted_weight(), axis=1)

    def _adapted_weight(self) -> mx.array:
        return dense_weight(self.base) + (self.scale * self.lora_b.T) @ self.lora_a.T

    def __call__(self, x: mx.array) -> mx.array:
        w = dense_weight(self.base)
        y = x @ w.T
        z = (x @ self.lora_a) @ self.lora_b
        out = y + (self.scale * z).astype(x.dtype)
        out = self._ratio.astype(x.dtype) * out
        if "bias" in self.base:
            out = out + self.base["bias"]
        return out

    def fused(self, *, dequantize: bool = False) -> dict[str, mx.array]:
        weight = dense_weight(self.base)
        weight = weight + ((self.scale * self.lora_b.T) @ self.lora_a.T).astype(weight.dtype)
        fused = (self.m / mx.linalg.norm(weight, axis=1))[:, None] * weight
        return _plain_tensors(fused.astype(weight.dtype), self.base, dequantize=dequantize)


def _gather_product(x: mx.array, w: mx.array, indices: mx.array, sorted_indices: bool):
    """``x @ w[indices].T`` per routed expert, rounded to ``x``'s dtype.

    fp32: ``mx.gather_mm``, exactly mlx-lm's call. Other dtypes: ``gather_mm``
    is fp32-only on MLX's CPU backend (0.32: "[GatherMM::eval] Currently only
    supports float32"), so the operands are upcast (exact) and the product is
    rounded once to ``x``'s dtype — what a low-precision ``gather_mm`` with
    fp32 accumulation delivers on a GPU.
    """
    if x.dtype == mx.float32 and w.dtype == mx.float32:
        return mx.gather_mm(
            x, w.swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sorted_indices
        )
    out = mx.gather_mm(
        x.astype(mx.float32),
        w.astype(mx.float32).swapaxes(-1, -2),
        rhs_indices=indices,
        sorted_indices=sorted_indices,
    )
    return out.astype(x.dtype)


class LoRAExpertLinear(AdaptedLayer):
    """A routed-expert projection (``weight [E, out, in]``) plus a LoRA update per expert.

    The family's expert layer is driven through whichever entry points it
    offers — mlx-lm's ``__call__(x, indices, sorted_indices)`` contract, or a
    ``gather``/``expert_matmul`` pair — and the same delta is added to each.
    """

    def __init__(self, base: nn.Module, lora_a: mx.array, lora_b: mx.array, scale: float):
        super().__init__(base, scale)
        self.lora_a = lora_a
        self.lora_b = lora_b
        self.freeze()

    @property
    def weight(self) -> mx.array:
        return self.base["weight"]

    @property
    def is_quantized(self) -> bool:
        return is_quantized(self.base)

    def _delta(self, x: mx.array, indices: mx.array, sorted_indices: bool) -> mx.array:
        z = _gather_product(x, self.lora_a, indices, sorted_indices)
        z = _gather_product(z, self.lora_b, indices, sorted_indices)
        return (self.scale * z).astype(x.dtype)

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        return self.base(x, indices, sorted_indices) + self._delta(x, indices, sorted_indices)

    def gather(self, x: mx.array, indices: mx.array, sorted_indices: bool) -> mx.array:
        return self.base.gather(x, indices, sorted_indices) + self._delta(
            x, indices, sorted_indices
        )

    def expert_matmul(self, x: mx.array, expert: int) -> mx.array:
        z = (x @ self.lora_a[expert].T) @ self.lora_b[expert].T
        return self.base.expert_matmul(x, expert) + (self.scale * z).astype(x.dtype)

    def fused(self, *, dequantize: bool = False) -> dict[str, mx.array]:
        weight = dense_weight(self.base)
        delta = ((self.scale * self.lora_b) @ self.lora_a).astype(weight.dtype)
        return _plain_tensors(weight + delta, self.base, dequantize=dequantize)


class LoRAEmbedding(AdaptedLayer):
    """An embedding plus ``scale * A[ids] @ B``; also as the tied head (``as_linear``)."""

    def __init__(self, base: nn.Module, lora_a: mx.array, lora_b: mx.array, scale: float):
        super().__init__(base, scale)
        self.lora_a = lora_a
        self.lora_b = lora_b
        self.freeze()

    def __call__(self, ids: mx.array) -> mx.array:
        y = self.base(ids)
        z = self.lora_a[ids] @ self.lora_b
        return y + (self.scale * z).astype(y.dtype)

    def as_linear(self, x: mx.array) -> mx.array:
        y = self.base.as_linear(x)
        z = (x @ self.lora_b.T) @ self.lora_a.T
        return y + (self.scale * z).astype(x.dtype)

    def fused(self, *, dequantize: bool = False) -> dict[str, mx.array]:
        weight = dense_weight(self.base)
        delta = ((self.scale * self.lora_a) @ self.lora_b).astype(weight.dtype)
        return _plain_tensors(weight + delta, self.base, dequantize=dequantize)


class DoRAEmbedding(AdaptedLayer):
    """DoRA on a dense embedding: rows rescaled to the learned magnitudes ``m``."""

    kind = "dora"

    def __init__(
        self, base: nn.Module, lora_a: mx.array, lora_b: mx.array, m: mx.array, scale: float
    ):
        super().__init__(base, scale)
        self.lora_a = lora_a
        self.lora_b = lora_b
        self.m = m
        self.freeze()
        adapted = self.base["weight"] + (self.scale * self.lora_a) @ self.lora_b
        self._head_ratio = self.m / mx.linalg.norm(adapted, axis=1)

    def __call__(self, ids: mx.array) -> mx.array:
        y = self.base(ids)
        z = (self.scale * self.lora_a[ids]) @ self.lora_b
        out = y + z.astype(y.dtype)
        denom = mx.linalg.norm(y + z, axis=-1)
        return (self.m[ids] / denom)[..., None] * out

    def as_linear(self, x: mx.array) -> mx.array:
        y = self.base.as_linear(x)
        z = (x @ self.lora_b.T) @ self.lora_a.T
        out = y + (self.scale * z).astype(x.dtype)
        return self._head_ratio * out

    def fused(self, *, dequantize: bool = False) -> dict[str, mx.array]:
        weight = self.base["weight"]
        weight = weight + ((self.scale * self.lora_a) @ self.lora_b).astype(weight.dtype)
        fused = (self.m / mx.linalg.norm(weight, axis=1))[:, None] * weight
        return {"weight": fused.astype(weight.dtype)}


def adapted_layers(module: nn.Module) -> list[tuple[str, AdaptedLayer]]:
    """Every adapted layer in ``module``'s tree, with its path."""
    return [(p, m) for p, m in module.named_modules() if isinstance(m, AdaptedLayer)]
