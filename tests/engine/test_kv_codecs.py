"""KV codecs in the continuous-batching engine: each row equals its solo run.

Rows asking for different storage — plain, affine, TurboQuant 3/4-bit, a late
conversion point — decode in one batch (through per-codec segments of a
mixed batch cache), and every row's tokens and log-probability vectors are
bit-equal to the same request run alone. Covered for every family's cache
layout: full attention (Llama), full attention beside recurrent state (Qwen3
Next), sliding windows with KV-shared layers (Gemma 4).
"""

from __future__ import annotations

import pytest

from mlx_loom.cache import TurboQuantKVCache
from mlx_loom.cache.mixed import MixedRowsCache
from mlx_loom.engine import Engine, EngineSettings

from .conftest import alone, assert_same_run, drive, ids, request

CODECS = {
    "plain": {},
    "affine4": {"kv_bits": 4, "kv_group_size": 32},
    "turbo3": {"kv_codec": "turboquant", "kv_bits": 3},
    "turbo4": {"kv_codec": "turboquant"},
    "turbo4-late": {"kv_codec": "turboquant", "kv_bits": 4, "quantized_kv_start": 12},
}

FAMILIES = ["llama", "llama-sliding", "qwen3_next", "gemma4_text"]


@pytest.mark.parametrize("name", FAMILIES)
def test_rows_of_different_codecs_share_a_batch_and_equal_their_solo_runs(name, loaded):
    model, _ = loaded(name)
    reqs = {
        codec: request(model, prompt=ids(5 + 3 * i, 10 + i), max_tokens=14, **options)
        for i, (codec, options) in enumerate(CODECS.items())
    }
    settings = EngineSettings(prefill_step_size=4)
    engine = Engine(model, settings)
    widest, mixed = [], []

    def watch(_step, _events):
        widest.append(engine.stats().decoding)
        mixed.append(any(isinstance(c, MixedRowsCache) for g in engine._groups for c in g.caches))

    runs = drive(
        engine,
        {
            0: [("plain", reqs["plain"]), ("turbo3", reqs["turbo3"])],
            2: [("affine4", reqs["affine4"])],
            4: [("turbo4", reqs["turbo4"]), ("turbo4-late", reqs["turbo4-late"])],
        },
        on_step=watch,
    )
    assert max(widest) >= 4, f"{name}: the rows never decoded together"
    assert any(mixed), f"{name}: no batch ever mixed codecs"
    for codec, req in reqs.items():
        assert runs[codec].done.outcome == "finished"
        assert_same_run(runs[codec], alone(model, req, settings), f"{name} {codec}")


def test_turboquant_rows_batch_in_one_turboquant_batch(loaded):
    model, _ = loaded("llama")
    reqs = [
        request(model, prompt=ids(6 + i, i), max_tokens=10, kv_codec="turboquant") for i in range(3)
    ]
    engine = Engine(model)
    kinds = set()

    def watch(_step, _events):
        kinds.update(
            (type(c).__name__, c.codec) for g in engine._groups if len(g) > 1 for c in g.caches
        )

    runs = drive(engine, {0: [(str(i), r) for i, r in enumerate(reqs)]}, on_step=watch)
    assert kinds == {("BatchKVCache", "turboquant")}
    for i, r in enumerate(reqs):
        assert_same_run(runs[str(i)], alone(model, r), f"row {i}")


def test_a_finished_turboquant_row_leaves_with_its_own_single_row_caches(loaded):
    model, _ = loaded("llama")
    caches = model.make_cache()
    req = request(model, prompt=ids(7, 3), max_tokens=6, kv_codec="turboquant", cache=caches)
    other = request(model, prompt=ids(9, 4), max_tokens=12, kv_bits=8, kv_group_size=32)
    drive(Engine(model), {0: [("mine", req), ("other", other)]})
    assert caches and all(isinstance(c, TurboQuantKVCache) for c in caches)
    assert {c.offset for c in caches} == {7 + 6 - 1}


def test_threads_asking_for_different_codecs_each_get_their_solo_result(loaded):
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import mlx_loom

    model, tok = loaded("llama")
    no_eos = {t: -100.0 for t in tok.eos_token_ids}
    asks = [
        ("the model reads a token", {}),
        ("hello world", {"kv_bits": 4, "kv_group_size": 32}),
        ("a b c d", {"kv_codec": "turboquant", "kv_bits": 3}),
        ("once upon a time", {"kv_codec": "turboquant"}),
    ]
    options = dict(max_tokens=24, logit_bias=no_eos)
    expected = [mlx_loom.generate(model, tok, p, **options, **kv) for p, kv in asks]
    gate = threading.Barrier(len(asks))

    def run(ask):
        gate.wait(10)
        prompt, kv = ask
        return mlx_loom.generate(model, tok, prompt, **options, **kv)

    with ThreadPoolExecutor(len(asks)) as pool:
        got = list(pool.map(run, asks))
    assert got == expected
