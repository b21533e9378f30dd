"""The adapted layers: a base layer plus low-rank factors, for inference.

Each adapted layer wraps the layer the family built (kept as ``base``,
untouched) and holds one set of factors per adapter it serves. The update is
the one mlx-lm's tuner computes, with the same expressions in the same order,
so logits are bit-equal to ``mlx_lm.load(..., adapter_path=...)``:

* LoRA linear: ``y = base(x) + (scale * ((x @ A) @ B)).astype(x.dtype)``
  with ``A [in, r]``, ``B [r, out]`` (mlx-lm's ``LoRALinear``);
* DoRA linear: ``W`` is the (dequantized) base weight,
  ``y = (m / ||W + scale * B^T A^T||_row).astype(x.dtype) * (x @ W^T + lora)``
  plus the base bias (mlx-lm's ``DoRALinear``);
* routed-expert LoRA: the same delta per routed expert, ``A [E, r, in]``,
  ``B [E, out, r]`` gathered by the router's indices (``LoRASwitchLinear``);
* embeddings, LoRA and DoRA, both as a lookup and as the tied output head.

Dropout is a training device: at inference mlx-lm's dropout layers are the
identity, so it is not modelled. The DoRA magnitude ratio ``m / ||W + ΔW||``
depends only on weights, so it is computed once, when the adapter is applied,
instead of on every call (same ops on the same inputs: the same bits).

**Several adapters, one batch.** A layer built for an
:class:`~mlx_loom.adapters.AdapterSet` holds one factor set per registered
adapter and reads, for each forward, which adapter each batch row uses (a
:class:`RowSelection`, set by the caller around the forward). The base layer
runs once over the whole batch; each adapter's update is computed on its own
rows only (``x[rows]``) and written into those rows; rows without an adapter
keep the base output untouched. A row's values are therefore the ones its solo
run computes: the same ops on the same row (MLX computes each row of a
matmul independently of the others, measured bit-for-bit). Routed-expert
projections are the exception: once an expert block has sorted the (token,
expert) pairs by expert, which row a pair came from is gone, so a projection
refuses a batch that mixes adapters there. The core's expert block is split by
row before that happens (:class:`~mlx_loom.adapters.multi.RowSplitExperts`);
rows whose adapters adapt a family's own expert layer batch per adapter.

``fused()`` returns the tensors of the equivalent plain layer (``weight``,
``bias``, and ``scales``/``biases`` when re-quantized), which is what ``loom
fuse`` writes; the arithmetic is mlx-lm's ``fuse()``, except that a fused DoRA
weight is rounded back to the base weight's dtype (mlx-lm leaves it in the
magnitude vector's dtype, usually fp32, inside an otherwise bf16 checkpoint).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn

from mlx_loom.errors import AdapterError

__all__ = [
    "AdaptedEmbedding",
    "AdaptedExpertLinear",
    "AdaptedLayer",
    "AdaptedLinear",
    "Factors",
    "RowSelection",
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


def _plain_tensors(weight: mx.array, base: nn.Module, *, dequantize: bool) -> dict[str, mx.array]:
    """A fused weight as the tensors of the base's kind of layer (re-packed if it was)."""
    if is_quantized(base) and not dequantize:
        mode = getattr(base, "mode", "affine")
        packed = mx.quantize(weight, base.group_size, base.bits, mode=mode)
        out = {"weight": packed[0], "scales": packed[1]}
        if len(packed) > 2 and packed[2] is not None:
            out["biases"] = packed[2]
    else:
        out = {"weight": weight}
    if "bias" in base:
        out["bias"] = base["bias"]
    return out


class RowSelection:
    """Which adapter each batch row uses in the current forward, per thread.

    ``None`` (the default, and outside :meth:`rows`) means "no adapter for
    any row". Each thread sees only what it set, so a forward on one thread
    never sees another thread's rows.
    """

    def __init__(self) -> None:
        self._local = threading.local()

    @property
    def current(self) -> tuple[int | None, ...] | None:
        return getattr(self._local, "rows", None)

    def rows(self, slots: Sequence[int | None]) -> _Selected:
        """Context manager: row ``i`` uses adapter slot ``slots[i]`` (``None``: none)."""
        return _Selected(self, tuple(slots))


class _Selected:
    def __init__(self, selection: RowSelection, rows: tuple[int | None, ...]) -> None:
        self._selection, self._rows = selection, rows
        self._before: tuple[int | None, ...] | None = None

    def __enter__(self) -> None:
        self._before = self._selection.current
        self._selection._local.rows = self._rows

    def __exit__(self, *exc: object) -> None:
        self._selection._local.rows = self._before


class Factors(nn.Module):
    """One adapter's tensors for one layer: ``lora_a``, ``lora_b`` (and DoRA's ``m``)."""

    def __init__(
        self, lora_a: mx.array, lora_b: mx.array, scale: float, m: mx.array | None = None
    ) -> None:
        super().__init__()
        self.lora_a = lora_a
        self.lora_b = lora_b
        if m is not None:
            self.m = m
        self.scale = scale
        self.freeze()

    @property
    def dora(self) -> bool:
        return "m" in self


