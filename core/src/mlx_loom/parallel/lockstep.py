"""Rank 0 leads, the other ranks follow: small messages over the group's own collectives.

Every rank of a split model must run the same forwards in the same order:
each forward's collectives wait for every rank. Forwards follow from the
tokens, and the tokens are the same on every rank (every rank holds the same
logits, and :func:`share_seed` gives every rank the same random state), so
what remains to share is what only rank 0 sees: the prompt a user typed, the
request a client sent, and whether a client went away. :class:`Lockstep`
carries those as JSON (never pickle: a message is data, not code) through
``all_sum`` — rank 0 contributes the bytes, the others zeros, which is exact.
No transport of our own.

Ordering: every distributed operation of a split model runs on one thread,
its engine's (:mod:`mlx_loom.engine.lockstep_service`), on that thread's
generation stream (:func:`comm_stream`). A stream runs what it is given in
order, and the ring backend pairs a send with the next recv from that peer,
so operations spread over two streams or two threads could pair wrongly
(measured: a forward built on the default stream and evaluated after a
generation on the generation stream received the generation's
activations). Callers on other threads therefore never call these methods
while the engine runs: they ask the engine to (``model.engine.share``).
The load's own messages run before the engine starts.
"""

from __future__ import annotations

import json
import secrets
from typing import Any, cast

import mlx.core as mx
import numpy as np

from mlx_loom.errors import ParallelRefused
from mlx_loom.streams import generation_stream

__all__ = ["MAX_MESSAGE_BYTES", "Lockstep", "comm_stream", "share_seed"]

#: The largest message rank 0 may share (a prompt of a million tokens is ~7 MB of JSON).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def comm_stream() -> mx.Stream:
    """The stream this thread's distributed operations run on (see the module docstring)."""
    return generation_stream()


class Lockstep:
    """Share rank 0's values with every rank of ``group``; every rank calls each method."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank = group.rank()
        self.size = group.size()

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def share(self, value: Any = None) -> Any:
        """Rank 0's ``value`` (JSON-serialisable), on every rank; others pass nothing."""
        if not self.leader:
            return self._receive(self._sum_int(0))
        data = json.dumps(value, separators=(",", ":")).encode()
        if len(data) > MAX_MESSAGE_BYTES:
            self._sum_int(-1)
            raise ParallelRefused(
                f"A message to the other ranks is {len(data)} bytes, over the "
                f"{MAX_MESSAGE_BYTES}-byte limit.",
                fix="Send a shorter prompt.",
            )
        self._sum_int(len(data))
        self._sum_bytes(mx.array(np.frombuffer(data, dtype=np.uint8)))
        return value

    def _receive(self, n: int) -> Any:
        """A follower's side of :meth:`share`, once the length ``n`` is known."""
        if n < 0:
            raise ParallelRefused(
                "Rank 0 refused to share a message over the size limit with this rank.",
                fix="See rank 0's output.",
            )
        return json.loads(self._sum_bytes(mx.zeros((n,), dtype=mx.uint8)))

    def _sum_bytes(self, mine: mx.array) -> bytes:
        with mx.stream(comm_stream()):
            return np.array(mx.distributed.all_sum(mine, group=self.group)).tobytes()

    def share_list(self, items: list[Any] | None = None) -> list[Any]:
        """Rank 0's list, on every rank; an empty list costs one small collective."""
        if self.leader and not items:
            self._sum_int(0)
            return []
        if not self.leader:
            n = self._sum_int(0)
            return [] if n == 0 else self._receive(n)
        return self.share(items)

    def gather(self, values: list[float]) -> list[list[float]]:
        """Every rank's ``values`` (the same length on each), in rank order."""
        mx.synchronize()
        with mx.stream(comm_stream()):
            mine = mx.array([values], dtype=mx.float32)
            rows = mx.distributed.all_gather(mine, group=self.group).tolist()
            return cast(list[list[float]], rows)

    def share_int(self, value: int = 0) -> int:
        """Rank 0's integer (64-bit), on every rank (one collective)."""
        return self._sum_int(value if self.leader else 0)

    def _sum_int(self, value: int) -> int:
        mx.synchronize()
        with mx.stream(comm_stream()):
            total = mx.distributed.all_sum(mx.array([value], dtype=mx.int64), group=self.group)
            return int(cast(int, total.item()))

    def agree(self, ok: bool) -> list[bool]:
        """Every rank's ``ok``, in rank order (all ranks learn who failed)."""
        mx.synchronize()
        with mx.stream(comm_stream()):
            flags = mx.distributed.all_gather(mx.array([int(ok)], dtype=mx.int32), group=self.group)
            return [bool(f) for f in cast(list[int], flags.tolist())]


def share_seed(lockstep: Lockstep) -> int:
    """Seed every rank's global MLX random state with one value drawn on rank 0.

    Each process otherwise seeds itself from the clock (measured: two ranks
    drew different numbers), so code that samples from MLX's global
    generator (an mlx-lm-style ``sampler`` callable) would choose different
    tokens per rank and the ranks would leave lock-step.
    """
    seed = lockstep.share_int(secrets.randbits(63))
    mx.random.seed(seed)
    return seed
