"""The gated feed-forward every family here uses: ``down(act(gate(x)) * up(x))``."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .activations import Activation, swiglu

__all__ = ["GatedMLP"]


class GatedMLP(nn.Module):
    """A GLU feed-forward with Hugging Face's module names (``gate_proj``, ``up_proj``,
    ``down_proj``), so checkpoints load by name. The projections are plain
    ``mlx.nn.Linear`` layers (quantizable, swappable for other linear kernels).
    """

    def __init__(
        self, dims: int, hidden: int, *, activation: Activation = swiglu, bias: bool = False
    ) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dims, hidden, bias=bias)
        self.up_proj = nn.Linear(dims, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dims, bias=bias)
        self._activation = activation

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self._activation(self.gate_proj(x), self.up_proj(x)))
