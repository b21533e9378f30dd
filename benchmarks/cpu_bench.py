"""CPU speed side by side: mlx-loom on each CPU path, mlx-lm, and llama.cpp, same weights.

Run by hand (not a test), ideally on a quiet machine (check ``uptime``)::

    bash benchmarks/setup_llama_cpp.sh        # once, ~16 min: llama.cpp in its own venv
    .venv/bin/python benchmarks/cpu_bench.py  # every row; --rows, --list, --json

Rows are Llama checkpoints with random weights, written locally in Hugging
Face layout: a tiny one (~7M parameters) and one of ~350M (313M weights
read per decode token), each in bf16 and quantized by mlx-lm's converter to
4 bits (group 64) with bf16 scales, as mlx-community ships them. llama.cpp
runs GGUF files converted from the same bf16 weights by llama.cpp's own
converter: BF16, and Q4_0 for the 4-bit rows (4.5 bits per weight, as MLX's
4-bit group-64 packing with bf16 scales and biases).

Engines, for each row:

* ``loom native f32`` — the default: float32 compute, cpu-native kernels;
* ``loom int8-act f32`` — float32 compute, cpu-native-int8-act kernels (4-bit
  decode products against int8 activations; the same as ``loom native f32``
  on the bf16 rows, which have no 4-bit product);
* ``loom native ckpt`` — cpu-native kernels, the checkpoint's dtype;
* ``loom ops f32`` — MLX operations, float32 compute;
* ``loom ops ckpt`` — MLX operations in the checkpoint's dtype (mlx-lm's arithmetic);
* ``mlx-lm`` — as it loads the checkpoint; ``mlx-lm f32`` — after ``set_dtype(float32)``;
* ``llama.cpp`` — through llama-cpp-python, same number of threads.

Method: each run is a prefill of the same prompt ids then greedy decode.
The first run of each MLX engine is made with only its model loaded, and
its peak memory is MLX's peak over loading and that run; later runs load
all the MLX engines in this process and interleave them, the order reversed
each round. llama.cpp runs in its own process (same prompt, same threads),
one run per round in the same interleaving; its peak memory is that
process's peak RSS. Each engine repeats until ``--repeats`` runs or its
time budget is spent (at least one run); medians are reported.

The bandwidth limit is the read bandwidth (numpy sums over 1 GB on as many
threads as the engines use) divided by the bytes of weights a decode step
reads (every stored tensor except the embedding table, of which it reads
one row). On a shared machine that bandwidth moves with the neighbours'
load (13-22 GB/s here in one afternoon), so it is measured right before
every run, and an engine's "% of bandwidth limit" is the median over its
runs of that run's decode speed against the bandwidth read just before it.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np
from bench import CACHE_DIR, Row, _greedy, _loop_speed, build, llama

import mlx_loom
from mlx_loom.artifacts import read_manifest
from mlx_loom.generation.loop import generate_tokens

HERE = Path(__file__).resolve().parent
LLAMA_VENV = HERE / ".llama-venv"


def rows() -> list[Row]:
    tiny = llama(256, 4, 8, 2, 688, 8192)
    mid = llama(1024, 24, 16, 8, 2816, 32000)  # ~346M parameters, 313M read per token
    return [
        Row("llama-tiny-bf16", "llama", tiny, "BF16"),
        Row("llama-tiny-q4", "llama", tiny, "BF16", bits=4),
        Row("llama-350m-bf16", "llama", mid, "BF16"),
        Row("llama-350m-q4", "llama", mid, "BF16", bits=4),
    ]


@dataclass
class Engine:
    name: str
    run: object  # (prompt, gen) -> (prefill tok/s, decode tok/s)
    weight_bytes: int
    prefill: list[float] = field(default_factory=list)
    decode: list[float] = field(default_factory=list)
    read_gbs: list[float] = field(default_factory=list)  # bandwidth just before each run
    peak_gb: float = 0.0
    spent: float = 0.0


def _param_bytes(module) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))


def loom_engine(path: Path, compute_dtype: str, cpu_kernels: str) -> tuple[object, int]:
    model, _ = mlx_loom.load(path, compute_dtype=compute_dtype, cpu_kernels=cpu_kernels)

    def run(prompt, gen):
        tokens = generate_tokens(model, prompt, model.make_cache(), sampler=_greedy, max_tokens=gen)
        return _loop_speed(tokens, len(prompt), gen)

    # The model's engine thread keeps the model alive until it is closed: without
    # this an unloaded engine's weights would count in the next engine's peak.
    run.close = lambda: model.engine.close()
    return run, _param_bytes(model.module)


def mlx_lm_engine(path: Path, dtype) -> tuple[object, int]:
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    model, _ = load_model(path)
    if dtype is not None:
        model.set_dtype(dtype)
    mx.eval(model.parameters())

    def run(prompt, gen):
        return _loop_speed(generate_step(mx.array(prompt), model, max_tokens=gen), len(prompt), gen)

    return run, _param_bytes(model)


MLX_ENGINES = {
    "loom native f32": lambda p: loom_engine(p, "float32", "cpu-native"),
    "loom int8-act f32": lambda p: loom_engine(p, "float32", "cpu-native-int8-act"),
    "loom native ckpt": lambda p: loom_engine(p, "checkpoint", "cpu-native"),
    "loom ops f32": lambda p: loom_engine(p, "float32", "cpu-ops"),
    "loom ops ckpt": lambda p: loom_engine(p, "checkpoint", "cpu-ops"),
    "mlx-lm": lambda p: mlx_lm_engine(p, None),
    "mlx-lm f32": lambda p: mlx_lm_engine(p, mx.float32),
}


class BandwidthProbe:
    """Read bandwidth, measured on demand: the median of 5 passes summing 1 GB,
    split over ``threads`` threads (the engines read their weights with that
    many threads; one thread alone reads ~35 % less here). The buffer is
    allocated once."""

    def __init__(self, threads: int) -> None:
        self.buffer = np.ones(1 << 28, dtype=np.float32)
        self.parts = np.array_split(self.buffer, threads)

    def read_gbs(self) -> float:
        times = []
        for _ in range(5):
            workers = [threading.Thread(target=part.sum) for part in self.parts]
            start = time.perf_counter()
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            times.append(time.perf_counter() - start)
        return self.buffer.nbytes / statistics.median(times) / 1e9


def decode_bytes(path: Path) -> int:
    """Bytes of weights one decode step reads: all but the (untied) embedding table."""
    manifest = read_manifest(path)
    config = json.loads((path / "config.json").read_text())
    total = 0
    for name, info in manifest.items():
        if name.startswith("model.embed_tokens.") and not config.get("tie_word_embeddings"):
            continue
        total += info.nbytes
    return total


def _sample(engine: Engine, prompt: list[int], gen: int, probe: BandwidthProbe) -> None:
    gc.collect()
    mx.clear_cache()
    engine.read_gbs.append(probe.read_gbs())
    start = time.perf_counter()
    p, d = engine.run(prompt, gen)
    engine.spent += time.perf_counter() - start
    engine.prefill.append(p)
    engine.decode.append(d)
    # A runner in another process reports its own peak (llama.cpp: peak RSS).
    engine.peak_gb = max(engine.peak_gb, getattr(engine.run, "peak_gb", 0.0))
    print(
        f"  {engine.name:<18} prefill {p:8.1f}  decode {d:7.2f}  "
        f"(read {engine.read_gbs[-1]:.1f} GB/s)",
        flush=True,
    )


def _unload(engine: Engine) -> None:
    close = getattr(engine.run, "close", None)
    if close is not None:
        close()
    engine.run = None
    gc.collect()


def measure_row(
    path: Path,
    prompt: list[int],
    gen: int,
    repeats: int,
    budget: float,
    probe: BandwidthProbe,
    *,
    mlx: bool,
    gguf: Path | None,
) -> list[Engine]:
    """Round 1: each MLX engine alone (its peak memory is measured then), then
    llama.cpp; later rounds: all loaded, interleaved with llama.cpp, the order
    reversed each round."""
    engines = []
    if mlx:
        for name, make in MLX_ENGINES.items():
            gc.collect()
            mx.clear_cache()
            mx.reset_peak_memory()
            engine = Engine(name, *make(path))
            engine.run(prompt[:8], 2)  # warm-up: first-call allocation and compilation
            _sample(engine, prompt, gen, probe)
            engine.peak_gb = mx.get_peak_memory() / 1e9
            _unload(engine)  # before the next engine is measured
            engines.append(engine)
    if gguf is not None:
        engines.append(Engine("llama.cpp", _llama_cpp_runner(gguf, prompt, gen), 0))
        _sample(engines[-1], prompt, gen, probe)
    if repeats > 1:
        for engine in engines:
            if engine.name in MLX_ENGINES:
                engine.run, _ = MLX_ENGINES[engine.name](path)
        order = list(engines)
        for _ in range(repeats - 1):
            order.reverse()
            for engine in order:
                if engine.spent <= budget:
                    _sample(engine, prompt, gen, probe)
        for engine in engines:
            _unload(engine)
    return engines


def gguf_for(path: Path, bits: int | None, hf_bf16: Path) -> Path | None:
    python = LLAMA_VENV / "bin" / "python"
    if not (LLAMA_VENV / "llama_cpp_source").exists():  # written last by the set-up script
        print("  llama.cpp: not set up (bash benchmarks/setup_llama_cpp.sh)", flush=True)
        return None
    out = CACHE_DIR / f"{path.name}.{'q4_0' if bits else 'bf16'}.gguf"
    if not out.exists():
        subprocess.run(
            [
                str(python),
                str(HERE / "llama_cpp_tool.py"),
                "convert",
                str(hf_bf16),
                str(out),
                "--outtype",
                "q4_0" if bits else "bf16",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    return out


def _llama_cpp_runner(gguf: Path, prompt: list[int], gen: int):
    """A run of llama.cpp in its own process (``run.peak_gb``: the largest peak RSS seen)."""
    python = LLAMA_VENV / "bin" / "python"
    threads = mlx_loom.cpu.native.threads() or 2

    def run(prompt_ids, n):
        done = subprocess.run(
            [
                str(python),
                str(HERE / "llama_cpp_tool.py"),
                "run",
                str(gguf),
                "--prompt",
                ",".join(map(str, prompt_ids)),
                "--gen",
                str(n),
                "--threads",
                str(threads),
                "--repeats",
                "1",
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        result = json.loads(done.stdout.strip().splitlines()[-1])
        run.peak_gb = max(run.peak_gb, result["peak_gb"])
        return result["runs"][0]

    run.peak_gb = 0.0
    return run


def bf16_source(row: Row) -> Path:
    """The bf16 checkpoint a row's weights come from (the row itself, or its 4-bit source)."""
    if row.bits is None:
        return build(row)
    return build(Row(row.name.replace("-q4", "-bf16"), row.family, row.config, "BF16"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", help="comma-separated row names (default: all)")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget", type=float, default=90.0, help="seconds per engine per row")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument(
        "--engines",
        choices=["all", "mlx", "llama.cpp"],
        default="all",
        help="run only the MLX engines or only llama.cpp (then combine with --table)",
    )
    parser.add_argument("--table", nargs="+", metavar="JSON", help="print the table of runs")
    parser.add_argument(
        "--bandwidth",
        type=float,
        help="with --table: GB/s to take as the read-bandwidth limit (default: as measured)",
    )
    args = parser.parse_args(argv)
    faulthandler.enable()
    table = rows()
    if args.list:
        print("\n".join(r.name for r in table))
        return 0
    if args.table:
        results = [entry for f in args.table for entry in json.loads(Path(f).read_text())]
        if args.bandwidth:
            for r in results:
                limit = args.bandwidth * 1e9 / decode_bytes(CACHE_DIR / r["row"])
                r["bandwidth_pct"] = 100 * r["decode_tps"] / limit
        print_table(results)
        return 0
    if args.rows:
        wanted = set(args.rows.split(","))
        table = [r for r in table if r.name in wanted]
    threads = mlx_loom.cpu.native.threads() or 2
    probe = BandwidthProbe(threads)
    print(f"mlx {mx.__version__}; bandwidth read on {threads} threads before every run", flush=True)
    results = []
    for row in table:
        path = build(row)
        small = row.config["hidden_size"] < 512
        prompt_len, gen = (128, 64) if small else (32, 16)
        prompt = mx.random.randint(
            0, row.config["vocab_size"], (prompt_len,), key=mx.random.key(1)
        ).tolist()
        print(f"{row.name}: prompt {prompt_len}, decode {gen}", flush=True)
        gguf = gguf_for(path, row.bits, bf16_source(row)) if args.engines != "mlx" else None
        engines = measure_row(
            path,
            prompt,
            gen,
            args.repeats,
            args.budget,
            probe,
            mlx=args.engines in ("all", "mlx"),
            gguf=gguf,
        )
        step_bytes = decode_bytes(path)
        for e in engines:
            runs = zip(e.decode, e.read_gbs, strict=True)
            pct = [100 * d * step_bytes / (bw * 1e9) for d, bw in runs]
            entry = {
                "row": row.name,
                "engine": e.name,
                "runs": len(e.decode),
                "prefill_tps": statistics.median(e.prefill),
                "decode_tps": statistics.median(e.decode),
                "peak_gb": e.peak_gb,
                "read_gbs": statistics.median(e.read_gbs),
                "bandwidth_pct": statistics.median(pct),
            }
            results.append(entry)
        gc.collect()
        mx.clear_cache()
    print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


def print_table(results: list[dict]) -> None:
    print(
        "| row | engine | prefill tok/s | decode tok/s | peak GB | read GB/s | "
        "% of bandwidth limit | decode vs mlx-lm |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    base = {r["row"]: r["decode_tps"] for r in results if r["engine"] == "mlx-lm"}
    order = {name: i for i, name in enumerate([*MLX_ENGINES, "llama.cpp"])}
    rows_seen = list(dict.fromkeys(r["row"] for r in results))
    results = sorted(results, key=lambda r: (rows_seen.index(r["row"]), order[r["engine"]]))
    for r in results:
        ratio = r["decode_tps"] / base[r["row"]] if base.get(r["row"]) else float("nan")
        print(
            f"| {r['row']} | {r['engine']} | {r['prefill_tps']:.1f} | {r['decode_tps']:.2f} | "
            f"{r['peak_gb']:.3f} | {r.get('read_gbs', float('nan')):.1f} | "
            f"{r['bandwidth_pct']:.0f} % | {ratio:.2f}x |"
        )


if __name__ == "__main__":
    sys.exit(main())
