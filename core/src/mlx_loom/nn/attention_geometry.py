"""What an attention layer looks like to a kernel dispatcher: heads, head dims, window.

A backend's attention kernels are chosen by shape — query length, key length,
the GQA factor and the head dims — and a speculative verify window is exact
only where it runs the kernel one-token decoding runs
(:mod:`mlx_loom.host._verify`). So each family's attention module declares its
geometry once, as :class:`AttentionGeometry` in an attribute named
``geometry``, and :func:`attention_geometries` collects the distinct ones of
a built model. Declared, not inferred from weight shapes: a KV-shared layer
has no key projection, and a sliding window is invisible in the weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.nn as nn

__all__ = ["AttentionGeometry", "attention_geometries"]


@dataclass(frozen=True)
class AttentionGeometry:
    """One attention layer kind: ``query_heads`` over ``kv_heads``, head dims, window.

    ``window`` is the sliding window in tokens (``None``: full attention).
    """

    query_heads: int
    kv_heads: int
    head_dim: int
    value_head_dim: int | None = None
    window: int | None = None

    def __post_init__(self) -> None:
        if self.kv_heads < 1 or self.query_heads % self.kv_heads:
            raise ValueError(
                f"{self.query_heads} query heads are not a multiple of {self.kv_heads} KV heads"
            )

    @property
    def gqa(self) -> int:
        """Query heads per KV head (MLX's ``gqa_factor``)."""
        return self.query_heads // self.kv_heads

    @property
    def value_dim(self) -> int:
        return self.head_dim if self.value_head_dim is None else self.value_head_dim

    def __str__(self) -> str:
        dims = f"{self.head_dim}" + (
            f"/{self.value_dim}" if self.value_dim != self.head_dim else ""
        )
        kind = f"sliding window {self.window}" if self.window else "full attention"
        return f"{self.query_heads} query / {self.kv_heads} KV heads of {dims} ({kind})"


def attention_geometries(module: nn.Module) -> tuple[AttentionGeometry, ...]:
    """The distinct attention geometries a model's modules declare, in first-seen order."""
    seen: dict[AttentionGeometry, None] = {}
    for m in module.modules():
        geometry = getattr(m, "geometry", None)
        if isinstance(geometry, AttentionGeometry):
            seen.setdefault(geometry)
    return tuple(seen)
