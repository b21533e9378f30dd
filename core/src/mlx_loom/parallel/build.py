"""From a built model and its family's plan to this rank's part of it.

:func:`prepare` refuses what cannot work before any weight is touched (no
group, a group of one, a mode the implementation declares no plan for);
:func:`split_model` checks the geometry for the whole model and then splits
it. :mod:`mlx_loom.loader` runs the factory, this, and the core's
evaluation, then makes every rank agree that every rank loaded — a rank that
failed raises its own error, the others a :class:`ParallelRefused` naming it,
so no rank is left waiting in a collective for one that is gone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, cast, get_args

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlx_loom.errors import ParallelRefused

from .lockstep import Lockstep
from .pipeline import pipeline_check, shard_pipeline
from .plan import GeometryCheck, ParallelPlan
from .reading import SliceReader
from .tensor import (
    Wrap,
    refuse_geometry,
    shard_tensor,
    shard_vocab,
    tensor_checks,
    vocab_checks,
    wrap,
)

if TYPE_CHECKING:
    from mlx_loom.artifacts import TensorInfo

__all__ = ["MODES", "Mode", "Parallel", "RankView", "prepare", "split_model", "wrap"]

Mode = Literal["tensor", "pipeline"]
MODES: tuple[str, ...] = get_args(Mode)

_LAUNCH = "mlx.launch --backend ring -n 2 <command>"


@dataclass(frozen=True)
class Parallel:
    """How a loaded model is split: what :attr:`mlx_loom.Model.parallel` holds.

    ``weight_bytes`` counts this rank's parameters; ``sliced_bytes_read`` the
    bytes read straight from the files for this rank's slices, and
    ``sliced_whole`` the tensors that had to be read whole and sliced (the
    family's loader transformed them). ``layers`` is a pipeline rank's range.
    """

    mode: Mode
    rank: int
    size: int
    group: Any = field(repr=False)
    weight_bytes: int
    sliced_bytes_read: int = 0
    sliced_whole: tuple[str, ...] = ()
    layers: tuple[int, int] | None = None

    @property
    def leader(self) -> bool:
        """Rank 0: the rank that reads input and writes output."""
        return self.rank == 0

    def lockstep(self) -> Lockstep:
        return Lockstep(self.group)


@dataclass(frozen=True)
class RankView:
    """A group of ``n`` as rank ``r`` sees it, with no communication behind it.

    Splitting a model runs no collective (only its forward does), so every
    rank's part can be made in one process — the conformance kit and the
    tests check plans this way. Running the part needs a real group.
    """

    r: int
    n: int

    def rank(self) -> int:
        return self.r

    def size(self) -> int:
        return self.n


def prepare(mode: str, group: Any, *, implementation: Any) -> Any:
    """The group to split across, or a refusal before anything is built."""
    if mode not in MODES:
        raise ParallelRefused(
            f"parallel={mode!r} is not a parallel mode (modes: {', '.join(MODES)}).",
            fix="Pass parallel='tensor' or parallel='pipeline'.",
        )
    if group is None:
        group = mx.distributed.init()
    if group.size() < 2:
        raise ParallelRefused(
            f"parallel={mode!r} needs a group of two or more processes, but this process is "
            "alone (no distributed backend was set up for it).",
            fix=f"Start every process with MLX's launcher, e.g. {_LAUNCH} (docs/distributed.md).",
        )
    plan = getattr(implementation, "parallel", None)
    if plan is None:
        raise ParallelRefused(
            f"Implementation {implementation.id!r} declares no parallel plan, so it cannot "
            f"run {mode} parallel.",
            fix="Run it in one process, or ask its plugin's authors for a parallel plan.",
        )
    return group


def split_model(
    module: nn.Module,
    plan: ParallelPlan,
    mode: Mode,
    group: Any,
    sources: dict[int, tuple[mx.array, TensorInfo]],
    *,
    what: str,
) -> tuple[Parallel, list[Wrap]]:
    """Check the geometry for ``group``'s size, then keep this rank's part of ``module``.

    Returns how it was cut and the class changes still to make
    (:func:`~.tensor.wrap`, once the CPU path has swapped in its kernels).
    """
    size = group.size()
    rules = plan.tensor if mode == "tensor" else None
    pipeline = plan.pipeline if mode == "pipeline" else None
    if rules is None and pipeline is None:
        raise ParallelRefused(
            f"{what} declares no {mode}-parallel plan.",
            fix=f"Use {'pipeline' if mode == 'tensor' else 'tensor'} parallel, or one process.",
        )
    checks = vocab_checks(module, plan.vocab)
    checks += tensor_checks(module, rules) if rules is not None else ()
    checks += (pipeline_check(module, pipeline),) if pipeline is not None else ()
    other = ""
    other_mode = ""
    other_checks: tuple[GeometryCheck, ...] = ()
    if mode == "tensor" and plan.pipeline is not None:
        other_mode = "pipeline"
        other_checks = vocab_checks(module, plan.vocab) + (pipeline_check(module, plan.pipeline),)
    elif mode == "pipeline" and plan.tensor is not None:
        other_mode = "tensor"
        other_checks = vocab_checks(module, plan.vocab) + tensor_checks(
            module,
            plan.tensor,  # type: ignore[arg-type]
        )
    if other_mode:
        if all(c.check(size) is None for c in other_checks):
            other = f"use --parallel {other_mode} (parallel={other_mode!r}), which fits {size}"
    refuse_geometry(what, mode, size, checks, other=other)

    reader = SliceReader(sources)
    wraps = shard_vocab(module, plan.vocab, group, reader)
    layers = None
    if rules is not None:
        wraps += shard_tensor(module, rules, group, reader)
    else:
        assert pipeline is not None
        layers = shard_pipeline(module, pipeline, group)
    info = Parallel(
        mode=mode,
        rank=group.rank(),
        size=size,
        group=group,
        weight_bytes=sum(
            v.nbytes for _, v in cast(list[tuple[str, mx.array]], tree_flatten(module.parameters()))
        ),
        sliced_bytes_read=reader.bytes_read,
        sliced_whole=tuple(reader.sliced_whole),
        layers=layers,
    )
    return info, wraps
