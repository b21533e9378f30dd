"""The preparation pool: work runs off the caller's thread, large work never takes every thread,
and a caller whose client leaves stops waiting."""

from __future__ import annotations

import threading
import time

import pytest

from mlx_loom.serve.prepare import ClientGone, PoolClosed, PreparePool

BOUND = 10.0  # seconds any wait in these tests may take before it counts as a hang


def never_gone() -> bool:
    return False


@pytest.fixture
def pool():
    pool = PreparePool(threads=2)
    yield pool
    pool.close()


def run_in_thread(fn) -> tuple[threading.Thread, list]:
    out: list = []

    def target() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # the test inspects it
            out.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, out


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + BOUND
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def test_work_runs_on_a_pool_thread_and_returns_its_result(pool):
    name = pool.run(lambda: threading.current_thread().name, large=False, gone=never_gone)
    assert name.startswith("loom-prepare") and name != threading.current_thread().name


def test_the_works_exception_reaches_the_caller(pool):
    def fail():
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        pool.run(fail, large=False, gone=never_gone)


def test_a_timeout_error_raised_by_the_work_is_not_taken_for_waiting(pool):
    def fail():
        raise TimeoutError("the work's own")

    with pytest.raises(TimeoutError, match="the work's own"):
        pool.run(fail, large=False, gone=never_gone)


def test_large_work_leaves_a_thread_for_small_work(pool):
    release = threading.Event()
    large = [
        run_in_thread(lambda: pool.run(release.wait, large=True, gone=never_gone)) for _ in range(3)
    ]
    wait_until(lambda: pool.running == 1 and pool.waiting == 2, "one large job to run")
    # Both threads could take large jobs; only one does, and a small job runs at once.
    assert pool.run(lambda: "small", large=False, gone=never_gone) == "small"
    assert pool.running == 1
    release.set()
    for thread, out in large:
        thread.join(BOUND)
        assert out == [True]
    assert (pool.running, pool.waiting) == (0, 0)


def test_with_one_thread_large_and_small_work_take_turns():
    pool = PreparePool(threads=1)
    try:
        release = threading.Event()
        thread, out = run_in_thread(lambda: pool.run(release.wait, large=True, gone=never_gone))
        wait_until(lambda: pool.running == 1, "the large job to run")
        small, small_out = run_in_thread(lambda: pool.run(lambda: 1, large=False, gone=never_gone))
        time.sleep(0.1)
        assert small_out == []  # waits for the only thread
        release.set()
        small.join(BOUND)
        thread.join(BOUND)
        assert small_out == [1] and out == [True]
    finally:
        pool.close()


def test_a_caller_whose_client_left_stops_waiting_and_its_work_is_dropped(pool):
    release = threading.Event()
    blockers = [
        run_in_thread(lambda: pool.run(release.wait, large=False, gone=never_gone))
        for _ in range(2)
    ]
    wait_until(lambda: pool.running == 2, "both threads to be busy")
    ran = threading.Event()
    gone = threading.Event()
    thread, out = run_in_thread(lambda: pool.run(ran.set, large=False, gone=gone.is_set))
    wait_until(lambda: pool.waiting == 1, "the third job to queue")
    gone.set()
    thread.join(BOUND)
    assert len(out) == 1 and isinstance(out[0], ClientGone)
    release.set()
    for blocker, _ in blockers:
        blocker.join(BOUND)
    assert not ran.is_set()  # dropped, never run
    assert (pool.running, pool.waiting) == (0, 0)


def test_a_large_caller_waiting_for_its_turn_leaves_when_its_client_does(pool):
    release = threading.Event()
    first, _ = run_in_thread(lambda: pool.run(release.wait, large=True, gone=never_gone))
    wait_until(lambda: pool.running == 1, "the first large job to run")
    gone = threading.Event()
    thread, out = run_in_thread(lambda: pool.run(lambda: 2, large=True, gone=gone.is_set))
    wait_until(lambda: pool.waiting == 1, "the second large job to wait")
    gone.set()
    thread.join(BOUND)
    assert isinstance(out[0], ClientGone)
    release.set()
    first.join(BOUND)
    # Its turn was never taken: the next large job runs.
    assert pool.run(lambda: 3, large=True, gone=never_gone) == 3


def test_a_closed_pool_refuses_new_work():
    pool = PreparePool(threads=1)
    pool.close()
    with pytest.raises(PoolClosed):
        pool.run(lambda: 1, large=False, gone=never_gone)


@pytest.mark.parametrize("threads", [0, -1, True, 1.5])
def test_a_pool_needs_a_positive_thread_count(threads):
    with pytest.raises(ValueError, match="at least one thread"):
        PreparePool(threads=threads)
