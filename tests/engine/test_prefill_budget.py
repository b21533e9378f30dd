"""The prefill token budget: while rows decode, a step prefills whole chunks up to the budget.

Behaviour, not time: which step each request's first token arrives on, and
that the running stream gets a token on every step, against the same
requests with the budget off (every prefilling prompt advancing at once).
Each request's tokens and log-probabilities stay those of the request alone.
"""

from __future__ import annotations

import pytest

from mlx_loom.engine import Engine, EngineSettings
from mlx_loom.engine.core import within_budget
from mlx_loom.engine.row import Row
from mlx_loom.errors import RequestError

from .conftest import alone, assert_same_run, drive, ids, request

STEP = 8  # prompt tokens per chunk
CHUNKS = 3  # chunks per long prompt (all but its last token are prefilled)


def _first_tokens(
    budget: int, loaded, name: str = "llama"
) -> tuple[dict[str, int], list[set[str]], dict]:
    """Run one decoding stream and three long prompts arriving together at step 3."""
    model, _ = loaded(name)
    short = request(model, prompt=ids(5, 1), max_tokens=30)
    longs = {
        name: request(model, prompt=ids(STEP * CHUNKS + 1, seed), max_tokens=3)
        for name, seed in (("a", 2), ("b", 3), ("c", 4))
    }
    settings = EngineSettings(prefill_step_size=STEP, prefill_token_budget=budget)
    engine = Engine(model, settings)
    per_step: list[set[int]] = []
    runs = drive(
        engine,
        {0: [("short", short)], 3: list(longs.items())},
        on_step=lambda _k, events: per_step.append(
            {e.uid for e in events if hasattr(e, "token")}
        ),
    )
    uid_name = {run.done.uid: name for name, run in runs.items()}
    steps = [{uid_name[u] for u in uids} for uids in per_step]
    first = {name: next(k for k, got in enumerate(steps) if name in got) for name in runs}
    solo = {name: alone(model, req, settings) for name, req in {"short": short, **longs}.items()}
    for name, run in runs.items():
        assert_same_run(run, solo[name], f"budget {budget}, {name}")
    return first, steps, runs


# Full attention, a rotating window, recurrent state, KV-shared layers: the
# budget moves when chunks run, never where they cut, for every cache kind.
@pytest.mark.parametrize("name", ["llama", "llama-sliding", "qwen3_next", "gemma4_text"])
def test_long_prompts_take_the_budget_in_turn_while_a_stream_decodes(loaded, name):
    first, steps, runs = _first_tokens(STEP, loaded, name)
    # One chunk per step: the prompts are prefilled one after the other, in
    # the order they arrived, each in CHUNKS steps.
    assert first["b"] - first["a"] == CHUNKS
    assert first["c"] - first["b"] == CHUNKS
    # The running stream got a token on every step until it finished.
    last = max(k for k, got in enumerate(steps) if "short" in got)
    assert all("short" in got for got in steps[first["short"] : last + 1])
    assert len(runs["short"].tokens) == 30


def test_without_a_budget_every_prompt_advances_each_step(loaded):
    first, _, _ = _first_tokens(0, loaded)
    assert first["a"] == first["b"] == first["c"]


def test_chunks_within_the_budget_share_a_step_and_the_first_always_runs(loaded):
    model, _ = loaded("llama")

    def row(uid: int, n: int) -> Row:
        req = request(model, prompt=ids(n + 1, uid), max_tokens=1)
        return Row(uid, req, to_feed=list(req.prompt), cached=0)

    rows = [row(0, 20), row(1, 6), row(2, 12), row(3, 4)]
    chosen, steps = within_budget(rows, [32] * 4, 10)
    # The first runs although it is over the budget; nothing else fits after it.
    assert [r.uid for r in chosen] == [0] and steps == [32]
    chosen, _ = within_budget(rows[1:], [32] * 3, 10)
    # 6 fits, 12 would not (18), 4 still does (10): first come, first served, no cut.
    assert [r.uid for r in chosen] == [1, 3]


@pytest.mark.parametrize("bad", [-1, 1.5, True, "8"])
def test_a_bad_budget_is_refused_with_what_to_pass(bad):
    with pytest.raises(RequestError, match="prefill_token_budget"):
        EngineSettings(prefill_token_budget=bad)
