"""The plan a family declares: which modules split how, across a group of processes.

A family gives its graph a function ``plan(family_config) -> ParallelPlan``
(``Graph(parallel=plan)``). The plan is data about the *built* graph, in its
own module paths; the core applies it after the factory has built the model
with lazy weights, so a family writes no sharding code.

* :class:`Vocab` — the token-indexed tables and the output head. Both modes
  split them by vocabulary rows: a lookup becomes "look up the rows this rank
  holds, zero elsewhere, ``all_sum``" and the head "this rank's logits,
  ``all_gather``". Each logit and each embedding row is computed by exactly
  one rank with the single-process arithmetic, and adding zeros is exact, so
  both are bit-identical to one process.
* ``tensor`` — :class:`Split`, :class:`Reduce` and :class:`Resize` rules. A
  ``"out"`` split gives each rank a slice of a projection's outputs (attention
  heads, MLP or expert columns); an ``"in"`` split a slice of its inputs, so
  each rank holds a partial product; the partial products meet in one
  ``all_sum`` — at that linear (``reduce=True``) or at the output of an
  enclosing module (:class:`Reduce`, e.g. a mixture-of-experts block whose
  routed and shared experts both produce partial sums). :class:`Resize`
  corrects the head counts a module reshapes by.
* ``pipeline`` — :class:`Pipeline`: the layer list split into contiguous
  ranges, one per rank, with ranges a stage boundary may not cut.

Split sizes are :class:`Units`: a count of indivisible things (heads, value
heads, hidden units) named by the config field that sets it, so a refusal can
say ``num_key_value_heads = 3 does not divide across 2 processes`` and list
the group sizes that would work.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
import dataclasses
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Literal

from mlx_loom.errors import ImplementationFailed

__all__ = [
    "MAX_GROUP_SIZE",
    "Pipeline",
    "ParallelPlan",
    "PlanFault",
    "PlanFunction",
    "Reduce",
    "Resize",
    "Rule",
    "Segment",
    "Split",
    "Units",
    "Vocab",
    "attention",
    "gated_mlp",
    "matches",
    "switch_glu",
]

#: The largest group size a refusal lists among "the sizes that would work".
MAX_GROUP_SIZE = 64

PLAN_FAULT_FIX = "This is a fault in the plugin's parallel plan: report it to its authors."


class PlanFault(ImplementationFailed):
    """A family's parallel plan does not fit the model its factory built (a plugin fault)."""


@dataclass(frozen=True)
class Units:
    """``count`` indivisible units (heads, channels) set by config field ``field``.

    A group of ``size`` processes splits them when ``size`` divides ``count``.
    ``replicable`` units (key/value heads) also fit a group that is a
    multiple of ``count``: each rank then holds the one unit its share of the
    query heads reads (grouped-query attention keeps working per rank).
    """

    field: str
    count: int
    replicable: bool = False

    def fits(self, size: int) -> bool:
        if self.count % size == 0:
            return True
        return self.replicable and size % self.count == 0

    def local(self, rank: int, size: int) -> tuple[int, int]:
        """The units ``[start, stop)`` rank ``rank`` of ``size`` holds (``fits`` first)."""
        if self.count % size == 0:
            per = self.count // size
            return rank * per, (rank + 1) * per
        unit = rank * self.count // size
        return unit, unit + 1

    def describe(self) -> str:
        return f"{self.field} = {self.count}"


@dataclass(frozen=True)
class Segment:
    """One part of a fused projection: ``size`` features made of ``units``.

    Qwen3.5's ``in_proj_qkv`` stacks q, k and v: three segments, each split
    on its own so every rank gets its heads' q, k and v.
    """

    units: Units
    size: int


@dataclass(frozen=True)
class Split:
    """Divide a module's features (or one parameter's axis) across the group.

    ``path`` matches module paths (``*`` stands for one path component, e.g.
    a layer index). A module split covers every parameter of a linear-like
    module (``nn.Linear``, its quantized form, stacked experts): ``dim="out"``
    slices the output features, ``dim="in"`` the input features (the packed
    columns and scale groups of a quantized weight alike). With ``axis`` set,
    ``path`` names a single parameter and that axis is sliced.

    ``reduce=True`` (an ``"in"`` split of a linear) sums the partial products
    across the group at this linear, before its bias. ``units`` is one
    :class:`Units` for the whole dimension or a tuple of :class:`Segment`.
    """

    path: str
    units: Units | tuple[Segment, ...]
    dim: Literal["out", "in"] = "out"
    axis: int | None = None
    reduce: bool = False

    def segments(self, extent: int) -> tuple[Segment, ...]:
        """The segments of a dimension of ``extent`` features."""
        if isinstance(self.units, Units):
            return (Segment(self.units, extent),)
        return self.units

    @property
    def all_units(self) -> tuple[Units, ...]:
        return (
            (self.units,) if isinstance(self.units, Units) else tuple(s.units for s in self.units)
        )


@dataclass(frozen=True)
class Reduce:
    """Sum the output of the module at ``path`` across the group (partial products meet)."""

    path: str


@dataclass(frozen=True)
class Resize:
    """Integer attributes of the module at ``path`` that count split units.

    Each attribute becomes ``value * local / count`` of its :class:`Units`:
    ``Resize("…self_attn", {"n_heads": heads, "n_kv_heads": kv_heads})``.
    """

    path: str
    attrs: Mapping[str, Units]


Rule = Split | Reduce | Resize


