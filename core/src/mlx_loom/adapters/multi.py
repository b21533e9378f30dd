"""Several adapters on one base model, chosen per batch row (``loom serve --adapter``).

:class:`AdapterSet` checks every adapter against the model exactly as a single
``adapter_path`` is checked, then wraps the union of the layers they adapt
once, each wrapped layer holding one factor set per adapter (or none, where an
adapter leaves the layer alone). A forward names each row's adapter::

    adapters = AdapterSet(model, {"sql": "./sql-adapter", "chat": "./chat-adapter"})
    logits = model(tokens, cache=caches, adapters=["sql", None, "chat"])

Row ``i`` then computes exactly what the base model with only that adapter
applied computes for it, and a row with ``None`` exactly what the base model
computes (see :mod:`.layers` for why that holds bit for bit).

Routed experts need one more step. The core's expert block
(:class:`mlx_loom.nn.SwitchGLU`) may sort the batch's (token, expert) pairs by
expert, after which no projection can tell which row a pair came from. So
each expert block whose projections carry adapters is wrapped too
(:class:`RowSplitExperts`): a batch whose rows use different adapters there
runs the block once per adapter on that adapter's rows, whole, and puts the
rows back in order — pure data movement, so every row still gets its solo
values. A family's own expert layer, outside the core's block, cannot be
split that way: rows whose adapters adapt it batch only with their own
adapter (:meth:`AdapterSet.batch_key`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from mlx_loom.capabilities import ADAPTERS
from mlx_loom.errors import AdapterError
from mlx_loom.nn import SwitchGLU

from .apply import Adapter, install, plan_adapter, read_adapter
from .layers import AdaptedLayer, Factors, RowSelection
from .targets import Target

if TYPE_CHECKING:
    from mlx_loom.model import Model

__all__ = [
    "AdapterSet",
    "RegisteredAdapter",
    "RowSplitExperts",
    "check_adapter_name",
    "refuse_split_model",
]


@dataclass(frozen=True)
class RegisteredAdapter:
    """One adapter of a set: its name, where it came from, what it adapts."""

    name: str
    path: Path
    kind: str
    modules: tuple[str, ...]
    #: Adapts a family's own routed-expert layer (outside the core's expert
    #: block), so its rows batch only with rows of the same adapter.
    batches_alone: bool


def refuse_split_model(model: Model) -> None:
    """Adapters apply to a whole graph; a rank's part of a split model holds slices of
    the layers an adapter names, which the factors do not fit."""
    if getattr(model, "parallel", None) is not None:
        raise AdapterError(
            "adapters do not apply to a model split across processes (parallel=...) yet",
            fix="load the model without parallel=/--parallel to run adapters, or fuse the "
            "adapter into the base first (`loom fuse`) and split the fused model",
        )


def check_adapter_name(name: str) -> str:
    """Names are what clients send (``model: "base:name"``): short, printable, no ``:``."""
    if not name or len(name) > 64 or ":" in name or name != name.strip() or not name.isprintable():
        raise AdapterError(
            f"adapter name {name!r} is not usable: names are 1-64 printable characters, "
            "without ':' or surrounding spaces",
            fix="name it like a short identifier, e.g. --adapter sql=./adapters/sql",
        )
    return name


class AdapterSet:
    """Adapters registered on ``model``, applied per batch row.

    Construction checks every adapter first and changes nothing unless all of
    them fit; afterwards ``model.adapter_set`` is this set.
    """

    def __init__(self, model: Model, adapters: Mapping[str, str | os.PathLike[str]]) -> None:
        model.require(ADAPTERS, asked="adapters")
        refuse_split_model(model)
        if model.adapter is not None or getattr(model, "adapter_set", None) is not None:
            raise AdapterError(
                "this model already runs an adapter, so a set of per-request adapters "
                "cannot be added to it",
                fix="load the base model without adapter_path and register every adapter "
                "in the set",
            )
        if not adapters:
            raise AdapterError("an adapter set needs at least one adapter", fix="name one")
        read: list[tuple[str, Adapter]] = []
        for name, path in adapters.items():
            adapter = read_adapter(path)
            if not adapter.config.low_rank:
                raise AdapterError(
                    f"adapter {name!r} ({adapter.path}) is a full fine-tune: it replaces "
                    "weights, which cannot differ from one batch row to the next",
                    fix="serve it as its own model (fuse it with `loom fuse`), or register "
                    "LoRA/DoRA adapters only",
                )
            read.append((check_adapter_name(name), adapter))
        plans = [(name, adapter, plan_adapter(model.module, adapter)) for name, adapter in read]
        layers: dict[str, tuple[Target, list[Factors | None]]] = {}
        for slot, (_, _, plan) in enumerate(plans):
            for target, factors in plan:
                entry = layers.setdefault(target.path, (target, [None] * len(plans)))
                entry[1][slot] = factors
        self.selection = RowSelection()
        install(model.module, layers, self.selection)
        blocks = _wrap_expert_blocks(model.module, self.selection)
        self.adapters = tuple(
            RegisteredAdapter(
                name=name,
                path=adapter.path,
                kind=adapter.kind,
                modules=tuple(t.path for t, _ in plan),
                batches_alone=any(
                    t.kind == "expert" and not any(t.path.startswith(b + ".") for b in blocks)
                    for t, _ in plan
                ),
            )
            for name, adapter, plan in plans
        )
        self._slots = {a.name: i for i, a in enumerate(self.adapters)}
        model.adapter_set = self

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._slots)

    def __contains__(self, name: object) -> bool:
        return name in self._slots

    def slot(self, name: str | None) -> int | None:
        """The slot of ``name`` (``None`` stays ``None``: the base model)."""
        if name is None:
            return None
        slot = self._slots.get(name)
        if slot is None:
            raise AdapterError(
                f"no adapter named {name!r} is registered (registered: {', '.join(self._slots)})",
                fix="use one of the registered names, or none for the base model",
            )
        return slot

    def rows(self, names: Sequence[str | None]) -> AbstractContextManager[None]:
        """Context manager: while it is active, forwards use adapter ``names[i]`` for row ``i``."""
        return self.selection.rows([self.slot(n) for n in names])

    def batch_key(self, name: str | None) -> str | None:
        """Rows with equal keys may share a batch: every adapter mixes with every other
        (key ``None``), except one that adapts a family's own routed-expert layer,
        which batches only with itself (its key is its name)."""
        slot = self.slot(name)
        if slot is not None and self.adapters[slot].batches_alone:
            return name
        return None


class RowSplitExperts(nn.Module):
    """A core expert block whose projections carry adapters, run whole rows per adapter.

    Rows that all use one adapter (or none) here take the block as it is.
    Otherwise each group of rows sharing an adapter runs the block alone, with
    the selection narrowed to that group, and the groups' outputs are put back
    in row order.
    """

    def __init__(self, block: SwitchGLU, selection: RowSelection) -> None:
        super().__init__()
        self.block = block
        self._selection = selection
        self._projections = [
            p
            for p in (block.gate_proj, block.up_proj, block.down_proj)
            if isinstance(p, AdaptedLayer)
        ]

    def _slot_here(self, slot: int | None) -> int | None:
        touched = slot is not None and any(p._factors(slot) is not None for p in self._projections)
        return slot if touched else None

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        rows = self._selection.current
        if rows is None or len({self._slot_here(s) for s in rows}) == 1:
            return self.block(x, indices)
        groups: dict[int | None, list[int]] = {}
        for i, slot in enumerate(rows):
            groups.setdefault(self._slot_here(slot), []).append(i)
        order, pieces = [], []
        for slot, members in groups.items():
            index = mx.array(members)
            with self._selection.rows([slot] * len(members)):
                pieces.append(self.block(x[index], indices[index]))
            order += members
        inverse = mx.array(sorted(range(len(order)), key=order.__getitem__))
        return mx.concatenate(pieces, axis=0)[inverse]


def _wrap_expert_blocks(model: nn.Module, selection: RowSelection) -> list[str]:
    """Wrap every core expert block with an adapted projection; return their paths."""
    blocks = [
        (path, module)
        for path, module in model.named_modules()
        if isinstance(module, SwitchGLU)
        and any(
            isinstance(p, AdaptedLayer)
            for p in (module.gate_proj, module.up_proj, module.down_proj)
        )
    ]
    model.update_modules(
        tree_unflatten([(path, RowSplitExperts(block, selection)) for path, block in blocks])
    )
    return [path for path, _ in blocks]
