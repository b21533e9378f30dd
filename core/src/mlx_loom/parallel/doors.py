"""What ``loom generate|chat|serve --parallel`` add to a command: the same program on every rank.

Under ``mlx.launch`` every rank runs the same ``loom`` command. Rank 0 is the
one a person talks to: it reads stdin and its output is what they see. The
other ranks print nothing (``mlx.launch`` merges every rank's output) and
read nothing: whatever rank 0 reads — a prompt, each chat line, the decision
to stop an answer at Ctrl-C — reaches them through
:class:`~mlx_loom.parallel.Lockstep`, so they run each turn with it. An error
every rank meets alike is printed by rank 0 (the others' copies go with
their silenced output); a rank that fails alone exits with an error, and
``mlx.launch`` stops the group and says which rank it was.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from mlx_loom.errors import ParallelRefused

from .build import MODES
from .lockstep import comm_stream

if TYPE_CHECKING:
    from mlx_loom.model import Model

__all__ = [
    "add_parallel_option",
    "finish",
    "is_follower",
    "shared_input",
    "silence_followers",
    "stop_together",
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
    """On a rank other than 0: stdout and stderr go nowhere, and Ctrl-C is ignored.

    Ctrl-C is rank 0's to act on (it stops an answer at a token every rank
    agrees on, or ends rank 0, after which ``mlx.launch`` stops the others);
    a follower acting on its own copy of the signal would leave step.
    """
    if is_follower(model):
        quiet = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
        sys.stdout = sys.stderr = quiet
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def shared_input(model: Model, read: Callable[[], Any]) -> Any:
    """``read()`` on rank 0 (one process: here), its JSON-able result on every rank.

    If ``read`` raises on rank 0, the other ranks raise too (a
    :class:`~mlx_loom.errors.ParallelRefused`), instead of waiting for a value.
    """
    if model.parallel is None:
        return read()
    lockstep = model.parallel.lockstep()
    if not lockstep.leader:
        message = lockstep.share()
        if "failed" in message:
            raise ParallelRefused(
                f"Rank 0 could not read the input: {message['failed']}",
                fix="See rank 0's error.",
            )
        return message["value"]
    try:
        value = read()
    except Exception as err:
        lockstep.share({"failed": f"{type(err).__name__}: {err}"})
        raise
    lockstep.share({"value": value})
    return value


def stop_together(model: Model, requested: bool) -> bool:
    """Whether to stop after this token: ``requested`` as rank 0 saw it, on every rank."""
    if model.parallel is None:
        return requested
    lockstep = model.parallel.lockstep()
    return bool(lockstep.share_int(int(requested) if lockstep.leader else 0))


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
