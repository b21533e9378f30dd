"""LoRA and DoRA adapters in mlx-lm's format, applied by the core to any family's graph.

An adapter directory is what mlx-lm's trainer writes: ``adapter_config.json``
(rank, scale, which layers and modules) and ``adapters.safetensors`` (the
factors). Applying one is a module transform that runs after the family's
factory has built the graph::

    model, tokenizer = mlx_loom.load("base-model", adapter_path="adapters")

or, on a model already loaded, :func:`load_adapter`. The mechanism is the
core's; a family takes part by declaring the ``"adapters"`` capability
(:data:`mlx_loom.plugin.ADAPTERS`) on its implementation and profile. A
family that does not declare it refuses adapters with a
:class:`~mlx_loom.errors.CapabilityRefused` instead of running a graph the
transform might not understand. Several adapters can also be registered on
one model and chosen per batch row (:class:`AdapterSet`, what ``loom serve
--adapter`` uses). How modules are chosen is in :mod:`.targets`, how names are
matched in :mod:`.names`, the arithmetic in :mod:`.layers`, the strict checks
in :mod:`.apply`, the per-row sets in :mod:`.multi`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mlx_loom.capabilities import ADAPTERS
from mlx_loom.errors import AdapterError

from .apply import Adapter, apply_adapter, read_adapter
from .config import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, AdapterConfig
from .layers import AdaptedLayer, adapted_layers
from .multi import AdapterSet, RegisteredAdapter, refuse_split_model

if TYPE_CHECKING:
    from mlx_loom.model import Model

__all__ = [
    "ADAPTERS",
    "ADAPTER_CONFIG_FILE",
    "ADAPTER_WEIGHTS_FILE",
    "AdaptedLayer",
    "Adapter",
    "AdapterConfig",
    "AdapterSet",
    "AppliedAdapter",
    "RegisteredAdapter",
    "adapted_layers",
    "apply_adapter",
    "load_adapter",
    "read_adapter",
]


@dataclass(frozen=True)
class AppliedAdapter:
    """What a :class:`~mlx_loom.model.Model` records about the adapter it runs with."""

    path: Path
    kind: str
    modules: tuple[str, ...]

    @property
    def name(self) -> str:
        return self.path.name


def load_adapter(model: Model, adapter_path: str | os.PathLike[str]) -> AppliedAdapter:
    """Apply the adapter at ``adapter_path`` to ``model`` (in place) and record it.

    Refused if the model's family does not declare :data:`ADAPTERS`, or if
    the model already runs an adapter (fuse it first, or load the base again).
    """
    model.require(ADAPTERS, asked="adapter_path")
    refuse_split_model(model)
    if model.adapter is not None or model.adapter_set is not None:
        running = model.adapter.path if model.adapter is not None else "set"
        raise AdapterError(
            f"this model already runs an adapter ({running})",
            fix="load the base model again for another adapter, or fuse the first one "
            "(`loom fuse`) and apply the second to the fused model",
        )
    adapter = read_adapter(adapter_path)
    modules = apply_adapter(model.module, adapter)
    applied = AppliedAdapter(path=adapter.path, kind=adapter.kind, modules=tuple(modules))
    model.adapter = applied
    return applied
