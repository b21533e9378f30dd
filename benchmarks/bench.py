"""mlx-loom beside mlx-lm: prefill and decode speed and peak memory, same weights, one process.

Run by hand (not a test)::

    .venv/bin/python benchmarks/bench.py                       # every row
    .venv/bin/python benchmarks/bench.py --rows llama-tiny-bf16,llama-130m-q4
    .venv/bin/python benchmarks/bench.py --list

Each row is a random-weight checkpoint written in Hugging Face layout from the
family plugin's own tensor manifest (``ModelType.checkpoint_tensors``), so the
harness needs no download and works for any installed family. 4-bit rows are
quantized with mlx-lm's converter and saved in MLX's format; both engines
load the same directory.

Both engines run the same loop shape — prefill of a random prompt, then
greedy decode — through their own public token loops (``generate_tokens`` and
mlx-lm's ``generate_step``). Peak memory is measured for each engine with only
its model loaded (one copy of the weights); speed is then measured with both
loaded, warmed up once, and timed ``--repeats`` times interleaved, the
order alternating each round; the best run of each is reported. Ratios are
mlx-loom / mlx-lm: above 1.0 is faster for speed, below 1.0 is leaner for
memory.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

import mlx_loom
from mlx_loom.generation.loop import generate_tokens
from mlx_loom.testing.checkpoints import write_checkpoint

CACHE_DIR = Path(__file__).resolve().parent / ".checkpoints"


@dataclass(frozen=True)
class Row:
    name: str
    family: str  # model type the plugin claims
    config: dict
    dtype: str  # "BF16" or "F32"
    bits: int | None = None  # quantize to this many bits (group 64)


def llama(hidden, layers, heads, kv, inter, vocab) -> dict:
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "intermediate_size": inter,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }


def rows() -> list[Row]:
    tiny = llama(256, 4, 8, 2, 688, 8192)  # ~7M params
    mid = llama(768, 12, 12, 4, 2048, 32000)  # ~130M params
    out = [
        Row("llama-tiny-bf16", "llama", tiny, "BF16"),
        Row("llama-tiny-q4", "llama", tiny, "F32", bits=4),
        Row("llama-130m-bf16", "llama", mid, "BF16"),
        Row("llama-130m-q4", "llama", mid, "F32", bits=4),
    ]
    out += family_rows()
    return out


def family_rows() -> list[Row]:
    """Rows for the other installed families, from their plugins' tiny configs, scaled up."""
    registry = mlx_loom.default_host().registry
    extra = []
    for name, scale in (("qwen3_next", _scale_qwen3_next), ("gemma4_text", _scale_gemma4)):
        claim = registry.model_types.get(name)
        if claim is None or claim.tiny_config is None:
            continue
        config = scale(dict(claim.tiny_config))
        extra.append(Row(f"{name}-small-f32", name, config, "F32"))
        extra.append(Row(f"{name}-small-bf16", name, config, "BF16"))
        extra.append(Row(f"{name}-small-q4", name, config, "F32", bits=4))
    return extra


def _scale_qwen3_next(c: dict) -> dict:
    c.update(hidden_size=512, num_hidden_layers=8, vocab_size=8192)
    return c


def _scale_gemma4(c: dict) -> dict:
    c.update(vocab_size=8192)
    return c


def build(row: Row, root: Path = CACHE_DIR) -> Path:
    """Write (once) the checkpoint for ``row`` under ``root`` and return its directory."""
    path = root / row.name
    if (path / "config.json").exists():
        return path
    registry = mlx_loom.default_host().registry
    claim = registry.model_types[row.family]
    tensors = {
        name: (shape, row.dtype if dtype in ("F32", "BF16", "F16") else dtype)
        for name, (shape, dtype) in claim.checkpoint_tensors(row.config).items()
    }
    if row.bits is None:
        write_checkpoint(path, row.config, tensors, seed=0)
        return path
    source = root / f"{row.name}-source"
    write_checkpoint(source, row.config, tensors, seed=0)
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    model, config = load_model(source)
    model, config = quantize_model(model, config, group_size=64, bits=row.bits)
    save_model(path, model)
    save_config(config, path / "config.json")
    for f in source.glob("tokenizer*"):
        shutil.copy(f, path / f.name)
    shutil.rmtree(source)
    return path


@dataclass
class Measure:
    prefill_tps: float
    decode_tps: float
    peak_gb: float


def _loop_speed(tokens, prompt_len: int, gen: int) -> tuple[float, float]:
    start = time.perf_counter()
    first = None
    n = 0
    for n, _ in enumerate(tokens, start=1):
        if n == 1:
            first = time.perf_counter()
        if n == gen:
            break
    end = time.perf_counter()
    assert first is not None
    return prompt_len / (first - start), (n - 1) / (end - first)


