"""Past one machine: tensor and pipeline parallel on MLX's own distributed layer.

Users ask for it at load, under MLX's launcher::

    mlx.launch --backend ring -n 2 python my_script.py      # my_script.py calls:
    model, tokenizer = mlx_loom.load(ref, parallel="tensor")  # or "pipeline"

or ``loom generate|chat|serve --parallel tensor|pipeline``. Every rank runs
the same program; rank 0 (``model.parallel.leader``) writes the output.

Family authors declare a :class:`ParallelPlan` (``Graph(parallel=plan)``):
what splits how (:mod:`.plan`), with helpers for the shared layers. Graphs
bracket their layer loop with ``self.stage.enter``/``leave``
(:class:`Stage`) for pipeline parallel. This package's face is that plan and
the stage (a shared layer, below the host); the core's application of it
(:mod:`.build`, :mod:`.tensor`, :mod:`.layers`, :mod:`.reading`) sits with
model building and is imported from its modules. The core does the rest: it checks the
checkpoint's geometry against the group size (a refusal names the field and
the sizes that would work), reads only this rank's slices
(:mod:`.reading`), puts ``all_sum`` where partial products meet
(:mod:`.layers`), and keeps the ranks in lock-step: rank 0's engine decides
each step for every rank (:mod:`mlx_loom.engine.lockstep_service`, over the messages of
:mod:`.lockstep`).
"""

from .lockstep import Lockstep
from .pipeline import SINGLE_STAGE, Stage, stage_ranges
from .plan import (
    ParallelPlan,
    Pipeline,
    PlanFault,
    PlanFunction,
    Reduce,
    Resize,
    Rule,
    Segment,
    Split,
    Units,
    Vocab,
    attention,
    gated_mlp,
    switch_glu,
)

__all__ = [
    "SINGLE_STAGE",
    "Lockstep",
    "ParallelPlan",
    "Pipeline",
    "PlanFault",
    "PlanFunction",
    "Reduce",
    "Resize",
    "Rule",
    "Segment",
    "Split",
    "Stage",
    "Units",
    "Vocab",
    "attention",
    "gated_mlp",
    "stage_ranges",
    "switch_glu",
]