#: ``(factors, x, y, row index or None) -> adapted output of those rows``
Update = Callable[[Factors, mx.array, mx.array, mx.array | None], mx.array]


class AdaptedLayer(nn.Module):
    """A family's layer plus one factor set per adapter, and how rows choose among them.

    With no :class:`RowSelection` (one adapter applied to a model), every row
    uses slot 0. With one, each forward reads the rows' slots.
    """

    def __init__(
        self,
        base: nn.Module,
        factors: Sequence[Factors | None],
        selection: RowSelection | None,
    ) -> None:
        super().__init__()
        self.base = base
        #: One entry per adapter slot; ``None`` where that adapter leaves this layer alone.
        self.adapters = [f if f is not None else {} for f in factors]
        self._selection = selection
        self.freeze()

    def _factors(self, slot: int | None) -> Factors | None:
        if slot is None:
            return None
        f = self.adapters[slot]
        return f if isinstance(f, Factors) else None

    def _carried(self, slot: int | None) -> Factors:
        """The factors of a slot known to touch this layer (one :meth:`_rows` kept)."""
        f = self._factors(slot)
        if f is None:
            raise AdapterError(
                f"adapter slot {slot} has no factors for this layer",
                fix="select only adapters that adapt this layer for it",
            )
        return f

    def _rows(self, batch: int) -> tuple[int | None, ...]:
        """Each row's slot, ``None`` for rows whose adapter does not touch this layer."""
        if self._selection is None:
            return (0,) * batch
        rows = self._selection.current
        if rows is None:
            return (None,) * batch
        if len(rows) != batch:
            raise AdapterError(
                f"a forward of {batch} row(s) was given adapters for {len(rows)} row(s)",
                fix="pass one adapter choice (or None) per batch row",
            )
        return tuple(s if self._factors(s) is not None else None for s in rows)

    def _mixed(self, x: mx.array, y: mx.array, update: Update) -> mx.array:
        """``y`` with each row's adapter update applied (see the module doc).

        ``update(factors, x, y, index)`` computes the adapted output of the
        rows ``index`` selects (``None``: the whole batch) from their inputs
        and base outputs.
        """
        rows = self._rows(x.shape[0])
        slots = set(rows)
        if slots == {None}:
            return y
        if len(slots) == 1:
            return update(self._carried(rows[0]), x, y, None)
        out = y  # a fresh base output: writing rows into it changes no one else's array
        for slot in sorted(s for s in slots if s is not None):
            index = mx.array([i for i, s in enumerate(rows) if s == slot])
            out[index] = update(self._carried(slot), x[index], y[index], index)
        return out

    def fused(self, *, dequantize: bool = False) -> dict[str, mx.array]:
        """The tensors of the plain layer with the (single) adapter folded into its weight."""
        if len(self.adapters) != 1:
            raise AdapterError(
                f"a layer carrying {len(self.adapters)} adapters cannot be fused into one weight",
                fix="fuse one adapter at a time (loom fuse --adapter-path DIR)",
            )
        return self._fused(self._carried(0), dequantize)

    def _fused(self, f: Factors, dequantize: bool) -> dict[str, mx.array]:
        raise NotImplementedError


class AdaptedLinear(AdaptedLayer):
    """A dense or quantized ``nn.Linear`` with LoRA or DoRA factors."""

    def __init__(self, base, factors, selection=None) -> None:
        super().__init__(base, factors, selection)
        for f in self.adapters:
            if isinstance(f, Factors) and f.dora:
                adapted = dense_weight(self.base) + (f.scale * f.lora_b.T) @ f.lora_a.T
                f._ratio = f.m / mx.linalg.norm(adapted, axis=1)

    def __call__(self, x: mx.array) -> mx.array:
        return self._mixed(x, self.base(x), self._update)

    def _update(self, f: Factors, x: mx.array, y: mx.array, _: mx.array | None) -> mx.array:
        z = (x @ f.lora_a) @ f.lora_b
        if not f.dora:
            return y + (f.scale * z).astype(x.dtype)
        # DoRA does not add to the base output: mlx-lm recomputes x @ W^T densely.
        out = x @ dense_weight(self.base).T + (f.scale * z).astype(x.dtype)
        out = f._ratio.astype(x.dtype) * out
        if "bias" in self.base:
            out = out + self.base["bias"]
        return out

    def _fused(self, f: Factors, dequantize: bool) -> dict[str, mx.array]:
        weight = dense_weight(self.base)
        weight = weight + ((f.scale * f.lora_b.T) @ f.lora_a.T).astype(weight.dtype)
        if f.dora:
            weight = ((f.m / mx.linalg.norm(weight, axis=1))[:, None] * weight).astype(weight.dtype)
        return _plain_tensors(weight, self.base, dequantize=dequantize)


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


def _mixed_experts() -> AdapterError:
    return AdapterError(
        "rows with different adapters on routed-expert projections met in one batch whose "
        "(token, expert) pairs were regrouped by expert, which loses each pair's row",
        fix="run rows whose adapters adapt routed experts in batches of one adapter",
    )


