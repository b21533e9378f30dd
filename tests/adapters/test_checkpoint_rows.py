"""Checkpoints in the prefix store are kept per adapter, and restore exactly under one."""

from __future__ import annotations

import mlx.core as mx

import mlx_loom
from mlx_loom.adapters import AdapterSet
from mlx_loom.engine import Engine, EngineSettings, make_request

from .test_engine_rows import _run
from .test_rows import _pair

EOT = 3


def _ids(n: int, seed: int) -> list[int]:
    return mx.random.randint(4, 256, (n,), key=mx.random.key(seed)).tolist()


def _ask(model, prompt, adapter):
    return make_request(
        model,
        None,
        prompt,
        max_tokens=5,
        logprobs_vector=True,
        adapter=adapter,
        eos=frozenset({EOT}),
    )


def test_a_checkpoint_serves_only_its_adapter_and_restores_exactly(base, tmp_path):
    path, adapters = _pair(base, tmp_path, "qwen3_next")
    model = mlx_loom.load(path)[0]
    AdapterSet(model, adapters)
    system = _ids(40, 1) + [EOT]
    first = system + _ids(8, 2) + [EOT] + _ids(2, 3)
    edited = system + _ids(8, 4) + [EOT] + _ids(2, 3)
    engine = Engine(model, EngineSettings(prompt_cache_size=8))
    _run(engine, {0: [("a", _ask(model, first, "lora"))]})
    other = _run(engine, {0: [("b", _ask(model, edited, "dora"))]})["runs"]["b"]
    assert engine.stats().prefix_hits == 0  # dora never sees lora's checkpoints
    got = _run(engine, {0: [("c", _ask(model, edited, "lora"))]})["runs"]["c"]
    assert engine.stats().prefix_checkpoint_hits == 1
    for name, run in (("lora", got), ("dora", other)):
        solo = _run(Engine(model), {0: [("s", _ask(model, edited, name))]})["runs"]["s"]
        assert run[0] == solo[0], name
        for a, b in zip(run[1], solo[1], strict=True):
            assert mx.array_equal(a, b).item(), name
