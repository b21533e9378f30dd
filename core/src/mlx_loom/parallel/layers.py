"""The modules a split graph runs: where partial products meet, and the vocabulary split.

A split never changes a module's path or its parameter names (adapters,
quantization overrides and ``loom explain`` keep addressing the graph the
family wrote): a column-split linear is the same ``nn.Linear`` holding fewer
rows, and the modules below *replace the class* of an existing instance, so
its parameters stay where the loader put them.

* :class:`RowLinear` / :class:`RowQuantizedLinear` — a linear holding a slice
  of its input features: ``all_sum`` of the partial products, then the bias
  (once, not once per rank).
* :func:`reduce_output` — any module whose output is a partial sum (a
  mixture-of-experts block) gets its output summed across the group.
* :class:`VocabEmbedding` (and quantized) — a table holding a block of the
  vocabulary's rows; a lookup takes this rank's rows, zero elsewhere, and
  ``all_sum`` s. Exactly one rank contributes each row and ``x + 0`` is exact,
  so the result is bit-identical to one process. Its ``as_linear`` (a tied
  head) and :class:`VocabHead` (an untied one) compute this rank's logits and
  ``all_gather`` them: each logit is one rank's dot product, computed as one
  process computes it (MLX's CPU matmul gives a column the same bits whatever
  columns sit beside it — measured for fp32, bf16, fp16 and affine-quantized
  weights), so the head is bit-identical too.

Every collective here runs on :func:`~.lockstep.comm_stream`.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .lockstep import comm_stream

__all__ = [
    "RowLinear",
    "RowQuantizedLinear",
    "VocabEmbedding",
    "VocabHead",
    "VocabQuantizedEmbedding",
    "VocabQuantizedHead",
    "gather_vocab",
    "make_row_parallel",
    "make_vocab_parallel",
    "reduce_output",
]


class RowLinear(nn.Linear):
    """An ``nn.Linear`` holding a slice of its input features; sums across ``group``.

    bf16/fp16: the partial products are computed, summed and biased in fp32
    and rounded to the input dtype once, as one process's matmul accumulates
    in fp32 and rounds once (MLX's CPU kernel). Measured, [1, 768] x
    [768, 512] split in two: every output equals one process's this way;
    summing bf16 partials (each rounded first) left 37% one rounding off. At
    64 rows MLX's own blocked accumulation order makes 0.01% differ either
    way. The cost is converting this rank's slice of the weight per call
    (0.60 -> 0.82 ms for that shape).
    """

    group: Any

    def __call__(self, x: mx.array) -> mx.array:
        if x.dtype == mx.float32:
            y = mx.distributed.all_sum(x @ self["weight"].T, group=self.group, stream=comm_stream())
            return y + self["bias"] if "bias" in self else y
        partial = x.astype(mx.float32) @ self["weight"].astype(mx.float32).T
        y = mx.distributed.all_sum(partial, group=self.group, stream=comm_stream())
        if "bias" in self:
            y = y + self["bias"].astype(mx.float32)
        return y.astype(x.dtype)


class RowQuantizedLinear(nn.QuantizedLinear):
    """An ``nn.QuantizedLinear`` holding a slice of its input features (whole groups)."""

    group: Any

    def __call__(self, x: mx.array) -> mx.array:
        y = mx.quantized_matmul(
            x,
            self["weight"],
            scales=self["scales"],
            biases=self.get("biases"),
            transpose=True,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
        )
        y = mx.distributed.all_sum(y, group=self.group, stream=comm_stream())
        return y + self["bias"] if "bias" in self else y


def make_row_parallel(module: nn.Module, group: Any) -> None:
    """Turn a linear whose input features were sliced into one that sums across ``group``."""
    if isinstance(module, nn.QuantizedLinear):
        module.__class__ = RowQuantizedLinear
    elif isinstance(module, nn.Linear):
        module.__class__ = RowLinear
    else:
        raise TypeError(f"{type(module).__name__} is not an nn.Linear or nn.QuantizedLinear")
    module.group = group


@cache
def _reducing(cls: type) -> type:
    def __call__(self: Any, *args: Any, **kwargs: Any) -> mx.array:
        out = cls.__call__(self, *args, **kwargs)
        if not isinstance(out, mx.array):
            raise TypeError(
                f"{cls.__name__} returns {type(out).__name__}; only a module returning one "
                "array can have its output summed across the group"
            )
        return mx.distributed.all_sum(out, group=self.group, stream=comm_stream())

    return type(f"Summed{cls.__name__}", (cls,), {"__call__": __call__, "__doc__": cls.__doc__})


def reduce_output(module: nn.Module, group: Any) -> None:
    """Sum ``module``'s output across ``group`` (its class becomes a subclass that does)."""
    module.__class__ = _reducing(type(module))
    module.group = group


def gather_vocab(local: mx.array, module: Any) -> mx.array:
    """Every rank's block of logits along the last axis, concatenated to the whole vocabulary.

    Blocks are padded to one size (``all_gather`` needs equal shapes) and the
    padding dropped, so a vocabulary need not divide across the group.
    """
    block, total = module.vocab_block, module.vocab_total
    pad = block - local.shape[-1]
    if pad:
        local = mx.pad(local, [(0, 0)] * (local.ndim - 1) + [(0, pad)])
    gathered = mx.distributed.all_gather(
        mx.moveaxis(local, -1, 0), group=module.group, stream=comm_stream()
    )
    return mx.moveaxis(gathered[:total], 0, -1)


class _VocabRows:
    """A token-indexed table holding rows ``[vocab_start, vocab_start + rows)``."""

    group: Any
    vocab_start: int
    vocab_block: int
    vocab_total: int

    def __call__(self, ids: mx.array) -> mx.array:
        local = ids.astype(mx.int32) - self.vocab_start
        inside = (local >= 0) & (local < self["weight"].shape[0])
        rows = super().__call__(mx.where(inside, local, 0))  # type: ignore[misc]
        rows = mx.where(inside[..., None], rows, 0)
        return mx.distributed.all_sum(rows, group=self.group, stream=comm_stream())

    def as_linear(self, x: mx.array) -> mx.array:
        return gather_vocab(super().as_linear(x), self)  # type: ignore[misc]


class VocabEmbedding(_VocabRows, nn.Embedding):
    """An ``nn.Embedding`` holding one rank's block of the vocabulary."""


class VocabQuantizedEmbedding(_VocabRows, nn.QuantizedEmbedding):
    """An ``nn.QuantizedEmbedding`` holding one rank's block of the vocabulary."""


class _VocabColumns:
    group: Any
    vocab_block: int
    vocab_total: int

    def __call__(self, x: mx.array) -> mx.array:
        return gather_vocab(super().__call__(x), self)  # type: ignore[misc]


class VocabHead(_VocabColumns, nn.Linear):
    """An untied output ``nn.Linear`` holding one rank's block of the vocabulary."""


class VocabQuantizedHead(_VocabColumns, nn.QuantizedLinear):
    """An untied quantized output linear holding one rank's block of the vocabulary."""


_VOCAB_CLASSES: dict[type, type] = {
    nn.Embedding: VocabEmbedding,
    nn.QuantizedEmbedding: VocabQuantizedEmbedding,
    nn.Linear: VocabHead,
    nn.QuantizedLinear: VocabQuantizedHead,
}


def make_vocab_parallel(
    module: nn.Module, group: Any, *, start: int, block: int, total: int
) -> None:
    """Make a table or head whose vocabulary rows were sliced to ``[start, start + rows)``."""
    cls = _VOCAB_CLASSES.get(type(module))
    if cls is None:
        raise TypeError(
            f"{type(module).__name__} is not an nn.Embedding, nn.Linear or their quantized forms"
        )
    module.__class__ = cls
    module.group = group
    module.vocab_start, module.vocab_block, module.vocab_total = start, block, total
