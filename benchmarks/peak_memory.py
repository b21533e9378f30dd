"""Peak resident memory of one long prompt: mlx-loom beside llama.cpp, each in its own process.

Run by hand (not a test), after ``bash benchmarks/setup_llama_cpp.sh``::

    .venv/bin/python benchmarks/peak_memory.py                       # llama-350m-q4, 2048 tokens
    .venv/bin/python benchmarks/peak_memory.py --rows llama-350m-q4,gemma4-400m-q4 --prompt 2048

``cpu_bench.py`` reports MLX's allocator peak, which leaves out the
interpreter, the libraries and whatever MLX does not allocate, and it runs
every MLX engine in one process: neither compares with llama.cpp's process
peak. Here every configuration runs in a fresh process that loads the
row's checkpoint, prefills the prompt and decodes 2 tokens, and reports its
own peak resident set (VmHWM) — the same reading llama.cpp's process gives
(``llama_cpp_tool.py run``). Configurations: mlx-loom's defaults on
``cpu-native`` and ``cpu-native-int8-act``, each also with ``--kv-dtype
float16``, and with mlx-lm's 2048-token prefill chunk; llama.cpp on one
thread (its default f16 KV cache and 512-token physical batch).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

CONFIGS: dict[str, dict] = {
    "loom native": {"cpu_kernels": "cpu-native"},
    "loom native, fp16 KV": {"cpu_kernels": "cpu-native", "kv_dtype": "float16"},
    "loom native, 2048 chunk": {"cpu_kernels": "cpu-native", "step": 2048},
    "loom int8-act": {"cpu_kernels": "cpu-native-int8-act"},
    "loom int8-act, fp16 KV": {"cpu_kernels": "cpu-native-int8-act", "kv_dtype": "float16"},
}


def child(path: str, prompt: list[int], options: dict) -> dict:
    """In the measured process: load, prefill, decode 2 tokens, read VmHWM."""
    import mlx.core as mx

    import mlx_loom
    from mlx_loom.generation.loop import generate_tokens

    kv = {"kv_dtype": options["kv_dtype"]} if "kv_dtype" in options else {}
    model, _ = mlx_loom.load(path, cpu_kernels=options["cpu_kernels"], **kv)
    tokens = [
        t
        for t, _ in generate_tokens(
            model,
            prompt,
            sampler=lambda lp: mx.argmax(lp, -1),
            max_tokens=2,
            prefill_step_size=options.get("step"),
        )
    ]
    model.engine.close()
    return {"peak_gb": _vm_hwm_gb(), "tokens": tokens}


def _vm_hwm_gb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / 1e9
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="llama-350m-q4")
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        spec = json.loads(args.child)
        print(json.dumps(child(spec["path"], spec["prompt"], spec["options"])))
        return 0

    import cpu_bench
    from bench import build

    table = {r.name: r for r in cpu_bench.rows()}
    llama_python = cpu_bench.LLAMA_VENV / "bin" / "python"
    print("| row | prompt | configuration | peak RSS GB |\n|---|---:|---|---:|")
    for name in args.rows.split(","):
        row = table[name]
        path = build(row)
        random.seed(0)
        vocab = row.config.get("vocab_size") or row.config["text_config"]["vocab_size"]
        prompt = [random.randrange(10, vocab) for _ in range(args.prompt)]
        for label, options in CONFIGS.items():
            spec = json.dumps({"path": str(path), "prompt": prompt, "options": options})
            done = subprocess.run(
                [sys.executable, __file__, "--child", spec],
                capture_output=True,
                text=True,
                check=True,
                env={**os.environ},
            )
            result = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"| {name} | {args.prompt} | {label} | {result['peak_gb']:.3f} |", flush=True)
        if cpu_bench.llama_cpp_ready():
            gguf = cpu_bench.gguf_for(path, row.bits, cpu_bench.bf16_source(row, path.parent), path.parent)
            if gguf is not None:
                done = subprocess.run(
                    [
                        str(llama_python),
                        str(HERE / "llama_cpp_tool.py"),
                        "run",
                        str(gguf),
                        "--prompt",
                        ",".join(map(str, prompt)),
                        "--gen",
                        "2",
                        "--threads",
                        "1",
                        "--repeats",
                        "1",
                    ],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                peak = json.loads(done.stdout.strip().splitlines()[-1])["peak_gb"]
                print(f"| {name} | {args.prompt} | llama.cpp 1t | {peak:.3f} |", flush=True)
        else:
            print(f"| {name} | {args.prompt} | llama.cpp | not set up |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
