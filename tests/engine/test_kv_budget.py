"""The KV byte budget (``max_kv_bytes``): requests reserve their caches' bytes at their
fullest before they start, wait while those do not fit, and are failed when they never could."""

from __future__ import annotations

import pytest

from mlx_loom.engine import Engine, EngineSettings
from mlx_loom.engine.kv_budget import PROBE_GRANULE, KVBudget, tokens_held
from mlx_loom.errors import KVBudgetExceeded, RequestError

from .conftest import alone, assert_same_run, drive, ids, request


@pytest.mark.parametrize("name", ["llama", "llama-sliding", "qwen3_next", "gemma4_text"])
def test_a_reservation_covers_the_caches_a_finished_request_holds(name, loaded):
    model, _ = loaded(name)
    req = request(model, prompt=ids(300, 1), max_tokens=20)
    budget = KVBudget(model, 1 << 40)
    cost = budget.cost(req, 2048)
    run = alone(model, req)
    assert run.done is not None and run.done.caches is not None
    held = sum(c.nbytes for c in run.done.caches)
    # 300 + 20 tokens round up to 512: the full cache's own 256-token steps, never fewer bytes.
    assert 0 < held <= cost
    assert cost == budget.probe(512, None, 2048)


def test_a_reservation_grows_with_the_tokens_and_stops_at_a_bounded_window(loaded):
    model, _ = loaded("llama")
    budget = KVBudget(model, 1 << 40)
    step = PROBE_GRANULE
    short, long = budget.probe(step, None, step), budget.probe(8 * step, None, step)
    assert long == 8 * short  # a full cache: bytes in proportion to its tokens
    # max_kv_size makes every layer a window of that many tokens: the cost stops at the
    # window plus the prefill chunk it was last handed.
    windowed = budget.probe(8 * step, 64, step)
    assert windowed == budget.probe(2 * step, 64, step) < 2 * short


def test_tokens_held_counts_the_prompt_and_every_token_it_may_generate(loaded):
    model, _ = loaded("llama")
    assert tokens_held(request(model, prompt=ids(10, 2), max_tokens=7)) == 17


def test_a_request_that_does_not_fit_beside_a_running_one_waits_then_runs_as_alone(loaded):
    model, _ = loaded("llama")
    first = request(model, prompt=ids(9, 3), max_tokens=12)
    second = request(model, prompt=ids(7, 4), max_tokens=8)
    one = KVBudget(model, 1).cost(first, 2048)
    # Room for either request, never both: the second waits for the first to finish.
    engine = Engine(model, EngineSettings(max_kv_bytes=one + one // 2))
    seen = {"most_active": 0, "most_reserved": 0}

    def watch(_step, _events):
        stats = engine.stats()
        seen["most_active"] = max(seen["most_active"], stats.active)
        seen["most_reserved"] = max(seen["most_reserved"], stats.kv_bytes_reserved)

    runs = drive(engine, {0: [("first", first), ("second", second)]}, on_step=watch)
    assert seen == {"most_active": 1, "most_reserved": one}
    assert engine.stats().kv_bytes_reserved == 0  # every reservation given back
    assert_same_run(runs["first"], alone(model, first), "first")
    assert_same_run(runs["second"], alone(model, second), "second")


def test_without_a_budget_both_run_together(loaded):
    model, _ = loaded("llama")
    reqs = [request(model, prompt=ids(9, 3), max_tokens=12), request(model, prompt=ids(7, 4))]
    engine = Engine(model, EngineSettings())
    most = {"active": 0}
    drive(
        engine,
        {0: [("a", reqs[0]), ("b", reqs[1])]},
        on_step=lambda *_: most.update(active=max(most["active"], engine.stats().active)),
    )
    assert most["active"] == 2 and engine.stats().max_kv_bytes is None


def test_a_request_that_could_never_fit_fails_with_the_budget_named(loaded):
    model, _ = loaded("llama")
    req = request(model, prompt=ids(9, 5), max_tokens=4)
    engine = Engine(model, EngineSettings(max_kv_bytes=KVBudget(model, 1).cost(req, 2048) - 1))
    run = drive(engine, {0: [("big", req)]})["big"]
    assert run.done is not None and run.done.outcome == "failed"
    assert isinstance(run.done.error, KVBudgetExceeded)
    assert "max_kv_bytes" in run.done.error.message and run.done.error.fix
    assert run.tokens == [] and engine.stats().kv_bytes_reserved == 0


def test_a_negative_budget_is_refused_with_the_setting_named():
    with pytest.raises(RequestError, match="max_kv_bytes"):
        EngineSettings(max_kv_bytes=-1)