def _greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


def load_loom(path: Path):
    model, _ = mlx_loom.load(path)

    def run(prompt: list[int], gen: int) -> tuple[float, float]:
        tokens = generate_tokens(model, prompt, model.make_cache(), sampler=_greedy, max_tokens=gen)
        return _loop_speed(tokens, len(prompt), gen)

    return run


def load_mlx_lm(path: Path):
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    model, _ = load_model(path)

    def run(prompt: list[int], gen: int) -> tuple[float, float]:
        return _loop_speed(generate_step(mx.array(prompt), model, max_tokens=gen), len(prompt), gen)

    return run


ENGINES = {"loom": load_loom, "mlx-lm": load_mlx_lm}


def _fresh() -> None:
    gc.collect()
    mx.clear_cache()


def peak_memory(load, path: Path, prompt: list[int], gen: int) -> float:
    """Peak GB of one run with only this engine's model loaded."""
    _fresh()
    mx.reset_peak_memory()
    run = load(path)
    run(prompt, gen)
    peak = mx.get_peak_memory() / 1e9
    del run
    _fresh()
    return peak


def measure(path: Path, prompt: list[int], gen: int, repeats: int) -> dict[str, Measure | str]:
    """Peak memory per engine alone, then speed with the engines interleaved.

    Interleaving (A, B, A, B ...) keeps a noisy, shared machine's drift from
    favouring whichever engine happened to run first.
    """
    out: dict[str, Measure | str] = {}
    runners = {}
    peaks = {}
    for name, load in ENGINES.items():
        try:
            peaks[name] = peak_memory(load, path, prompt, gen)
        except Exception as err:  # noqa: BLE001 - a failing engine is a row result
            out[name] = f"{type(err).__name__}: {str(err).splitlines()[0][:60]}"
    for name in peaks:
        runners[name] = ENGINES[name](path)
        runners[name](prompt, gen)  # warm-up
    best = {name: [0.0, 0.0] for name in runners}
    order = list(runners.items())
    for _ in range(repeats):
        order.reverse()  # alternate who goes first: running first after a pause costs
        for name, run in order:
            p, d = run(prompt, gen)
            best[name] = [max(best[name][0], p), max(best[name][1], d)]
    for name in runners:
        out[name] = Measure(best[name][0], best[name][1], peaks[name])
    runners.clear()
    _fresh()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", help="comma-separated row names (default: all)")
    parser.add_argument("--list", action="store_true", help="list the rows and exit")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    faulthandler.enable()  # a crash in a native worker thread should say where
    table = rows()
    if args.list:
        for r in table:
            print(r.name)
        return 0
    if args.rows:
        wanted = set(args.rows.split(","))
        unknown = wanted - {r.name for r in table}
        if unknown:
            parser.error(f"unknown rows: {sorted(unknown)}")
        table = [r for r in table if r.name in wanted]

    header = f"{'row':<24}{'engine':<9}{'prefill tok/s':>14}{'decode tok/s':>14}{'peak GB':>9}"
    print(
        f"prompt {args.prompt_tokens} tokens, {args.gen_tokens} generated, "
        f"best of {args.repeats}; mlx {mx.__version__}, device {mx.default_device()}"
    )
    print(header)
    results = []
    for row in table:
        path = build(row)
        vocab = row.config.get("vocab_size") or row.config["text_config"]["vocab_size"]
        prompt = mx.random.randint(0, vocab, (args.prompt_tokens,), key=mx.random.key(1)).tolist()
        result = measure(path, prompt, args.gen_tokens, args.repeats)
        ours, theirs = result["loom"], result["mlx-lm"]
        for engine, m in (("loom", ours), ("mlx-lm", theirs)):
            if isinstance(m, Measure):
                print(
                    f"{row.name:<24}{engine:<9}{m.prefill_tps:>14.1f}{m.decode_tps:>14.1f}"
                    f"{m.peak_gb:>9.3f}"
                )
            else:
                print(f"{row.name:<24}{engine:<9}  failed: {m}")
        if isinstance(ours, Measure) and isinstance(theirs, Measure):
            print(
                f"{row.name:<24}{'ratio':<9}{ours.prefill_tps / theirs.prefill_tps:>14.2f}"
                f"{ours.decode_tps / theirs.decode_tps:>14.2f}"
                f"{ours.peak_gb / theirs.peak_gb:>9.2f}"
            )
        results.append(
            {
                "row": row.name,
                "loom": ours.__dict__ if isinstance(ours, Measure) else ours,
                "mlx_lm": theirs.__dict__ if isinstance(theirs, Measure) else theirs,
            }
        )
        sys.stdout.flush()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
