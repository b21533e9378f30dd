"""Rank 0 leading: messages, and the protocol a follower of ``loom serve`` keeps.

The protocol is checked in one process: a follower is a real model whose
``parallel`` says rank 1, and its lock-step messages come from a script
(what rank 0 would have sent), so every branch — a finished job, a job rank 0
stopped early, one that failed on both sides, one that failed only here —
runs without a second process. ``test_two_ranks.py`` runs it for real.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import pytest

import mlx_loom
from mlx_loom.errors import ParallelRefused
from mlx_loom.parallel import Lockstep, Parallel, lockstep
from mlx_loom.parallel.serving import FAILED, GO, STOP, follow_jobs


def test_a_group_of_one_shares_its_own_value():
    alone = Lockstep(mx.distributed.init())
    assert alone.share({"prompt": [1, 2, 3], "stop": ["\n"]}) == {
        "prompt": [1, 2, 3],
        "stop": ["\n"],
    }
    assert alone.share_int(2**62 + 5) == 2**62 + 5
    assert alone.agree(True) == [True]


def test_a_message_over_the_limit_is_refused_and_the_others_told(monkeypatch):
    monkeypatch.setattr(lockstep, "MAX_MESSAGE_BYTES", 16)
    told: list[int] = []

    class Leader(Lockstep):
        def _sum_int(self, value: int) -> int:
            told.append(value)
            return value

    with pytest.raises(ParallelRefused, match="over the 16-byte limit"):
        Leader(mx.distributed.init()).share("x" * 64)
    assert told == [-1]  # what the other ranks receive instead of a length


@dataclass
class Script:
    """What rank 0 sends, in order: messages for ``share``, integers for ``share_int``."""

    messages: deque = field(default_factory=deque)
    ints: deque = field(default_factory=deque)
    leader: bool = False

    def share(self, value: Any = None) -> Any:
        return self.messages.popleft()

    def share_int(self, value: int = 0) -> int:
        return self.ints.popleft()


@pytest.fixture
def follower(checkpoints, monkeypatch):
    """A model that believes it is rank 1 of 2, whose messages come from ``script``."""
    model, tokenizer = mlx_loom.load(checkpoints["llama"])
    script = Script()
    model.parallel = Parallel(mode="tensor", rank=1, size=2, group=None, weight_bytes=0)
    monkeypatch.setattr(Parallel, "lockstep", lambda self: script)
    return model, tokenizer, script


def _job(prompt, max_tokens=8) -> dict:
    return {"prompt": prompt, "options": {"max_tokens": max_tokens, "temperature": 0.0}}


def test_a_follower_stops_at_the_token_rank_0_stops_at(follower):
    model, tokenizer, script = follower
    script.messages.extend([_job([5, 6, 7]), None])
    script.ints.extend([GO, GO, STOP])  # rank 0's client went away after 3 tokens
    assert follow_jobs(model, tokenizer) == 1
    assert not script.ints and not script.messages  # every message used, no more asked


def test_a_job_that_fails_on_both_ranks_keeps_them_in_step(follower):
    model, tokenizer, script = follower
    # Token ids outside the vocabulary: refused before any forward, on both ranks.
    script.messages.extend([_job([10**6]), _job([5, 6]), None])
    script.ints.extend([FAILED, GO, STOP])
    assert follow_jobs(model, tokenizer) == 2
    assert not script.ints


def test_a_job_that_fails_only_here_stops_the_follower(follower):
    model, tokenizer, script = follower
    script.messages.extend([_job([10**6]), None])
    script.ints.extend([GO])  # rank 0 generated a token: this rank cannot follow
    with pytest.raises(ParallelRefused, match="failed a job that rank 0 ran on"):
        follow_jobs(model, tokenizer)
