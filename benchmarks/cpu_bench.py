"""CPU speed side by side: mlx-loom on each CPU path, mlx-lm, and llama.cpp, same weights.

Run by hand (not a test), ideally on a quiet machine (check ``uptime``)::

    bash benchmarks/setup_llama_cpp.sh        # once, ~16 min: llama.cpp in its own venv
    .venv/bin/python benchmarks/cpu_bench.py  # every row; see --help (--rows, --prompts, ...)
    .venv/bin/python benchmarks/cpu_bench.py --quick   # tiny shapes, seconds: checks the harness

Rows are checkpoints with random weights of realistic shape, written locally
in Hugging Face layout from each family plugin's tensor manifest (no
download): Llama (a tiny one of ~7M parameters and one of ~350M, 313M
weights read per decode token, each in bf16 and in 4 bits), and in 4 bits a
Qwen3-Next-shaped hybrid MoE, a Gemma-4-shaped model, Qwen3 (0.6B's shape),
a Qwen3-MoE, Gemma 3 and Mistral, each cut to a few hundred million
parameters with a 32000-token vocabulary. 4-bit rows are mlx-lm's
conversion of the bf16 weights (group 64, bf16 scales), as mlx-community
ships them. llama.cpp runs GGUF files converted from the same bf16 weights
by llama.cpp's own converter: BF16, and Q4_0 for the 4-bit rows (4.5 bits
per weight, as MLX's 4-bit group-64 packing with bf16 scales and biases).
A family llama.cpp's converter does not know has no llama.cpp engine; the
run says so on that row.

Every row runs at each prompt length of ``--prompts`` (32, 512 and 2048
tokens), then a greedy decode of ``--gen`` tokens.

Engines, for each row:

* ``loom native f32`` — the default: float32 compute, cpu-native kernels;
* ``loom int8-act f32`` — float32 compute, cpu-native-int8-act kernels;
* ``loom native ckpt`` — cpu-native kernels, the checkpoint's dtype;
* ``loom ops f32`` / ``loom ops ckpt`` — MLX operations (the latter is mlx-lm's arithmetic);
* ``mlx-lm`` — as it loads the checkpoint; ``mlx-lm f32`` — after ``set_dtype(float32)``;
* ``llama.cpp 1t`` and ``llama.cpp Nt`` — llama-cpp-python on one thread and on
  the N threads the MLX engines use. Both are run because on a busy 2-core
  machine a 2-thread llama.cpp run can collapse (one thread waits on the
  other's core at every barrier) while one thread does not; the peer each
  ratio is taken against is the better of the two in the same round.

Method: round 0 runs each MLX engine with only its model loaded (its peak
memory is MLX's peak over loading and that run), then llama.cpp; later
rounds load all the MLX engines in this process and run every engine once,
interleaved, the order reversed each round. llama.cpp runs in its own
process (same prompt), its peak memory is that process's peak RSS. An
engine that has spent its ``--budget`` stops taking rounds (it always runs
round 0). Each engine's prefill and decode speeds are printed as min /
median / max over its runs; ratios are computed per round (engine against
peer, same round, so the machine's load at that moment is shared) and
printed as min / median / max of those per-round ratios.

The bandwidth limit is the read bandwidth (numpy sums over 1 GB, split
over as many threads as the engine uses) divided by the bytes of weights a
decode step reads (every stored tensor except the embedding table, of
which it reads one row; for a mixture of experts this counts every expert
though a token reads only its top-k, so there the percentage overstates and
can pass 100 %). On a shared machine that bandwidth moves
with the neighbours' load, so it is read right before every run and
printed with the run; an engine's "% of bandwidth limit" is the median
over its runs of that run's decode speed against the reading before it.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np
from bench import CACHE_DIR, Row, _greedy, _loop_speed, build, llama

import mlx_loom
from mlx_loom.artifacts import read_manifest
from mlx_loom.generation.loop import generate_tokens

HERE = Path(__file__).resolve().parent
# Where benchmarks/setup_llama_cpp.sh put llama.cpp (its LLAMA_VENV, read here too).
LLAMA_VENV = Path(os.environ.get("LLAMA_VENV", HERE / ".llama-venv"))
PROMPTS = (32, 512, 2048)
QUICK_PROMPTS = (8, 24)
# The families whose tiny plugin configs make the --quick rows.
QUICK_FAMILIES = (
    "llama",
    "qwen3_next",
    "gemma4_text",
    "qwen3",
    "qwen3_moe",
    "gemma3_text",
    "mistral",
)
QUICK_ENGINES = ("loom native f32", "mlx-lm")


def _family(model_type: str, **shape) -> dict:
    """The plugin's tiny config for ``model_type`` with ``shape`` laid over it:
    the keys the tiny config carries that a row does not set stay as the plugin
    tests them (so the config is one the family's loader accepts)."""
    claim = mlx_loom.default_host().registry.model_types[model_type]
    assert claim.tiny_config is not None, model_type
    return {**claim.tiny_config, **shape}


def family_shapes() -> dict[str, dict]:
    """Configs for the other families, shaped like their published checkpoints
    (head sizes, ratios, layer patterns, expert counts) and cut to a few
    hundred million parameters with a 32000-token vocabulary."""
    return {
        # Qwen3-Next: the shape of benchmarks/moe_cpu_native.py (~0.4B, 32 experts, top 4).
        "qwen3_next": _family(
            "qwen3_next",
            hidden_size=1024,
            num_hidden_layers=8,
            intermediate_size=2048,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=128,
            linear_num_value_heads=16,
            linear_num_key_heads=8,
            linear_key_head_dim=64,
            linear_value_head_dim=64,
            num_experts=32,
            num_experts_per_tok=4,
            shared_expert_intermediate_size=512,
            mlp_only_layers=[],
            moe_intermediate_size=384,
            vocab_size=32000,
            full_attention_interval=4,
        ),
        # Gemma 4: sliding and full attention 4:1, a wider global head, per-layer
        # inputs, shared KV in the last 5 layers, a routed-expert block.
        "gemma4_text": _family(
            "gemma4_text",
            architectures=["Gemma4ForCausalLM"],  # how llama.cpp's converter knows it
            hidden_size=1024,
            num_hidden_layers=10,
            intermediate_size=2048,
            num_attention_heads=8,
            head_dim=128,
            global_head_dim=256,
            num_key_value_heads=2,
            vocab_size=32000,
            vocab_size_per_layer_input=32000,
            hidden_size_per_layer_input=128,
            sliding_window=512,
            layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 2,
            # The unshared layers end on a full-attention layer, as in Gemma 4's
            # checkpoints (llama.cpp picks the donors by that rule).
            num_kv_shared_layers=5,
            num_experts=16,
            top_k_experts=4,
            moe_intermediate_size=384,
        ),
        # Qwen3-0.6B's shape with a smaller vocabulary (tied embeddings).
        "qwen3": _family(
            "qwen3",
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=32000,
            max_position_embeddings=4096,
        ),
        # Qwen3-MoE (30B-A3B's ratios: 128 experts top 8 -> 32 top 4 here).
        "qwen3_moe": _family(
            "qwen3_moe",
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=12,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=64,
            num_experts=32,
            num_experts_per_tok=4,
            moe_intermediate_size=384,
            mlp_only_layers=[],
            vocab_size=32000,
            max_position_embeddings=4096,
        ),
        # Gemma 3 (1B's heads: 4 query, 1 KV, head 256; 5 sliding : 1 global).
        "gemma3_text": _family(
            "gemma3_text",
            architectures=["Gemma3ForCausalLM"],
            hidden_size=1152,
            intermediate_size=6912,
            num_hidden_layers=12,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            query_pre_attn_scalar=256,
            vocab_size=32000,
            sliding_window=512,
            sliding_window_pattern=6,
        ),
        # Mistral (7B's ratios, 350M's size like the Llama row).
        "mistral": _family(
            "mistral",
            hidden_size=1024,
            intermediate_size=2816,
            num_hidden_layers=24,
            num_attention_heads=16,
            num_key_value_heads=8,
            vocab_size=32000,
            sliding_window=4096,
            max_position_embeddings=4096,
        ),
    }


ROW_NAMES = {
    "qwen3_next": "qwen3-next-400m",
    "gemma4_text": "gemma4-400m",
    "qwen3": "qwen3-0.6b",
    "qwen3_moe": "qwen3-moe-550m",
    "gemma3_text": "gemma3-350m",
    "mistral": "mistral-350m",
}


def rows() -> list[Row]:
    tiny = llama(256, 4, 8, 2, 688, 8192)
    mid = llama(1024, 24, 16, 8, 2816, 32000)  # ~346M parameters, 313M read per token
    out = [
        Row("llama-tiny-bf16", "llama", tiny, "BF16"),
        Row("llama-tiny-q4", "llama", tiny, "BF16", bits=4),
        Row("llama-350m-bf16", "llama", mid, "BF16"),
        Row("llama-350m-q4", "llama", mid, "BF16", bits=4),
    ]
    for model_type, config in family_shapes().items():
        out.append(Row(f"{ROW_NAMES[model_type]}-q4", model_type, config, "BF16", bits=4))
    return out


def quick_rows() -> list[Row]:
    """The plugins' own tiny configs (vocabulary 256, hidden 64), float32 (MLX's
    CPU ``gather_mm``, which mlx-lm's experts use, is float32-only), for a run
    of seconds that exercises the harness, not the machine."""
    registry = mlx_loom.default_host().registry
    return [
        Row(f"quick-{t}", t, dict(registry.model_types[t].tiny_config or {}), "F32")
        for t in QUICK_FAMILIES
        if t in registry.model_types
    ]


Runner = Callable[[list[int], int], tuple[float, float]]


@dataclass
class Engine:
    name: str
    run: Runner | None
    threads: int
    # One entry per round the engine ran: round -> (prefill tok/s, decode tok/s, read GB/s).
    samples: dict[int, tuple[float, float, float]] = field(default_factory=dict)
    peak_gb: float = 0.0
    spent: float = 0.0


def loom_engine(
    path: Path, compute_dtype: str, cpu_kernels: str, kv_dtype: str | None = None
) -> Runner:
    model, _ = mlx_loom.load(
        path, compute_dtype=compute_dtype, cpu_kernels=cpu_kernels, kv_dtype=kv_dtype
    )

    def run(prompt, gen):
        tokens = generate_tokens(model, prompt, model.make_cache(), sampler=_greedy, max_tokens=gen)
        return _loop_speed(tokens, len(prompt), gen)

    # The model's engine thread keeps the model alive until it is closed: without
    # this an unloaded engine's weights would count in the next engine's peak.
    run.close = lambda: model.engine.close()  # type: ignore[attr-defined]
    return run


def mlx_lm_engine(path: Path, dtype) -> Runner:
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    model, _ = load_model(path)
    if dtype is not None:
        model.set_dtype(dtype)
    mx.eval(model.parameters())

    def run(prompt, gen):
        return _loop_speed(generate_step(mx.array(prompt), model, max_tokens=gen), len(prompt), gen)

    return run


MLX_ENGINES: dict[str, Callable[[Path], Runner]] = {
    "loom native f32": lambda p: loom_engine(p, "float32", "cpu-native"),
    "loom int8-act f32": lambda p: loom_engine(p, "float32", "cpu-native-int8-act"),
    # llama.cpp's own KV precision: a long context's decode reads the cache
    # every token, and float32 keys and values are twice its bytes.
    "loom int8-act f32 kv16": lambda p: loom_engine(
        p, "float32", "cpu-native-int8-act", kv_dtype="float16"
    ),
    "loom native f32 kv16": lambda p: loom_engine(p, "float32", "cpu-native", kv_dtype="float16"),
    "loom native ckpt": lambda p: loom_engine(p, "checkpoint", "cpu-native"),
    "loom ops f32": lambda p: loom_engine(p, "float32", "cpu-ops"),
    "loom ops ckpt": lambda p: loom_engine(p, "checkpoint", "cpu-ops"),
    "mlx-lm": lambda p: mlx_lm_engine(p, None),
    "mlx-lm f32": lambda p: mlx_lm_engine(p, mx.float32),
}


class BandwidthProbe:
    """Read bandwidth, measured on demand: the median of 5 passes summing 1 GB
    (``--quick``: 64 MB, which caches may hold; its reading checks the harness,
    not the memory), split over as many threads as the engine about to run
    reads its weights with (one thread alone reads ~35 % less here). The
    buffer is allocated once."""

    def __init__(self, nbytes: int = 1 << 30) -> None:
        self.buffer = np.ones(nbytes // 4, dtype=np.float32)

    def read_gbs(self, threads: int) -> float:
        parts = np.array_split(self.buffer, threads)
        times = []
        for _ in range(5):
            workers = [threading.Thread(target=part.sum) for part in parts]
            start = time.perf_counter()
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            times.append(time.perf_counter() - start)
        return self.buffer.nbytes / statistics.median(times) / 1e9


def decode_bytes(path: Path) -> int:
    """Bytes of weights one decode step reads: every stored tensor but the
    embedding tables, of which it reads a row each (Gemma 4's per-layer table
    too), unless the checkpoint has no ``lm_head`` and the embedding is the head."""
    manifest = read_manifest(path)
    tied = not any("lm_head" in name for name in manifest)
    total = 0
    for name, info in manifest.items():
        head = tied and "embed_tokens." in name and "per_layer" not in name
        if "embed_tokens" in name and not head:
            continue
        total += info.nbytes
    return total


def _sample(
    engine: Engine, round_: int, prompt: list[int], gen: int, probe: BandwidthProbe
) -> None:
    assert engine.run is not None
    gc.collect()
    mx.clear_cache()
    read = probe.read_gbs(engine.threads)
    start = time.perf_counter()
    p, d = engine.run(prompt, gen)
    engine.spent += time.perf_counter() - start
    engine.samples[round_] = (p, d, read)
    # A runner in another process reports its own peak (llama.cpp: peak RSS).
    engine.peak_gb = max(engine.peak_gb, getattr(engine.run, "peak_gb", 0.0))
    print(
        f"  round {round_} {engine.name:<18} prefill {p:9.1f}  decode {d:8.2f}  "
        f"(read {read:.1f} GB/s on {engine.threads} thread{'s' if engine.threads > 1 else ''})",
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
    mlx_engines: list[str],
    llama_cpp: dict[str, Runner],
    threads: int,
) -> list[Engine]:
    """Round 0: each MLX engine alone (its peak memory is measured then), then
    each llama.cpp mode; later rounds: all loaded, every engine once,
    interleaved, the order reversed each round."""
    engines = []
    for name in mlx_engines:
        gc.collect()
        mx.clear_cache()
        mx.reset_peak_memory()
        engine = Engine(name, None, threads)
        try:
            engine.run = MLX_ENGINES[name](path)
            engine.run(prompt[:8], 2)  # warm-up: first-call allocation and compilation
            _sample(engine, 0, prompt, gen, probe)
        except Exception as error:  # an engine that cannot run this row is reported, not fatal
            print(f"  {name}: cannot run this row ({type(error).__name__}: {error})", flush=True)
            _unload(engine)
            continue
        engine.peak_gb = mx.get_peak_memory() / 1e9
        _unload(engine)  # before the next engine is measured
        engines.append(engine)
    for name, runner in llama_cpp.items():
        engines.append(Engine(name, runner, getattr(runner, "threads", threads)))
        _sample(engines[-1], 0, prompt, gen, probe)
    if repeats > 1:
        for engine in engines:
            if engine.name in MLX_ENGINES:
                engine.run = MLX_ENGINES[engine.name](path)
                engine.run(prompt[:8], 2)
        order = list(engines)
        for round_ in range(1, repeats):
            order.reverse()
            for engine in order:
                if engine.spent <= budget:
                    _sample(engine, round_, prompt, gen, probe)
        for engine in engines:
            _unload(engine)
    return engines


def _is_llama_cpp(name: str) -> bool:
    return name.startswith("llama.cpp")


def llama_cpp_ready() -> bool:
    return (LLAMA_VENV / "llama_cpp_source").exists()  # written last by the set-up script


def gguf_for(path: Path, bits: int | None, hf_bf16: Path, root: Path) -> Path | None:
    """The row's GGUF (converted once), or None where llama.cpp's converter
    does not take the family (the reason is printed)."""
    python = LLAMA_VENV / "bin" / "python"
    out = root / f"{path.name}.{'q4_0' if bits else 'bf16'}.gguf"
    if not out.exists():
        done = subprocess.run(
            [
                str(python),
                str(HERE / "llama_cpp_tool.py"),
                "convert",
                str(hf_bf16),
                str(out),
                "--outtype",
                "q4_0" if bits else "bf16",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["?"])[-1]
            print(f"  llama.cpp: cannot convert this row ({last}); no llama.cpp peer", flush=True)
            return None
    return out


def _llama_cpp_runner(gguf: Path, threads: int) -> Runner:
    """A run of llama.cpp on ``threads`` threads in its own process
    (``run.peak_gb``: the largest peak RSS seen)."""
    python = LLAMA_VENV / "bin" / "python"

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
        run.peak_gb = max(run.peak_gb, result["peak_gb"])  # type: ignore[attr-defined]
        return tuple(result["runs"][0])

    run.peak_gb = 0.0  # type: ignore[attr-defined]
    run.threads = threads  # type: ignore[attr-defined]
    return run


def bf16_source(row: Row, root: Path) -> Path:
    """The bf16 checkpoint a row's weights come from (the row itself, or its 4-bit source)."""
    if row.bits is None:
        return build(row, root)
    return build(Row(row.name.replace("-q4", "-bf16"), row.family, row.config, "BF16"), root)


def _spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def summarize(row: str, prompt_len: int, engines: list[Engine], step_bytes: int) -> list[dict]:
    """One entry per engine: min / median / max speeds, every run's bandwidth
    reading, and for mlx-loom's engines the per-round ratios against each peer
    (mlx-lm in each dtype it ran, llama.cpp's better thread mode) in the same round."""
    peers: dict[str, dict[int, tuple[float, float]]] = {}
    cpp = [e for e in engines if _is_llama_cpp(e.name)]
    if cpp:
        best: dict[int, tuple[float, float]] = {}
        for e in cpp:
            for r, (p, d, _) in e.samples.items():
                old = best.get(r, (0.0, 0.0))
                best[r] = (max(old[0], p), max(old[1], d))
        peers["llama.cpp best of " + "/".join(e.name.split()[-1] for e in cpp)] = best
    for e in engines:
        if e.name.startswith("mlx-lm"):
            peers[e.name] = {r: (p, d) for r, (p, d, _) in e.samples.items()}
    out = []
    for e in engines:
        runs = sorted(e.samples.items())
        pct = [100 * d * step_bytes / (bw * 1e9) for _, (_, d, bw) in runs]
        entry: dict = {
            "row": row,
            "prompt": prompt_len,
            "engine": e.name,
            "threads": e.threads,
            "runs": len(runs),
            "prefill_tps": _spread([p for _, (p, _, _) in runs]),
            "decode_tps": _spread([d for _, (_, d, _) in runs]),
            "read_gbs": [bw for _, (_, _, bw) in runs],
            "bandwidth_pct": statistics.median(pct),
            "peak_gb": e.peak_gb,
            "vs": {},
        }
        for peer, by_round in peers.items():
            if not e.name.startswith("loom"):  # ratios of mlx-loom's engines only
                continue
            both = [r for r in e.samples if r in by_round]
            if not both:
                continue
            entry["vs"][peer] = {
                "rounds": len(both),
                "prefill": _spread([e.samples[r][0] / by_round[r][0] for r in both]),
                "decode": _spread([e.samples[r][1] / by_round[r][1] for r in both]),
            }
        out.append(entry)
    return out


def _mmm(s: dict[str, float], fmt: str) -> str:
    return f"{s['min']:{fmt}} / {s['median']:{fmt}} / {s['max']:{fmt}}"


def print_table(results: list[dict]) -> None:
    print()
    print(
        "| row | prompt | engine | runs | prefill tok/s min / median / max | "
        "decode tok/s min / median / max | peak GB | read GB/s per run | % of bandwidth limit |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---|---:|")
    for r in results:
        reads = ", ".join(f"{x:.1f}" for x in r["read_gbs"])
        print(
            f"| {r['row']} | {r['prompt']} | {r['engine']} | {r['runs']} | "
            f"{_mmm(r['prefill_tps'], '.1f')} | {_mmm(r['decode_tps'], '.2f')} | "
            f"{r['peak_gb']:.3f} | {reads} | {r['bandwidth_pct']:.0f} % |"
        )
    print()
    print("Ratios per round (engine / peer, same round), min / median / max:")
    print()
    print("| row | prompt | engine | peer | rounds | decode ratio | prefill ratio |")
    print("|---|---:|---|---|---:|---:|---:|")
    for r in results:
        for peer, v in r["vs"].items():
            print(
                f"| {r['row']} | {r['prompt']} | {r['engine']} | {peer} | {v['rounds']} | "
                f"{_mmm(v['decode'], '.2f')} | {_mmm(v['prefill'], '.2f')} |"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rows", help="comma-separated row names (default: all)")
    parser.add_argument("--list", action="store_true", help="print the row names")
    parser.add_argument(
        "--prompts",
        help=f"comma-separated prompt lengths (default: {','.join(map(str, PROMPTS))})",
    )
    parser.add_argument("--gen", type=int, help="decode tokens (default: 64 tiny rows, 16 others)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds, round 0 included")
    parser.add_argument("--budget", type=float, default=90.0, help="seconds per engine per row")
    parser.add_argument(
        "--engines",
        default="all",
        help="'all', 'mlx', 'llama.cpp', or comma-separated engine names (MLX engines, and "
        "'llama.cpp' for both of its thread modes)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the families' tiny models, short prompts, two engines: checks the harness in seconds",
    )
    parser.add_argument(
        "--cache", type=Path, help=f"checkpoint directory (default: benchmarks/{CACHE_DIR.name})"
    )
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    faulthandler.enable()
    table = quick_rows() if args.quick else rows()
    if args.list:
        print("\n".join(r.name for r in table))
        return 0
    if args.rows:
        wanted = set(args.rows.split(","))
        unknown = wanted - {r.name for r in table}
        if unknown:
            parser.error(f"unknown rows {sorted(unknown)}; see --list")
        table = [r for r in table if r.name in wanted]
    if args.engines in ("all", "mlx", "llama.cpp"):
        mlx_engines = [] if args.engines == "llama.cpp" else list(MLX_ENGINES)
        if args.quick and args.engines == "all":
            mlx_engines = list(QUICK_ENGINES)
        want_cpp = args.engines in ("all", "llama.cpp")
    else:
        names = args.engines.split(",")
        want_cpp = "llama.cpp" in names
        mlx_engines = [n for n in names if n != "llama.cpp"]
        unknown = set(mlx_engines) - set(MLX_ENGINES)
        if unknown:
            parser.error(f"unknown engines {sorted(unknown)}; choose from {list(MLX_ENGINES)}")
    prompts = (
        [int(x) for x in args.prompts.split(",")]
        if args.prompts
        else list(QUICK_PROMPTS if args.quick else PROMPTS)
    )
    root = args.cache or CACHE_DIR
    threads = mlx_loom.cpu.native.threads() or 2
    probe = BandwidthProbe(1 << 26 if args.quick else 1 << 30)
    print(f"mlx {mx.__version__}; {threads} threads; bandwidth read before every run", flush=True)
    if want_cpp and not llama_cpp_ready():
        print(
            "llama.cpp: not set up (bash benchmarks/setup_llama_cpp.sh); no llama.cpp peer",
            flush=True,
        )
        want_cpp = False
    results: list[dict] = []
    for row in table:
        path = build(row, root)
        step_bytes = decode_bytes(path)
        cpp: dict[str, Runner] = {}
        if want_cpp:
            gguf = gguf_for(path, row.bits, bf16_source(row, root), root)
            if gguf is not None:
                cpp = {f"llama.cpp {t}t": _llama_cpp_runner(gguf, t) for t in sorted({1, threads})}
        small = row.config.get("hidden_size", 0) < 512
        gen = args.gen or (4 if args.quick else 64 if small else 16)
        vocab = row.config.get("vocab_size") or row.config["text_config"]["vocab_size"]
        for prompt_len in prompts:
            ids = mx.random.randint(0, vocab, (prompt_len,), key=mx.random.key(1))
            prompt = [int(t) for t in np.array(ids)]
            print(f"{row.name}: prompt {prompt_len}, decode {gen}", flush=True)
            engines = measure_row(
                path,
                prompt,
                gen,
                args.repeats,
                args.budget,
                probe,
                mlx_engines=mlx_engines,
                llama_cpp=cpp,
                threads=threads,
            )
            results += summarize(row.name, prompt_len, engines, step_bytes)
            gc.collect()
            mx.clear_cache()
    print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
