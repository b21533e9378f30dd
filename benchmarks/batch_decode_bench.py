"""Batched decode in the engine: aggregate tokens/s at 1, 4, 8 and 16 rows, and where a step goes.

Run by hand (not a test)::

    .venv/bin/python benchmarks/batch_decode_bench.py                   # llama-350m q4 and bf16
    .venv/bin/python benchmarks/batch_decode_bench.py --rows llama-100m-q4 --batch 1,16
    .venv/bin/python benchmarks/batch_decode_bench.py --rows qwen3-next-400m-q4,gemma4-400m-q4
    .venv/bin/python benchmarks/batch_decode_bench.py --profile 16      # + a step's split
    .venv/bin/python benchmarks/batch_decode_bench.py --kv-dtype float16  # half the KV bytes

Besides its own Llama rows it takes every 4-bit row of ``cpu_bench.py``
(the Qwen3-Next-, Gemma-4-, Qwen3-, Qwen3-MoE-, Gemma-3- and Mistral-shaped
ones), built the same way, so batching is measured per family and not on
the Llama alone.

The engine (``mlx_loom.engine.Engine``, driven on this thread, no service)
takes ``B`` greedy requests with distinct short prompts and EOS never
stopping them; every row decodes ``--gen`` tokens. The decode rate counts
the tokens produced after every row has its first token (so prefill is not
in it) over the time they took; ``vs 1`` is that rate over the one-row rate
of the same round. Rounds interleave batch sizes and repeat ``--repeats``
times; the table gives min/median/max. On a shared machine the spread is
the first thing to read.

``--profile B`` also runs ``B`` rows under cProfile and prints the
functions that took the most of the engine's steps (cumulative), so the
per-row Python work of the batched step can be told from the products.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import Row, build, llama  # noqa: E402
from cpu_bench import rows as cpu_bench_rows  # noqa: E402

import mlx_loom  # noqa: E402
from mlx_loom.engine import Engine, EngineSettings, make_request  # noqa: E402
from mlx_loom.engine.events import TokenEvent  # noqa: E402
from mlx_loom.engine.params import SamplingParams  # noqa: E402

MID = llama(1024, 24, 16, 8, 2816, 32000)  # the cpu_bench 350M Llama
SMALL = llama(768, 12, 12, 4, 2048, 32000)
ROWS = {
    "llama-350m-q4": Row("llama-350m-q4", "llama", MID, "BF16", bits=4),
    "llama-350m-bf16": Row("llama-350m-bf16", "llama", MID, "BF16"),
    "llama-100m-q4": Row("llama-100m-q4", "llama", SMALL, "BF16", bits=4),
    "llama-100m-bf16": Row("llama-100m-bf16", "llama", SMALL, "BF16"),
}
ROWS.update({row.name: row for row in cpu_bench_rows() if row.bits and row.name not in ROWS})


def prompts(count: int, length: int, vocab: int) -> list[list[int]]:
    return [[(7 + 31 * r + 13 * i) % (vocab - 2) + 1 for i in range(length)] for r in range(count)]


def decode_rate(model, count: int, prompt_len: int, gen: int) -> float:
    """Tokens per second over all rows once every row has its first token."""
    engine = Engine(model, EngineSettings(decode_concurrency=max(count, 1), prompt_cache_size=0))
    greedy = SamplingParams(temperature=0.0)
    requests = [
        make_request(model, None, p, max_tokens=gen, params=greedy, eos=frozenset())
        for p in prompts(count, prompt_len, model.vocab_size)
    ]
    engine.insert(requests)
    first: dict[int, float] = {}
    stamps: list[float] = []
    while engine.has_work:
        events = engine.step()
        now = time.perf_counter()
        for event in events:
            if isinstance(event, TokenEvent):
                first.setdefault(event.uid, now)
                stamps.append(now)
    start = max(first.values())
    after = [t for t in stamps if t > start]
    return len(after) / max(stamps[-1] - start, 1e-9)


def profile(model, count: int, prompt_len: int, gen: int) -> None:
    prof = cProfile.Profile()
    prof.enable()
    decode_rate(model, count, prompt_len, gen)
    prof.disable()
    print(f"\n-- profile, {count} rows (cumulative seconds) --")
    pstats.Stats(prof).sort_stats("cumulative").print_stats(25)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="llama-350m-q4,llama-350m-bf16")
    parser.add_argument("--batch", default="1,4,8,16")
    parser.add_argument("--kernels", default="cpu-native")
    parser.add_argument("--dtype", default="float32", help="compute_dtype")
    parser.add_argument(
        "--kv-dtype", default=None, help="kv_dtype (float16, bfloat16; default: the compute dtype)"
    )
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--gen", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", type=int, default=0)
    args = parser.parse_args()
    sizes = [int(b) for b in args.batch.split(",")]
    names = args.rows.split(",")
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        parser.error(f"unknown row(s) {', '.join(unknown)}; the rows are {', '.join(ROWS)}")
    for name in names:
        path = build(ROWS[name])
        model, _ = mlx_loom.load(
            path, compute_dtype=args.dtype, cpu_kernels=args.kernels, kv_dtype=args.kv_dtype
        )
        decode_rate(model, sizes[-1], args.prompt, 4)  # warm every shape once
        rates: dict[int, list[float]] = {b: [] for b in sizes}
        ratios: dict[int, list[float]] = {b: [] for b in sizes}
        for _ in range(args.repeats):
            round_rates = {b: decode_rate(model, b, args.prompt, args.gen) for b in sizes}
            for b, r in round_rates.items():
                rates[b].append(r)
                if 1 in round_rates:
                    ratios[b].append(r / round_rates[1])
        kv = f", kv {args.kv_dtype}" if args.kv_dtype else ""
        label = f"{name} ({args.kernels}, {args.dtype}{kv})"
        print(f"\n{label}, decode tok/s min/median/max over {args.repeats}")
        for b in sizes:
            r = rates[b]
            vs = f"  vs 1: {statistics.median(ratios[b]):.2f}x" if ratios[b] else ""
            print(f"  {b:2d} rows: {min(r):7.1f} {statistics.median(r):7.1f} {max(r):7.1f}{vs}")
        if args.profile:
            profile(model, args.profile, args.prompt, args.gen)
        model.engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
