"""Decode speed with LoRA/DoRA adapters: one adapter per model, and several per batch.

Run by hand (not a test)::

    .venv/bin/python benchmarks/adapter_bench.py              # ~70M-parameter bf16 Llama
    .venv/bin/python benchmarks/adapter_bench.py --layers 2   # smaller

A random-weight Llama (the convert benchmark's) and two random rank-8
adapters in mlx-lm's format (LoRA and DoRA on every linear layer) are written
once. Measured, each after a warm-up run:

* one stream: the base model, and the model loaded with one adapter
  (``adapter_path``), in mlx-loom and in mlx-lm (``generation_tps`` of the
  last response);
* four streams batched on mlx-loom's engine (``batch_generate``): all on the
  base model, and the same four with adapters ``lora, None, dora, lora``
  registered as one :class:`~mlx_loom.adapters.AdapterSet` (tokens per second
  of the whole batch), and with ``lora, None, lora, None``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx
from convert_memory import CACHE_DIR, write_source
from mlx.utils import tree_flatten

PROMPT = "the quick brown fox jumps over the lazy dog " * 4


def write_adapter(base: Path, out: Path, *, dora: bool, seed: int) -> Path:
    """A rank-8 adapter on every linear layer, with random factors, in mlx-lm's format."""
    if (out / "adapters.safetensors").exists():
        return out
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load_model

    model, _ = load_model(base)
    model.freeze()
    params = {"rank": 8, "scale": 2.0, "dropout": 0.0}
    linear_to_lora_layers(model, -1, params, use_dora=dora)
    key = mx.random.key(seed)
    weights = {}
    for name, value in tree_flatten(model.trainable_parameters()):
        key, sub = mx.random.split(key)
        if name.endswith(".lora_b"):
            value = 0.01 * mx.random.normal(value.shape, key=sub)
        weights[name] = value.astype(mx.float32)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    config = {
        "fine_tune_type": "dora" if dora else "lora",
        "num_layers": -1,
        "lora_parameters": params,
    }
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def loom_stream(path: Path, adapter: Path | None, tokens: int) -> float:
    import mlx_loom

    model, tokenizer = mlx_loom.load(path, adapter_path=adapter)
    last = None
    for _ in range(2):  # the first run warms up
        *_, last = mlx_loom.stream_generate(model, tokenizer, PROMPT, max_tokens=tokens)
    return last.generation_tps


def mlx_lm_stream(path: Path, adapter: Path | None, tokens: int) -> float:
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(path), adapter_path=str(adapter) if adapter else None)
    last = None
    for _ in range(2):
        *_, last = mlx_lm.stream_generate(model, tokenizer, PROMPT, max_tokens=tokens)
    return last.generation_tps


def loom_batch(
    path: Path, adapters: dict[str, Path] | None, names: list[str | None] | None, tokens: int
) -> float:
    import mlx_loom
    from mlx_loom.adapters import AdapterSet

    model, tokenizer = mlx_loom.load(path)
    if adapters is not None:
        AdapterSet(model, adapters)
    prompts = [PROMPT + str(i) for i in range(4)]
    eos = {t: -100.0 for t in tokenizer.eos_token_ids}
    seconds = 0.0
    for _ in range(2):
        started = time.perf_counter()
        out = mlx_loom.batch_generate(
            model, tokenizer, prompts, max_tokens=tokens, adapters=names, logit_bias=eos
        )
        seconds = time.perf_counter() - started
    return out.stats.generation_tokens / seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--inter", type=int, default=2816)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args(argv)
    where = CACHE_DIR / f"adapter-llama-{args.layers}x{args.hidden}"
    base = write_source(
        where / "base", layers=args.layers, hidden=args.hidden, inter=args.inter, vocab=args.vocab
    )
    lora = write_adapter(base, where / "lora", dora=False, seed=1)
    dora = write_adapter(base, where / "dora", dora=True, seed=2)
    both = {"lora": lora, "dora": dora}
    rows = [
        ("one stream, base model", loom_stream(base, None, args.tokens),
         mlx_lm_stream(base, None, args.tokens)),
        ("one stream, LoRA (adapter_path)", loom_stream(base, lora, args.tokens),
         mlx_lm_stream(base, lora, args.tokens)),
        ("one stream, DoRA (adapter_path)", loom_stream(base, dora, args.tokens),
         mlx_lm_stream(base, dora, args.tokens)),
        ("4 streams batched, base model", loom_batch(base, None, None, args.tokens), None),
        ("4 streams batched, lora/none/lora/none", loom_batch(
            base, both, ["lora", None, "lora", None], args.tokens), None),
        ("4 streams batched, lora/none/dora/lora", loom_batch(
            base, both, ["lora", None, "dora", "lora"], args.tokens), None),
    ]  # fmt: skip
    print(f"decode tokens/s, {args.layers}x{args.hidden} bf16 Llama, {args.tokens} tokens")
    print("| run | mlx-loom | mlx-lm |")
    print("|---|---|---|")
    for name, ours, theirs in rows:
        shown = f"{theirs:.1f}" if theirs is not None else "—"
        print(f"| {name} | {ours:.1f} | {shown} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
