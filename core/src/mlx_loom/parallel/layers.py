"""Where partial products meet, and the vocabulary split: the class changes a split model gets.

A split never changes a module's path or its parameter names (adapters,
quantization overrides and ``loom explain`` keep addressing the graph the
family wrote): a column-split linear is the same module holding fewer rows,
and the functions below *replace the class* of an existing instance with a
subclass of whatever class it has — ``nn.Linear``, or the CPU path's native
``NativeLinear`` swapped in before (:mod:`mlx_loom.cpu.layers`) — so the
module's own product runs, and only the communication is added:

* :func:`row_parallel` — a linear holding a slice of its input features:
  ``all_sum`` of the partial products (the bias is kept by rank 0 alone, so
  it is added once);
* :func:`reduce_output` — any module whose output is a partial sum (a
  mixture-of-experts block) gets its output summed across the group;
* :func:`vocab_rows` — a table holding a block of the vocabulary's rows; a
  lookup takes this rank's rows, zero elsewhere, and ``all_sum`` s. Exactly
  one rank contributes each row and ``x + 0`` is exact, so the result is
  bit-identical to one process. Its ``as_linear`` (a tied head) and
  :func:`vocab_head` (an untied one) compute this rank's logits and
  ``all_gather`` them: each logit is one rank's dot product, computed as one
  process computes it (MLX's CPU matmul gives a column the same bits whatever
  columns sit beside it — measured for fp32, bf16, fp16 and affine-quantized
  weights), so the head is bit-identical too.

Every collective here runs on :func:`~.lockstep.comm_stream`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .lockstep import comm_stream

__all__ = ["gather_vocab", "reduce_output", "row_parallel", "vocab_head", "vocab_rows"]

_HALF = (mx.bfloat16, mx.float16)


def _all_sum(x: mx.array, group: Any) -> mx.array:
    return mx.distributed.all_sum(x, group=group, stream=comm_stream())


def _swap(module: nn.Module, make: Callable[[type], type], group: Any) -> None:
    module.__class__ = make(type(module))
    module.group = group


@cache
def _row(cls: type) -> type:
    """``cls`` whose output — a partial product over its slice of the inputs — is summed.

    A plain ``nn.Linear`` (MLX's matmul, which computes in the activation
    dtype) with bf16/fp16 activations computes its partial product, the sum
    and the bias in fp32 and rounds once, as one process's matmul
    accumulates in fp32 and rounds once (MLX's CPU kernel). Measured,
    [1, 768] x [768, 512] split in two: every output equals one process's
    this way; summing bf16 partials (each rounded first) left 37% one
    rounding off; at 64 rows MLX's own blocked accumulation leaves 0.01% off
    either way. The cost is converting this rank's slice of the weight per
    call (0.60 -> 0.82 ms for that shape). Other classes (quantized, the CPU
    path's native kernels, which accumulate in fp32 themselves) keep their
    own arithmetic.
    """
    upcast = cls is nn.Linear

    def __call__(self: Any, x: mx.array) -> mx.array:
        if upcast and x.dtype in _HALF:
            y = x.astype(mx.float32) @ self["weight"].astype(mx.float32).T
            if "bias" in self:
                y = y + self["bias"].astype(mx.float32)
            return _all_sum(y, self.group).astype(x.dtype)
        return _all_sum(cls.__call__(self, x), self.group)

    return type(f"Row{cls.__name__}", (cls,), {"__call__": __call__, "__doc__": cls.__doc__})


def row_parallel(module: nn.Module, group: Any) -> None:
    """Sum a linear's partial products (its input features were sliced) across ``group``."""
    _swap(module, _row, group)


@cache
def _reducing(cls: type) -> type:
    def __call__(self: Any, *args: Any, **kwargs: Any) -> mx.array:
        out = cls.__call__(self, *args, **kwargs)
        if not isinstance(out, mx.array):
            raise TypeError(
                f"{cls.__name__} returns {type(out).__name__}; only a module returning one "
                "array can have its output summed across the group"
            )
        return _all_sum(out, self.group)

    return type(f"Summed{cls.__name__}", (cls,), {"__call__": __call__, "__doc__": cls.__doc__})


def reduce_output(module: nn.Module, group: Any) -> None:
    """Sum ``module``'s output across ``group`` (its class becomes a subclass that does)."""
    _swap(module, _reducing, group)


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


@cache
def _rows(cls: Any) -> type:  # an embedding class, as_linear included
    """``cls`` (a table) holding rows ``[vocab_start, vocab_start + rows)`` of the vocabulary."""

    def __call__(self: Any, ids: mx.array) -> mx.array:
        local = ids.astype(mx.int32) - self.vocab_start
        inside = (local >= 0) & (local < self["weight"].shape[0])
        rows = cls.__call__(self, mx.where(inside, local, 0))
        return _all_sum(mx.where(inside[..., None], rows, 0), self.group)

    def as_linear(self: Any, x: mx.array) -> mx.array:
        return gather_vocab(cls.as_linear(self, x), self)

    return type(
        f"Vocab{cls.__name__}",
        (cls,),
        {"__call__": __call__, "as_linear": as_linear, "__doc__": cls.__doc__},
    )


@cache
def _head(cls: type) -> type:
    """``cls`` (an output linear) holding one rank's block of the vocabulary."""

    def __call__(self: Any, x: mx.array) -> mx.array:
        return gather_vocab(cls.__call__(self, x), self)

    return type(f"Vocab{cls.__name__}", (cls,), {"__call__": __call__, "__doc__": cls.__doc__})


def _vocab(module: nn.Module, make, group: Any, start: int, block: int, total: int) -> None:
    _swap(module, make, group)
    module.vocab_start, module.vocab_block, module.vocab_total = start, block, total


def vocab_rows(module: nn.Module, group: Any, *, start: int, block: int, total: int) -> None:
    """Make a token-indexed table whose rows were sliced to ``[start, start + rows)``."""
    _vocab(module, _rows, group, start, block, total)


def vocab_head(module: nn.Module, group: Any, *, start: int, block: int, total: int) -> None:
    """Make an untied output linear whose vocabulary rows were sliced likewise."""
    _vocab(module, _head, group, start, block, total)
