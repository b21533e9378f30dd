"""The CPU benchmark's harness: its quick run prints and writes the structure
the docs' table is read from, and its ratios take the better llama.cpp
thread mode of each round as the peer. Timings are never asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def cpu_bench():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import cpu_bench  # the script, importable with its directory on the path

        yield cpu_bench
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.mark.slow  # ~10 s on 2 cores: two tiny models built, two engines, two rounds
def test_quick_run_prints_spreads_bandwidth_and_ratios(tmp_path):
    out = tmp_path / "results.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "cpu_bench.py"),
            "--quick",
            "--rows",
            "quick-llama,quick-qwen3_moe",
            "--prompts",
            "8",
            "--repeats",
            "2",
            "--engines",
            "loom native f32,mlx-lm",
            "--cache",
            str(tmp_path / "ckpt"),
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    text = done.stdout
    assert "decode tok/s min / median / max" in text
    assert "| row | prompt | engine | peer | rounds | decode ratio | prefill ratio |" in text
    assert text.count("(read ") == 2 * 2 * 2  # a bandwidth reading printed with every run
    results = json.loads(out.read_text())
    assert [(r["row"], r["engine"]) for r in results] == [
        ("quick-llama", "loom native f32"),
        ("quick-llama", "mlx-lm"),
        ("quick-qwen3_moe", "loom native f32"),
        ("quick-qwen3_moe", "mlx-lm"),
    ]
    for r in results:
        assert r["runs"] == 2 and len(r["read_gbs"]) == 2
        for key in ("prefill_tps", "decode_tps"):
            s = r[key]
            assert 0 < s["min"] <= s["median"] <= s["max"]
    loom = results[0]
    assert set(loom["vs"]) == {"mlx-lm"} and loom["vs"]["mlx-lm"]["rounds"] == 2
    assert results[1]["vs"] == {}  # no ratio of a peer against itself


def test_ratio_peer_is_the_better_llama_cpp_mode_of_each_round(cpu_bench):
    Engine = cpu_bench.Engine
    loom = Engine("loom native f32", None, 2, {0: (100.0, 10.0, 1.0), 1: (100.0, 10.0, 1.0)})
    one = Engine("llama.cpp 1t", None, 1, {0: (50.0, 20.0, 1.0), 1: (50.0, 5.0, 1.0)})
    two = Engine("llama.cpp 2t", None, 2, {0: (200.0, 2.0, 1.0), 1: (25.0, 8.0, 1.0)})
    f32 = Engine("mlx-lm f32", None, 2, {1: (10.0, 1.0, 1.0)})
    results = cpu_bench.summarize("r", 32, [loom, one, two, f32], step_bytes=10**9)
    vs = results[0]["vs"]
    assert list(vs) == ["llama.cpp best of 1t/2t", "mlx-lm f32"]
    assert vs["mlx-lm f32"]["rounds"] == 1  # only the rounds both engines ran
    assert vs["mlx-lm f32"]["decode"] == {"min": 10.0, "median": 10.0, "max": 10.0}
    # round 0: peer decode 20 (1t), round 1: 8 (2t); prefill 200 (2t), 50 (1t)
    assert vs["llama.cpp best of 1t/2t"]["decode"] == {"min": 0.5, "median": 0.875, "max": 1.25}
    assert vs["llama.cpp best of 1t/2t"]["prefill"] == {"min": 0.5, "median": 1.25, "max": 2.0}
    assert all(r["vs"] == {} for r in results[1:])  # peers get no ratios
    assert results[1]["decode_tps"] == {"min": 5.0, "median": 12.5, "max": 20.0}
