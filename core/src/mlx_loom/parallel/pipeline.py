"""Pipeline parallel: contiguous layer ranges per rank, activations handed on with send/recv.

Rank 0 runs the first layers, rank ``size - 1`` the last. A family's forward
brackets its layer loop with its :class:`Stage`::

    h = self.stage.enter(h)          # rank > 0: the previous rank's activations
    for layer, c in zip(self.layers, cache): ...
    h = self.stage.leave(h)          # hand on; every rank gets the last rank's output

and ``self.layers`` holds only this rank's layers, so ``make_cache`` makes
caches for them alone. One process has the single stage, whose ``enter`` and
``leave`` return their input: the op graph is unchanged, so single-process
logits stay bit-equal to what they were.

Every rank then runs the final norm and its block of the vocabulary-split
head on the same activations, so every rank holds the same logits and samples
the same token (the sampling stays in lock-step without another message).

Collectives must pair up in the same order on every rank. The ranks' graphs
differ (each runs other layers), so the order MLX would evaluate independent
collectives in can differ too, and a lazily built forward might be evaluated
late or never. So everything in which the ranks meet *before* the last
stage is queued when the forward is built, in build order, on every rank:

* ``enter`` queues (``mx.async_eval``) what came before the layers — the
  vocabulary-split embedding's ``all_sum``, and anything else the family
  names, such as Gemma 4's per-layer inputs — and, on a later stage, the
  recv of the previous stage's activations;
* ``leave`` on a rank that sends queues the send.

A stream runs what it was given in order, so the k-th send of a rank pairs
with the k-th recv of the next, whatever is evaluated later (measured: with
the recv left lazy, a forward built but evaluated after the next one paired
the wrong activations). The last stage's output then reaches every rank
through ``all_gather`` of each rank's last array (a sender contributes the
array it sent); taking the last block is exact. That gather and the head's
run when the logits are evaluated, which every rank does alike because
every rank runs the same program.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .lockstep import comm_stream
from .plan import PLAN_FAULT_FIX, GeometryCheck, Pipeline, PlanFault

__all__ = ["SINGLE_STAGE", "Stage", "pipeline_check", "shard_pipeline", "stage_ranges"]


@dataclass(frozen=True)
class Stage:
    """This process's place in a pipeline: layers ``[start, stop)`` of rank ``rank`` of ``size``."""

    start: int = 0
    stop: int | None = None
    rank: int = 0
    size: int = 1
    group: Any = None

    def enter(self, h: mx.array, *prologue: mx.array | None) -> mx.array:
        """The activations this stage's first layer reads.

        ``prologue`` names anything else computed before the layers that may
        involve a collective (Gemma 4's per-layer inputs); it is queued with
        ``h`` on every rank.
        """
        if self.size == 1:
            return h
        mx.async_eval(h, *(p for p in prologue if p is not None))
        if self.rank == 0:
            return h
        received = mx.distributed.recv_like(
            h, self.rank - 1, group=self.group, stream=comm_stream()
        )
        mx.async_eval(received)
        return received

    def leave(self, h: mx.array) -> mx.array:
        """This stage's output handed on; returns the last stage's output, on every rank."""
        if self.size == 1:
            return h
        if self.rank < self.size - 1:
            h = mx.distributed.send(h, self.rank + 1, group=self.group, stream=comm_stream())
            mx.async_eval(h)
        gathered = mx.distributed.all_gather(h, group=self.group, stream=comm_stream())
        return gathered[(self.size - 1) * h.shape[0] :]


#: The stage of a model that is not split: ``enter``/``leave`` return their input.
SINGLE_STAGE = Stage()


def _cuts_allowed(n_layers: int, keep_together: tuple[tuple[int, int], ...]) -> list[int]:
    """Layer indices ``b`` (``0 < b < n``) a stage may start at: none inside a kept range."""
    return [b for b in range(1, n_layers) if not any(lo < b < hi for lo, hi in keep_together)]


def stage_ranges(
    n_layers: int, size: int, keep_together: tuple[tuple[int, int], ...] = ()
) -> list[tuple[int, int]] | None:
    """The most even split of ``n_layers`` into ``size`` contiguous non-empty ranges.

    "Most even" minimises the largest stage (layers cost about the same);
    among those, the greedy placement fills earlier stages first. Returns
    ``None`` when no split exists (fewer allowed boundaries than needed).
    """
    allowed = _cuts_allowed(n_layers, keep_together)
    if len(allowed) < size - 1:
        return None

    def place(longest: int) -> list[int] | None:
        cuts, start = [], 0
        while n_layers - start > longest:
            reachable = [b for b in allowed if start < b <= start + longest]
            if not reachable:
                return None
            start = reachable[-1]
            cuts.append(start)
        if len(cuts) > size - 1:
            return None
        # Fewer stages than ranks: split further at unused allowed boundaries
        # (only ever shortens a stage).
        spare = [b for b in allowed if b not in cuts]
        while len(cuts) < size - 1:
            cuts.append(spare.pop())
        return sorted(cuts)

    lo, hi = -(-n_layers // size), n_layers
    best = place(hi)
    while lo < hi:
        mid = (lo + hi) // 2
        cuts = place(mid)
        if cuts is None:
            lo = mid + 1
        else:
            hi, best = mid, cuts
    if best is None:
        return None
    bounds = [0, *best, n_layers]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def _layer_list(model: nn.Module, path: str) -> tuple[nn.Module, str, list]:
    holder_path, _, attr = path.rpartition(".")
    holder = dict(model.named_modules()).get(holder_path) if holder_path else model
    layers = getattr(holder, attr, None) if holder is not None else None
    if holder is None or not isinstance(layers, list):
        raise PlanFault(
            f"the parallel plan's pipeline layers {path!r} is not a list of layers in the "
            "built model",
            fix=PLAN_FAULT_FIX,
        )
    return holder, attr, layers


def pipeline_check(model: nn.Module, plan: Pipeline) -> GeometryCheck:
    """The requirement a pipeline puts on the group size: a stage per rank."""
    n_layers = len(_layer_list(model, plan.layers)[2])

    def check(size: int) -> str | None:
        if stage_ranges(n_layers, size, plan.keep_together) is not None:
            return None
        if n_layers < size:
            return f"num_hidden_layers = {n_layers} is fewer than {size} stages"
        return (
            f"{n_layers} layers cannot form {size} stages: {plan.reason or 'kept ranges'} "
            f"({', '.join(f'layers {lo}-{hi - 1}' for lo, hi in plan.keep_together)} "
            "must share a stage)"
        )

    return GeometryCheck(", ".join(plan.fields), check)


def shard_pipeline(model: nn.Module, plan: Pipeline, group: Any) -> tuple[int, int]:
    """Keep only this rank's layers (the others' lazy weights are never read); set the stage.

    :func:`pipeline_check` must have passed for the group's size.
    """
    holder, attr, layers = _layer_list(model, plan.layers)
    rank, size = group.rank(), group.size()
    ranges = stage_ranges(len(layers), size, plan.keep_together)
    assert ranges is not None, "pipeline_check passes before shard_pipeline runs"
    start, stop = ranges[rank]
    setattr(holder, attr, layers[start:stop])
    holder.stage = Stage(start=start, stop=stop, rank=rank, size=size, group=group)
    return start, stop
