"""What ``loom generate|chat|serve --parallel`` add to a command: the same program on every rank.

Under ``mlx.launch`` every rank runs the same ``loom`` command. Rank 0 is the
one a person talks to: it reads stdin and its output is what they see. The
other ranks print nothing (``mlx.launch`` merges every rank's output) and
read nothing: whatever rank 0 reads — a prompt, each chat line, how much of
an answer Ctrl-C kept — reaches them through the model's engine
(:mod:`mlx_loom.engine.lockstep_service`), so they run each turn with it. An error
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

from mlx_loom.engine.lockstep_service import lockstep_of
from mlx_loom.errors import ParallelRefused
from mlx_loom.parallel.build import MODES

if TYPE_CHECKING:
    from mlx_loom.model import Model

__all__ = [
    "add_parallel_option",
    "finish",
    "is_follower",
    "kept_together",
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
    engine = lockstep_of(model)
    if not model.parallel.leader:
        message = engine.share()
        if "failed" in message:
            raise ParallelRefused(
                f"Rank 0 could not read the input: {message['failed']}",
                fix="See rank 0's error.",
            )
        return message["value"]
    try:
        value = read()
    except Exception as err:
        engine.share({"failed": f"{type(err).__name__}: {err}"})
        raise
    engine.share({"value": value})
    return value


def kept_together(model: Model, kept: int) -> int:
    """How much of an answer every rank keeps: rank 0's ``kept``.

    Rank 0 may stop reading an answer early (Ctrl-C in ``loom chat``); its
    engine then cancels the request at a step every rank's engine follows,
    which can be a few tokens past where rank 0's reader stopped. The other
    ranks read to that step, so they cut their copy to rank 0's length, and
    every rank's conversation stays the same.
    """
    if model.parallel is None:
        return kept
    return int(shared_input(model, lambda: kept))


def finish(model: Model) -> str | None:
    """End a command on every rank together; on rank 0, a line of per-rank figures.

    Every rank's engine runs the exchange after the work its last step
    queued, so no rank exits while another still needs it. The line gives
    each rank's peak memory and weight bytes (``None`` in one process).
    """
    info = model.parallel
    if info is None:
        return None
    figures = lockstep_of(model).gather([float(mx.get_peak_memory()), float(info.weight_bytes)])
    peaks = ", ".join(f"{peak / 1e9:.3f}" for peak, _ in figures)
    weights = ", ".join(f"{w / 1e9:.3f}" for _, w in figures)
    return (
        f"Parallel: {info.mode} across {info.size} ranks; peak memory per rank: {peaks} GB; "
        f"weights per rank: {weights} GB"
    )
