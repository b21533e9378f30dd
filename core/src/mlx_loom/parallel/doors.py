"""What ``loom generate|chat|serve --parallel`` add to a command: the same program on every rank.

Under ``mlx.launch`` every rank runs the same ``loom`` command. Rank 0 is the
one a person talks to: it reads stdin and its output is what they see. The
other ranks print nothing (``mlx.launch`` merges every rank's output) and
read nothing: whatever rank 0 reads reaches them through
:class:`~mlx_loom.parallel.Lockstep`, so they run each turn with it. An error
every rank meets alike is printed by rank 0 (the others' copies go with
their silenced output); a rank that fails alone exits with an error, and
``mlx.launch`` stops the group and says which rank it was.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import mlx.core as mx

from .build import MODES
from .lockstep import comm_stream

if TYPE_CHECKING:
    from mlx_loom.model import Model

__all__ = [
    "add_parallel_option",
    "finish",
    "is_follower",
    "read_line",
    "shared_input",
    "silence_followers",
]


def add_parallel_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--parallel",
        choices=MODES,
        help="split the model across the processes mlx.launch started: 'tensor' splits "
        "every layer's heads and columns, 'pipeline' gives each process a range of layers "
        "(see docs/distributed.md)",
    )


def is_follower(model: Model) -> bool:
    return model.parallel is not None and not model.parallel.leader


def silence_followers(model: Model) -> None:
    """On a rank other than 0, send this process's stdout and stderr nowhere."""
    if is_follower(model):
        quiet = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
        sys.stdout = sys.stderr = quiet


def shared_input(model: Model, read: Callable[[], str | None]) -> str | None:
    """``read()`` on rank 0 (one process: here), its result on every rank."""
    if model.parallel is None:
        return read()
    lockstep = model.parallel.lockstep()
    return lockstep.share(read() if lockstep.leader else None)


def read_line(model: Model, prompt: str) -> str | None:
    """One line of input as rank 0 reads it (``None`` at end of input), on every rank."""

    def read() -> str | None:
        try:
            return input(prompt)
        except EOFError:
            return None

    return shared_input(model, read)


def finish(model: Model) -> str | None:
    """End a command on every rank together; on rank 0, a line of per-rank figures.

    Every rank waits here for the work its last step queued (which takes part
    in collectives), so no rank exits while another still needs it. The line
    gives each rank's peak memory and weight bytes (``None`` in one process).
    """
    info = model.parallel
    if info is None:
        return None
    mx.synchronize()
    with mx.stream(comm_stream()):
        mine = mx.array([mx.get_peak_memory(), info.weight_bytes], dtype=mx.float32)
        figures = mx.distributed.all_gather(mine[None], group=info.group).tolist()
    peaks = ", ".join(f"{peak / 1e9:.3f}" for peak, _ in figures)
    weights = ", ".join(f"{w / 1e9:.3f}" for _, w in figures)
    return (
        f"Parallel: {info.mode} across {info.size} ranks; peak memory per rank: {peaks} GB; "
        f"weights per rank: {weights} GB"
    )