@dataclass(frozen=True)
class Vocab:
    """Token-indexed tables and the output head, split by vocabulary rows in both modes.

    ``embeddings`` are ``nn.Embedding`` paths (the first one's ``as_linear``
    is the head of a tied model); ``head`` is the untied output ``nn.Linear``.
    """

    embeddings: tuple[str, ...]
    head: str | None = None


@dataclass(frozen=True)
class Pipeline:
    """How the layer list splits into contiguous stages.

    ``layers`` is the path of the list; the module holding it gets a
    :class:`~mlx_loom.parallel.Stage` as ``stage``, which its forward uses to
    receive and hand on activations. ``keep_together`` lists layer ranges
    ``(start, stop)`` no stage boundary may cut, with ``reason`` saying why
    and ``fields`` the config fields that decide them (for refusals).
    """

    layers: str = "model.layers"
    keep_together: tuple[tuple[int, int], ...] = ()
    reason: str = ""
    fields: tuple[str, ...] = ("num_hidden_layers",)


@dataclass(frozen=True)
class ParallelPlan:
    """Everything a graph declares about running across processes."""

    vocab: Vocab
    tensor: tuple[Rule, ...] | None = None
    pipeline: Pipeline | None = None
    #: What a user reading ``docs`` or an error should know (e.g. what stays replicated).
    notes: str = ""

    def units(self) -> tuple[Units, ...]:
        """Every :class:`Units` the tensor rules divide, deduplicated."""
        seen: dict[Units, None] = {}
        for rule in self.tensor or ():
            if isinstance(rule, Split):
                seen.update(dict.fromkeys(rule.all_units))
            elif isinstance(rule, Resize):
                seen.update(dict.fromkeys(rule.attrs.values()))
        return tuple(seen)


#: What ``Graph(parallel=...)`` takes: the family config in, the plan out.
PlanFunction = Callable[[Any], ParallelPlan]


# --- helpers for the shared layers (mlx_loom.nn) and Hugging Face names ---------


def attention(
    path: str,
    *,
    heads: Units,
    kv_heads: Units,
    q: tuple[str, ...] = ("q_proj",),
    kv: tuple[str, ...] = ("k_proj", "v_proj"),
    out: str = "o_proj",
    counts: tuple[str, str] = ("n_heads", "n_kv_heads"),
) -> tuple[Rule, ...]:
    """Split an attention block by heads.

    Query-side projections (``q``) split by ``heads``, key/value projections
    (``kv``) by ``kv_heads`` (which should be ``replicable``), the output
    projection's inputs by ``heads`` with the ``all_sum`` there, and the
    module's head-count attributes (``counts``) follow. Per-head norms and
    RoPE need nothing: each rank runs them on whole heads.
    """
    rules: list[Rule] = [Split(f"{path}.{name}", heads) for name in q]
    rules += [Split(f"{path}.{name}", kv_heads) for name in kv]
    rules.append(Split(f"{path}.{out}", heads, dim="in", reduce=True))
    rules.append(Resize(path, {counts[0]: heads, counts[1]: kv_heads}))
    return tuple(rules)


def gated_mlp(path: str, hidden: Units, *, reduce: bool = True) -> tuple[Rule, ...]:
    """Split a :class:`mlx_loom.nn.GatedMLP` by hidden units (gate/up columns, down rows).

    ``reduce=False`` leaves ``down_proj``'s partial sums for an enclosing
    :class:`Reduce` (a shared expert beside routed ones).
    """
    return (
        Split(f"{path}.gate_proj", hidden),
        Split(f"{path}.up_proj", hidden),
        Split(f"{path}.down_proj", hidden, dim="in", reduce=reduce),
    )


def switch_glu(path: str, hidden: Units) -> tuple[Rule, ...]:
    """Split a :class:`mlx_loom.nn.SwitchGLU` by each expert's hidden units.

    Every rank keeps every expert (the router is replicated, so every rank
    routes each token identically) and a slice of each expert's width; the
    block's output is a partial sum, reduced by the caller's :class:`Reduce`.
    """
    return (
        Split(f"{path}.gate_proj", hidden),
        Split(f"{path}.up_proj", hidden),
        Split(f"{path}.down_proj", hidden, dim="in"),
    )


@lru_cache(maxsize=256)
def _pattern(path: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(path).replace(r"\*", r"[^.]+") + "$")


def matches(pattern: str, path: str) -> bool:
    """``*`` in ``pattern`` matches exactly one path component."""
    return _pattern(pattern).match(path) is not None


# --- geometry ------------------------------------------------------------------------


@dataclass(frozen=True)
class GeometryCheck:
    """One divisibility requirement: ``check(size)`` is ``None`` when ``size`` works."""

    field: str
    check: Callable[[int], str | None] = dataclasses.field(compare=False)


def units_check(units: Units) -> GeometryCheck:
    def check(size: int) -> str | None:
        if units.fits(size):
            return None
        extra = (
            f" (nor is {size} a multiple of it, which would replicate each unit)"
            if units.replicable
            else ""
        )
        return f"{units.describe()} does not divide across {size} processes{extra}"

    return GeometryCheck(units.field, check)


def sizes_that_work(checks: tuple[GeometryCheck, ...], *, limit: int = MAX_GROUP_SIZE) -> list[int]:
    """Group sizes from 2 to ``limit`` that pass every check."""
    return [n for n in range(2, limit + 1) if all(c.check(n) is None for c in checks)]
