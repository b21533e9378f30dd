"""The thread-safety contract: the Python API may be called from many threads on one model.

Every generation runs on the model's engine thread, so calls from several
threads are concurrent (batched together), each gets the tokens it would get
alone, the process never aborts at exit, and a PromptCache serves one
generation at a time (a second one is refused, never corrupted).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

import mlx_loom
from mlx_loom.errors import RequestError
from mlx_loom.generation import PromptCache

PROMPTS = ["the model reads a token", "hello world", "a b c d", "once upon a time"]


def no_eos(tokenizer):
    return {t: -100.0 for t in tokenizer.eos_token_ids}


def test_threads_generating_on_one_model_each_get_their_solo_result(loaded):
    model, tok = loaded("llama")
    bias = no_eos(tok)
    expected = [mlx_loom.generate(model, tok, p, max_tokens=30, logit_bias=bias) for p in PROMPTS]
    gate = threading.Barrier(len(PROMPTS))

    def run(prompt: str) -> str:
        gate.wait(10)
        return mlx_loom.generate(model, tok, prompt, max_tokens=30, logit_bias=bias)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(run, PROMPTS))
    assert got == expected
    assert model.engine.stats().engine.peak_decoding >= 2, "the threads' requests never batched"


SCRIPT = textwrap.dedent(
    """
    import sys, threading
    import mlx_loom
    model, tok = mlx_loom.load(sys.argv[1])
    out = []
    def run(prompt):
        out.append(mlx_loom.generate(model, tok, prompt, max_tokens=8))
    threads = [threading.Thread(target=run, args=(p,)) for p in ("hello", "the model")]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert len(out) == 2
    """
)


def test_two_threads_generating_never_abort_the_process_at_exit(checkpoints, tmp_path):
    script = tmp_path / "two_threads.py"
    script.write_text(SCRIPT)
    path = str(checkpoints("llama"))

    def once(_):
        proc = subprocess.run(
            [sys.executable, str(script), path], capture_output=True, text=True, timeout=120
        )
        return proc.returncode, proc.stderr[-500:]

    with ThreadPoolExecutor(6) as pool:  # the runs mostly wait on imports
        results = list(pool.map(once, range(20)))
    failures = [r for r in results if r[0] != 0]
    assert not failures, f"{len(failures)} of 20 runs failed; first: {failures[0]}"


def test_a_prompt_cache_in_use_is_refused_to_a_second_generation(loaded):
    model, tok = loaded("llama")
    cache = PromptCache(model)
    first = mlx_loom.stream_generate(model, tok, "hello", prompt_cache=cache, max_tokens=20)
    next(first)  # the first generation now holds the cache
    errors = []

    def second() -> None:
        try:
            list(mlx_loom.stream_generate(model, tok, "hello", prompt_cache=cache, max_tokens=2))
        except RequestError as err:
            errors.append(err)

    thread = threading.Thread(target=second)
    thread.start()
    thread.join(30)
    assert errors and "in use by another generation" in errors[0].message
    assert "its own PromptCache" in errors[0].fix
    rest = list(first)
    assert rest[-1].finish_reason is not None
    # Released once the first generation is over, with its tokens recorded.
    assert len(cache.tokens) > 0
    assert list(mlx_loom.stream_generate(model, tok, "hello", prompt_cache=cache, max_tokens=2))


def test_the_engine_thread_exits_when_idle_and_comes_back_on_demand(loaded):
    model, tok = loaded("llama")
    service = model.engine
    before = service.settings
    service.configure(idle_seconds=0.05)
    try:
        mlx_loom.generate(model, tok, "hello", max_tokens=3)
        deadline = threading.Event()
        for _ in range(200):
            if not service.stats().running:
                break
            deadline.wait(0.02)
        assert not service.stats().running
        assert mlx_loom.generate(model, tok, "hello", max_tokens=3) == mlx_loom.generate(
            model, tok, "hello", max_tokens=3
        )
    finally:
        service.configure(before)


def test_a_closed_engine_refuses_new_work_until_the_model_makes_a_new_one(loaded):
    from mlx_loom.errors import EngineStopped

    model, tok = loaded("llama")
    old = model.engine
    old.close()
    with pytest.raises(EngineStopped):
        old.submit(None)  # type: ignore[arg-type]
    assert model.engine is not old
    assert mlx_loom.generate(model, tok, "hello", max_tokens=2)


def test_a_prompt_cache_can_be_saved_on_the_callers_thread_after_generating(loaded, tmp_path):
    """Its arrays were computed on the engine thread; none is left lazy for the caller."""
    model, tok = loaded("qwen3_next")
    cache = PromptCache(model)
    list(mlx_loom.stream_generate(model, tok, "the model reads", prompt_cache=cache, max_tokens=5))
    cache.save(tmp_path / "conversation.safetensors")
    again = PromptCache.load(tmp_path / "conversation.safetensors", model)
    assert again.tokens == cache.tokens


def test_a_loaded_model_runs_on_any_thread(loaded):
    """Construction-time constants (Gemma 4's RoPE frequencies) are evaluated at load:
    a lazy graph built on the loading thread would fail on any other thread with
    "There is no Stream(cpu, 0) in current thread" (every Gemma 4 request through
    ``loom serve`` did)."""
    import mlx.core as mx

    model, _ = loaded("gemma4_text")
    out: list = []

    def forward() -> None:
        try:
            logits = model(mx.array([[5, 6, 7]]))
            mx.eval(logits)
            out.append(logits.shape)
        except Exception as err:  # the assertion below reports it
            out.append(err)
        finally:
            mx.synchronize()
            mx.clear_streams()

    thread = threading.Thread(target=forward)
    thread.start()
    thread.join(60)
    assert out == [(1, 3, model.vocab_size)]


def test_a_model_its_user_drops_is_freed_once_its_engine_idles(checkpoints):
    import gc
    import time
    import weakref

    model, tok = mlx_loom.load(checkpoints("llama"))
    model.engine.configure(idle_seconds=0.05)
    mlx_loom.generate(model, tok, "hello", max_tokens=3)
    alive = weakref.ref(model)
    del model
    deadline = time.monotonic() + 10
    while alive() is not None and time.monotonic() < deadline:
        time.sleep(0.05)
        gc.collect()
    assert alive() is None, "the engine thread kept the model alive"


def test_a_burst_submitted_to_an_idle_engine_is_prefilled_together(loaded, monkeypatch):
    """An idle engine waits for a burst to finish arriving before it prefills."""
    from .test_engine import CountingModule

    model, tok = loaded("llama")
    counter = CountingModule(model.module)
    monkeypatch.setattr(model, "module", counter)
    prompts = ["the model reads a", "hello world, this", "a b c d e", "once upon a"]
    mlx_loom.batch_generate(model, tok, prompts, max_tokens=3)
    prefills = [s for s in counter.shapes if s[1] > 1]
    assert len(prefills) == 1 and prefills[0][0] == len(prompts)
