"""Several projections of one activation: an attention's q, k and v, a linear attention's inputs."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn

__all__ = ["JointProjection", "project", "set_joint_projection"]

#: ``[m(x) for m in modules]`` as one node, or ``None`` where that does not apply.
JointProjection = Callable[[mx.array, Sequence[nn.Module]], "list[mx.array] | None"]

#: The hook the native CPU kernel sets fill when they load
#: (:func:`mlx_loom.cpu.layers.project_together`). A hook, not an import: the
#: kernel sets sit above this shared layer and build on it.
_joint: JointProjection | None = None


def set_joint_projection(joint: JointProjection | None) -> None:
    """Install (or with ``None`` remove) the one-node form of :func:`project`."""
    global _joint
    _joint = joint


def project(x: mx.array, *layers: nn.Module) -> tuple[mx.array, ...]:
    """``tuple(layer(x) for layer in layers)``.

    Why a function: on the native CPU kernel sets, linears read the same way
    run as one graph node with one output each (bit-equal to the separate
    calls; :func:`mlx_loom.cpu.layers.project_together`), which a family
    gets by calling this where several projections read one ``x`` — without
    knowing which kernel set runs. Elsewhere it is exactly the separate
    calls, so a family's op graph (and its parity with mlx-lm) is unchanged.
    """
    together = _joint(x, layers) if _joint is not None else None
    if together is not None:
        return tuple(together)
    return tuple(layer(x) for layer in layers)
