"""The one rule for weights that hold NaN or Inf: find the tensors, cheaply.

A base checkpoint (at load), an adapter's factors and a full fine-tune's
replacement weights all pass through here, so a NaN is refused wherever it
comes from, not only in the base model.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx


def screen(a: mx.array) -> mx.array:
    """A float32 scalar that is finite when every element of ``a`` is (or overflowed).

    Summing the columns first (``axis=0``, which MLX's CPU backend vectorises
    across the row) and then the resulting row is 2.4x faster than one full
    reduction; measured on a busy 2-core CPU, 0.27 s for a 0.54 GB bf16
    tensor against 0.9 s for reading it from a warm page cache.
    """
    rows = a.reshape(-1, a.shape[-1]) if a.ndim >= 2 else a.reshape(1, -1)
    return mx.sum(mx.sum(rows, axis=0)).astype(mx.float32)


def non_finite(
    named: Sequence[tuple[str, mx.array]], *, also_eval: Sequence[mx.array] = ()
) -> list[str]:
    """The names of the floating tensors in ``named`` that hold NaN or Inf.

    One reduction per tensor, evaluated in the same pass as the tensors (and
    ``also_eval``): a NaN or Inf anywhere makes the sum non-finite. A
    non-finite sum can also be the overflow of a large finite fp16 tensor, so
    a flagged tensor is confirmed with max/min, which propagate NaN and
    cannot overflow.
    """
    floating = [(name, a) for name, a in named if mx.issubdtype(a.dtype, mx.floating)]
    sums = mx.stack([screen(a) for _, a in floating]) if floating else None
    mx.eval([a for _, a in named], *also_eval, *([sums] if sums is not None else []))
    if sums is None or bool(mx.all(mx.isfinite(sums)).item()):
        return []
    finite: list[bool] = mx.isfinite(sums).tolist()  # type: ignore[assignment]
    flagged = [floating[i] for i, ok in enumerate(finite) if not ok]
    bad = []
    for name, a in flagged:
        extremes = mx.stack([mx.max(a), mx.min(a)]).astype(mx.float32)
        if not bool(mx.all(mx.isfinite(extremes)).item()):
            bad.append(name)
    return bad


def named_list(names: Sequence[str]) -> str:
    """``'a', 'b' and 3 more`` — at most five names."""
    more = f" and {len(names) - 5} more" if len(names) > 5 else ""
    return f"{', '.join(repr(n) for n in names[:5])}{more}"
