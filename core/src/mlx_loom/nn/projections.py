"""Several projections of one activation: an attention's q, k and v, a linear attention's inputs."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..cpu.layers import project_together

__all__ = ["project"]


def project(x: mx.array, *layers: nn.Module) -> tuple[mx.array, ...]:
    """``tuple(layer(x) for layer in layers)``.

    Why a function: on the native CPU kernel sets, linears read the same way
    run as one graph node with one output each (bit-equal to the separate
    calls; :func:`mlx_loom.cpu.layers.project_together`), which a family
    gets by calling this where several projections read one ``x`` — without
    knowing which kernel set runs. Elsewhere it is exactly the separate
    calls, so a family's op graph (and its parity with mlx-lm) is unchanged.
    """
    together = project_together(x, layers)
    if together is not None:
        return tuple(together)
    return tuple(layer(x) for layer in layers)
