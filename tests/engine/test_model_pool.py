"""The model pool: which models are resident, which load, which are unloaded, and when.

Residency is tested with stand-in residents (no MLX: the rules alone); the
last test loads a real checkpoint and measures that unloading it gives its
memory back.
"""

from __future__ import annotations

import gc
import os
import threading
import time

import mlx.core as mx
import pytest

import mlx_loom
from mlx_loom.engine.pool import ModelPool, PooledModel
from mlx_loom.errors import EngineBusy, ModelUnavailable, RequestError, UnknownModelType
from mlx_loom.testing.checkpoints import write_checkpoint
from mlx_loom_minicpm5.plugin import TINY_CONFIG, checkpoint_tensors


class Fake:
    """A resident that records its life; ``rows`` stands for work in its engine."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log, self.rows, self.kv = name, log, 0, 0
        log.append(f"load {name}")

    def busy(self) -> bool:
        return self.rows > 0

    def kv_bytes(self) -> int:
        return self.kv

    def close(self) -> None:
        self.log.append(f"unload {self.name}")


def fakes(log: list[str], sizes: dict[str, int], **options) -> ModelPool[Fake]:
    def spec(name: str, size: int) -> PooledModel[Fake]:
        return PooledModel(name, lambda: Fake(name, log), lambda: size)

    return ModelPool([spec(n, s) for n, s in sizes.items()], **options)


def wait_until(condition, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the pool did not get there"
        time.sleep(0.01)


def states(pool: ModelPool) -> dict[str, str]:
    return {s.id: s.state for s in pool.status()}


def test_loading_past_max_loaded_unloads_the_least_recently_used_idle_model():
    log: list[str] = []
    pool = fakes(log, {"a": 1, "b": 1, "c": 1}, max_loaded=2)
    try:
        for name in ("a", "b", "a", "c"):
            pool.acquire(name).release()
        assert log == ["load a", "load b", "unload b", "load c"]  # a was used after b
        assert states(pool) == {"a": "loaded", "b": "unloaded", "c": "loaded"}
    finally:
        pool.close()
    assert log[-2:] in (["unload a", "unload c"], ["unload c", "unload a"])


def test_a_model_in_use_is_never_unloaded_and_the_waiting_load_follows_its_release():
    log: list[str] = []
    pool = fakes(log, {"a": 1, "b": 1}, max_loaded=1)
    try:
        held = pool.acquire("a")
        got: list[Fake] = []
        waiter = threading.Thread(target=lambda: got.append(pool.load("b")))
        waiter.start()
        time.sleep(0.3)
        assert log == ["load a"] and not got  # b waits: a has a user
        # a is picked to make room, so a new user of a waits too (no starvation of b)
        second: list[object] = []
        again = threading.Thread(target=lambda: second.append(pool.acquire("a")))
        again.start()
        time.sleep(0.2)
        assert not second
        held.release()
        waiter.join(10)
        assert got and got[0].name == "b"
        assert log[:3] == ["load a", "unload a", "load b"]
        again.join(10)  # and a comes back once b is idle
        assert second and log[-2:] == ["unload b", "load a"]
        second[0].release()  # type: ignore[attr-defined]
    finally:
        pool.close()


def test_a_model_loaded_for_a_waiting_caller_is_theirs_before_another_load_may_evict_it():
    # The moment after b's load and before its caller takes the lease (a busy
    # machine may schedule another load thread first): a load of a must neither
    # unload b nor drain it, or the two loads evict each other's model unserved.
    log: list[str] = []
    pool = fakes(log, {"a": 1, "b": 1}, max_loaded=1)
    try:
        pool.load("b")
        slot_a, slot_b = pool._slots["a"], pool._slots["b"]  # noqa: SLF001 (the rule itself)
        with pool._cond:  # noqa: SLF001
            slot_b.fresh, slot_b.waiting = True, 1
            assert not pool._make_room(slot_a)  # noqa: SLF001
            assert slot_b.state == "loaded" and not slot_b.draining
            slot_b.waiting = 0  # its caller took the lease and is done
            assert pool._make_room(slot_a)  # noqa: SLF001
        assert log == ["load b", "unload b"]
    finally:
        pool.close()


def test_rows_in_an_engine_keep_its_model_resident():
    log: list[str] = []
    pool = fakes(log, {"a": 1, "b": 1}, max_loaded=1)
    try:
        a = pool.load("a")
        a.rows = 1  # e.g. a Python-API generation with no lease
        loader = threading.Thread(target=lambda: pool.load("b"))
        loader.start()
        time.sleep(0.2)
        assert states(pool)["a"] == "loaded"
        a.rows = 0
        loader.join(10)
        assert states(pool) == {"a": "unloaded", "b": "loaded"}
    finally:
        pool.close()


def test_the_memory_budget_counts_weights_and_kv_bytes():
    log: list[str] = []
    pool = fakes(log, {"a": 40, "b": 40, "huge": 101}, max_memory=100)
    try:
        pool.load("a").kv = 15
        pool.load("b")  # 40 + 15 + 40 fits
        assert log == ["load a", "load b"]
        assert pool.memory_in_use() == 95
        pool.load("b").kv = 30  # now 40 + 15 + 40 + 30: a third model of 40 would not fit
        assert pool.memory_in_use() == 125
        pool.load("a")
        with pytest.raises(ModelUnavailable, match="more than the pool's memory budget"):
            pool.acquire("huge")
        assert states(pool)["huge"] == "failed" and states(pool)["a"] == "loaded"
    finally:
        pool.close()


def test_keep_alive_unloads_a_model_left_idle():
    log: list[str] = []
    pool = fakes(log, {"a": 1, "b": 1}, keep_alive=0.2)
    try:
        lease = pool.acquire("a")
        pool.load("b")
        wait_until(lambda: states(pool)["b"] == "unloaded")
        assert states(pool)["a"] == "loaded"  # still leased
        lease.release()
        wait_until(lambda: states(pool)["a"] == "unloaded")
        status = {s.id: s for s in pool.status()}
        assert status["a"].last_used is not None and status["a"].in_use == 0
        pool.load("a")  # and it comes back on its next use
        assert log.count("load a") == 2
    finally:
        pool.close()


def test_a_failed_load_fails_its_requests_with_the_cause_and_the_others_serve():
    log: list[str] = []

    def broken() -> Fake:
        raise UnknownModelType("no plugin claims model_type 'nope'", fix="install one")

    ok = PooledModel("ok", lambda: Fake("ok", log), lambda: 1)
    pool = ModelPool([PooledModel("bad", broken, lambda: 1), ok])
    try:
        for _ in range(2):  # every request gets the error; the load is not retried
            with pytest.raises(ModelUnavailable, match="failed to load: no plugin claims") as err:
                pool.acquire("bad")
            assert isinstance(err.value.cause, UnknownModelType) and err.value.fix == "install one"
        assert pool.load("ok").name == "ok"
        bad = next(s for s in pool.status() if s.id == "bad")
        assert bad.state == "failed" and "nope" in (bad.error or "")
    finally:
        pool.close()


def test_a_slow_load_holds_up_neither_the_other_models_nor_more_than_its_waiters():
    log: list[str] = []
    release = threading.Event()

    def slow() -> Fake:
        release.wait(10)
        return Fake("slow", log)

    fast = PooledModel("fast", lambda: Fake("fast", log), lambda: 1)
    pool = ModelPool([fast, PooledModel("slow", slow, lambda: 1)], max_waiting=1)
    try:
        pool.load("fast")
        with pytest.raises(RequestError, match="not in this pool") as err:
            pool.acquire("other")
        assert err.value.code == "model_not_found"
        first = threading.Thread(target=lambda: pool.load("slow"))
        first.start()
        wait_until(lambda: states(pool)["slow"] == "loading")
        with pytest.raises(EngineBusy):
            pool.acquire("slow")  # one caller already waits: the bound
        pool.acquire("fast").release()  # served at once while "slow" loads
        release.set()
        first.join(10)
        pool.acquire("slow").release()  # a loaded model takes any number of users
    finally:
        release.set()
        pool.close()


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads RSS from /proc")
def test_unloading_returns_the_models_memory(tmp_path):
    # ~40 MB of float32 weights: a model that was not freed would show plainly.
    cfg = {**TINY_CONFIG, "hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 4}
    path = write_checkpoint(tmp_path / "m", cfg, checkpoint_tensors(cfg))
    pool = ModelPool([PooledModel.from_ref("m", path)])
    try:
        measured = []
        for _ in range(2):  # the first round pays one-time costs (imports, kernels)
            gc.collect()
            mx.clear_cache()
            before = (_rss(), mx.get_active_memory())
            lease = pool.acquire("m")
            loaded = lease.resident
            assert mlx_loom.generate(loaded.model, loaded.tokenizer, "the cat", max_tokens=4)
            during = mx.get_active_memory()
            del loaded
            lease.release()
            assert pool.unload("m")
            measured.append((before, during, (_rss(), mx.get_active_memory())))
        (rss0, active0), during, (rss1, active1) = measured[-1]
        assert during - active0 > 30e6  # the weights were there
        assert active1 - active0 < 1e6
        assert rss1 - rss0 < 4e6
    finally:
        pool.close()