class AdaptedExpertLinear(AdaptedLayer):
    """A routed-expert projection (``weight [E, out, in]``) with a LoRA update per expert.

    The family's expert layer is driven through whichever entry points it
    offers — mlx-lm's ``__call__(x, indices, sorted_indices)`` contract, or a
    ``gather``/``expert_matmul`` pair — and the same delta is added to each.
    """

    @property
    def weight(self) -> mx.array:
        return self.base["weight"]

    @property
    def is_quantized(self) -> bool:
        return is_quantized(self.base)

    @staticmethod
    def _delta(f: Factors, x: mx.array, indices: mx.array, sorted_indices: bool) -> mx.array:
        z = _gather_product(x, f.lora_a, indices, sorted_indices)
        z = _gather_product(z, f.lora_b, indices, sorted_indices)
        return (f.scale * z).astype(x.dtype)

    def _uniform_slot(self) -> tuple[bool, int | None]:
        """(every row uses the same slot here, that slot) for the current forward."""
        if self._selection is None:
            return True, 0
        rows = self._selection.current
        if rows is None:
            return True, None
        slots = {s if self._factors(s) is not None else None for s in rows}
        return (True, slots.pop()) if len(slots) == 1 else (False, None)

    def _routed(self, x, indices, sorted_indices, y):
        uniform, slot = self._uniform_slot()
        if uniform:
            if slot is None:
                return y
            return y + self._delta(self._factors(slot), x, indices, sorted_indices)
        if sorted_indices:
            raise _mixed_experts()

        def update(f, xs, ys, index):
            rows = indices if index is None else indices[index]
            return ys + self._delta(f, xs, rows, sorted_indices)

        return self._mixed(x, y, update)

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        return self._routed(x, indices, sorted_indices, self.base(x, indices, sorted_indices))

    def gather(self, x: mx.array, indices: mx.array, sorted_indices: bool) -> mx.array:
        return self._routed(
            x, indices, sorted_indices, self.base.gather(x, indices, sorted_indices)
        )

    def expert_matmul(self, x: mx.array, expert: int) -> mx.array:
        """One expert on a group of tokens (which rows they came from is not known here)."""
        y = self.base.expert_matmul(x, expert)
        uniform, slot = self._uniform_slot()
        if not uniform:
            raise _mixed_experts()
        if slot is None:
            return y
        f = self._carried(slot)
        z = (x @ f.lora_a[expert].T) @ f.lora_b[expert].T
        return y + (f.scale * z).astype(x.dtype)

    def _fused(self, f: Factors, dequantize: bool) -> dict[str, mx.array]:
        weight = dense_weight(self.base)
        delta = ((f.scale * f.lora_b) @ f.lora_a).astype(weight.dtype)
        return _plain_tensors(weight + delta, self.base, dequantize=dequantize)


class AdaptedEmbedding(AdaptedLayer):
    """An embedding with LoRA (``+ scale * A[ids] @ B``) or DoRA factors; also the tied head."""

    def __init__(self, base, factors, selection=None) -> None:
        super().__init__(base, factors, selection)
        for f in self.adapters:
            if isinstance(f, Factors) and f.dora:
                adapted = self.base["weight"] + (f.scale * f.lora_a) @ f.lora_b
                f._ratio = f.m / mx.linalg.norm(adapted, axis=1)

    def __call__(self, ids: mx.array) -> mx.array:
        return self._mixed(ids, self.base(ids), self._lookup)

    def as_linear(self, x: mx.array) -> mx.array:
        return self._mixed(x, self.base.as_linear(x), self._head)

    @staticmethod
    def _lookup(f: Factors, ids: mx.array, y: mx.array, _: mx.array | None) -> mx.array:
        if not f.dora:
            z = f.lora_a[ids] @ f.lora_b
            return y + (f.scale * z).astype(y.dtype)
        z = (f.scale * f.lora_a[ids]) @ f.lora_b
        out = y + z.astype(y.dtype)
        denom = mx.linalg.norm(y + z, axis=-1)
        return (f.m[ids] / denom)[..., None] * out

    @staticmethod
    def _head(f: Factors, x: mx.array, y: mx.array, _: mx.array | None) -> mx.array:
        z = (x @ f.lora_b.T) @ f.lora_a.T
        out = y + (f.scale * z).astype(x.dtype)
        return f._ratio * out if f.dora else out

    def _fused(self, f: Factors, dequantize: bool) -> dict[str, mx.array]:
        weight = dense_weight(self.base)
        weight = weight + ((f.scale * f.lora_a) @ f.lora_b).astype(weight.dtype)
        if f.dora:
            fused = (f.m / mx.linalg.norm(weight, axis=1))[:, None] * weight
            return {"weight": fused.astype(weight.dtype)}
        return _plain_tensors(weight, self.base, dequantize=dequantize)


def adapted_layers(module: nn.Module) -> list[tuple[str, AdaptedLayer]]:
    """Every adapted layer in ``module``'s tree, with its path."""
    return [(p, m) for p, m in module.named_modules() if isinstance(m, AdaptedLayer)]
