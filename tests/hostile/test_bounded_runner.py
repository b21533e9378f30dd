"""The bounded runner itself: each way a child can end is reported, and bounded."""

from __future__ import annotations

from .bounded import run_bounded


def test_a_finished_snippet_returns_its_result():
    assert run_bounded("RESULT = ARGS['x'] * 2", args={"x": 21}, memory_mb=256).expect_ok() == 42


def test_an_exception_is_reported_with_its_type_and_message():
    outcome = run_bounded("raise KeyError('nope')", memory_mb=256)
    outcome.expect_error("KeyError", "nope")
    assert outcome.error_mro[:2] == ("KeyError", "LookupError")


def test_a_typed_error_carries_its_fix():
    outcome = run_bounded(
        """
        from mlx_loom.errors import ConfigError
        raise ConfigError("bad field", fix="change it")
        """
    )
    outcome.expect_error("LoomError", "bad field")
    assert outcome.fix == "change it"


def test_a_snippet_that_never_ends_is_killed_at_the_time_bound():
    outcome = run_bounded("while True: pass", timeout_s=1.0, memory_mb=256)
    assert outcome.status == "timeout" and outcome.seconds < 10


def test_an_allocation_past_the_memory_bound_fails_in_the_child():
    outcome = run_bounded("x = bytearray(2 << 30)", memory_mb=512)
    outcome.expect_error("MemoryError")


def test_a_process_abort_is_reported_as_a_crash():
    outcome = run_bounded("import os; os.abort()", memory_mb=256)
    assert outcome.status == "crashed" and outcome.returncode is not None
    assert outcome.returncode < 0
