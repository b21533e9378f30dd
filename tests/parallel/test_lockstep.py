"""Rank 0 leading the engine: the turn protocol every rank of a split model keeps.

Checked in one process: the model is whole (so its forwards need no peer),
but its ``parallel`` says rank 0 or rank 1 of 2, and the group's messages
are a script — what rank 0 would announce, or a record of what it did — so
every branch runs without a second process. ``test_two_ranks.py`` runs the
protocol for real.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import pytest

import mlx_loom
from mlx_loom.cli import doors
from mlx_loom.engine.lockstep_service import AgreeingPrefixStore, LockstepService
from mlx_loom.errors import ParallelRefused
from mlx_loom.parallel import Lockstep, lockstep
from mlx_loom.parallel.build import Parallel
from mlx_loom.serve.ranks import follow_jobs

PROMPT = [5, 6, 7, 8]


def test_a_group_of_one_shares_its_own_value():
    alone = Lockstep(mx.distributed.init())
    assert alone.share({"prompt": [1, 2, 3], "stop": ["\n"]}) == {
        "prompt": [1, 2, 3],
        "stop": ["\n"],
    }
    assert alone.share_list([]) == [] and alone.share_list([["stop"]]) == [["stop"]]
    assert alone.share_int(2**62 + 5) == 2**62 + 5
    assert alone.gather([1.5, 2.0]) == [[1.5, 2.0]]


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


class Script:
    """The group as one rank sees it: rank 0's announcements come from ``turns``.

    ``turns(service)`` gives each turn's operations (a follower's view);
    integers (the seed, each idle turn's park decision) come from ``ints``,
    then ``park``. A leader's announcements are recorded in ``sent``.
    """

    def __init__(self, *, leader: bool, turns: Callable[[Any], list] | None = None) -> None:
        self.leader = leader
        self.turns = turns
        self.ints: deque[int] = deque([1234])  # the engine thread's seed comes first
        self.park = 1
        self.sent: list[list] = []
        self.sent_ints: list[int] = []
        self.service: Any = None
        self.rank0_values: list[float] | None = None  # what rank 0 contributes to a gather

    def share_list(self, items: list | None = None) -> list:
        if self.leader:
            self.sent.append(items or [])
            return items or []
        assert self.turns is not None
        return self.turns(self.service)

    def share_int(self, value: int = 0) -> int:
        if self.leader:
            self.sent_ints.append(value)
            return value
        return self.ints.popleft() if self.ints else self.park

    def gather(self, values: list[float]) -> list[list[float]]:
        return [self.rank0_values or values, values] if not self.leader else [values, values]


@pytest.fixture
def split(checkpoints, monkeypatch):
    """``split(rank, turns)``: a whole llama that believes it is ``rank`` of 2."""
    made = []

    def make(rank: int, turns: Callable[[Any], list] | None = None):
        model, tokenizer = mlx_loom.load(checkpoints["llama"])
        script = Script(leader=rank == 0, turns=turns)
        model.parallel = Parallel(mode="tensor", rank=rank, size=2, group=None, weight_bytes=0)
        monkeypatch.setattr(Parallel, "lockstep", lambda self: script)
        script.service = model.engine
        assert isinstance(script.service, LockstepService)
        made.append(script.service)
        return model, tokenizer, script

    yield make
    for service in made:
        service.close(timeout=5)


def _spec(max_tokens: int) -> dict:
    return {
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "stop": [],
        "sampling": {},
        "kv_bits": None,
        "kv_group_size": 64,
        "quantized_kv_start": 0,
    }


def _then_stop(first: list[list]) -> Callable[[Any], list]:
    """Turns: ``first`` (one list per turn), then nothing until idle, then stop."""
    queue = deque(first)

    def turns(service) -> list:
        if queue:
            return queue.popleft()
        return [] if service._engine.has_work else [["stop"]]

    return turns


def test_a_follower_runs_the_request_rank_0_describes_until_rank_0_stops(split):
    model, tokenizer, script = split(1, _then_stop([[["submit", _spec(3), None]]]))
    assert follow_jobs(model, tokenizer) == 1
    stats = script.service.stats().engine
    assert (stats.completed, stats.generated_tokens) == (1, 3)


def test_a_follower_cancels_at_the_turn_rank_0_cancels(split):
    model, tokenizer, script = split(
        1, _then_stop([[["submit", _spec(50), None]], [], [["cancel", 0]]])
    )
    follow_jobs(model, tokenizer)
    stats = script.service.stats().engine
    assert (stats.completed, stats.cancelled) == (0, 1)
    assert stats.generated_tokens < 50


def test_a_follower_that_cannot_build_rank_0s_request_stops_with_the_reason(split):
    bad = {**_spec(3), "prompt": [10**6]}  # outside the vocabulary
    model, tokenizer, _ = split(1, _then_stop([[["submit", bad, None]]]))
    with pytest.raises(ParallelRefused, match="could not build a request rank 0 runs"):
        follow_jobs(model, tokenizer)


def test_a_follower_runs_its_own_call_when_rank_0_announces_the_same(split, checkpoints):
    ref, tokenizer = mlx_loom.load(checkpoints["llama"])
    expected = mlx_loom.generate(ref, tokenizer, PROMPT, max_tokens=4)
    model, tokenizer, _ = split(1, _then_stop([[["submit", None, None]]]))
    assert mlx_loom.generate(model, tokenizer, PROMPT, max_tokens=4) == expected


def test_a_follower_ignores_its_own_cancel_and_ends_where_rank_0_does(split):
    model, tokenizer, script = split(1, _then_stop([[["submit", None, None]]]))
    for _ in mlx_loom.stream_generate(model, tokenizer, PROMPT, max_tokens=6):
        break  # this rank's reader stops; rank 0 announced no cancel
    script.service.close(timeout=10)  # runs on until rank 0 parks, after the request
    stats = script.service.stats().engine
    assert (stats.completed, stats.cancelled, stats.generated_tokens) == (1, 0, 6)


def test_a_prompt_cache_keeps_a_prefix_only_if_every_rank_can_trim(split):
    turns = deque(
        [[["submit", None, None]], [["share", {"gather": [0.0]}]], [["submit", None, None]]]
    )
    model, tokenizer, script = split(
        1, lambda service: [] if service._engine.has_work else turns.popleft()
    )
    script.rank0_values = [0.0]  # rank 0's caches cannot trim (a recurrent layer, say)
    cache = mlx_loom.PromptCache(model)
    list(mlx_loom.stream_generate(model, tokenizer, PROMPT, max_tokens=2, prompt_cache=cache))
    # A prompt that shares 3 tokens: this rank could trim to them, rank 0 cannot.
    second = list(
        mlx_loom.stream_generate(
            model, tokenizer, [*PROMPT[:3], 9], max_tokens=2, prompt_cache=cache
        )
    )
    assert second[-1].cached_tokens == 0 and not turns


def test_a_follower_reads_rank_0s_input_and_fails_when_rank_0_could_not(split):
    turns = deque([[["share", {"value": "hi"}]], [["share", {"failed": "EOFError: "}]]])
    model, _, _ = split(1, lambda service: turns.popleft())

    def unread():
        raise AssertionError("a follower never reads its own input")

    assert doors.shared_input(model, unread) == "hi"
    with pytest.raises(ParallelRefused, match="Rank 0 could not read the input: EOFError"):
        doors.shared_input(model, unread)


def test_a_follower_keeps_as_much_of_an_answer_as_rank_0(split):
    turns = deque([[["share", {"value": 2}]]])
    model, _, _ = split(1, lambda service: turns.popleft())
    assert doors.kept_together(model, 5) == 2


def test_rank_0_announces_each_submission_with_a_seed_only_when_it_samples_unseeded(
    split, checkpoints
):
    model, tokenizer, script = split(0)
    greedy = mlx_loom.generate(model, tokenizer, PROMPT, max_tokens=3)
    sampled = mlx_loom.generate(model, tokenizer, PROMPT, max_tokens=3, temperature=0.9)
    submits = [op for turn in script.sent for op in turn if op[0] == "submit"]
    assert [op[:2] for op in submits] == [["submit", None], ["submit", None]]
    assert submits[0][2] is None and isinstance(submits[1][2], int)
    ref, _ = mlx_loom.load(checkpoints["llama"])
    assert greedy == mlx_loom.generate(ref, tokenizer, PROMPT, max_tokens=3)
    again = mlx_loom.generate(
        ref, tokenizer, PROMPT, max_tokens=3, temperature=0.9, seed=submits[1][2]
    )
    assert sampled == again  # every rank samples with the announced seed


def test_rank_0_parks_its_engine_after_each_call_and_says_so(split):
    model, tokenizer, script = split(0)
    mlx_loom.generate(model, tokenizer, PROMPT, max_tokens=2)
    mlx_loom.generate(model, tokenizer, PROMPT, max_tokens=2)
    # Each call: the thread's seed, then "park" when the engine has nothing left —
    # and nothing more: the finished request's cancel restarts no thread.
    assert len(script.sent_ints) == 4 and script.sent_ints[1::2] == [1, 1]
    assert not script.service.stats().running


def test_rank_0_announces_a_cancel_for_the_request_its_reader_left(split):
    model, tokenizer, script = split(0)
    for _ in mlx_loom.stream_generate(model, tokenizer, PROMPT, max_tokens=400):
        break
    script.service.close(timeout=10)
    assert ["cancel", 0] in [op for turn in script.sent for op in turn]
    assert script.service.stats().engine.cancelled == 1


def test_reuse_decisions_take_the_largest_part_and_every_rank_trimming():
    class Group:
        def gather(self, values):
            return [values, [3 * values[0], 0.0]]  # another rank: bigger, not trimmable

    store = AgreeingPrefixStore(Group(), max_entries=4, max_bytes=None)

    class Kv:
        nbytes = 100

        def is_trimmable(self):
            return True

    assert store.measure([Kv()]) == (300, False)
