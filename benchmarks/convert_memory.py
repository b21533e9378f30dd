"""Peak memory of ``loom convert`` beside ``mlx_lm.convert`` on one checkpoint.

Run by hand (not a test)::

    .venv/bin/python benchmarks/convert_memory.py                 # ~1.1 GB bf16 Llama
    .venv/bin/python benchmarks/convert_memory.py --layers 4      # smaller

A random-weight bf16 Llama checkpoint in Hugging Face layout is written once
(by the core's streaming writer, so writing it costs little memory either),
then each converter runs in a fresh process and its peak resident set size
(the child's own ``ru_maxrss``) is reported, next to a process that only
imports that converter (the floor it cannot go below). Conversions: a plain
copy, 4-bit quantization, and 4-bit with ``--dtype float16``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from mlx_loom.artifacts.writer import write_weights
from mlx_loom.testing.tokenizer import write_tokenizer

CACHE_DIR = Path(__file__).resolve().parent / ".checkpoints"


def write_source(path: Path, *, layers: int, hidden: int, inter: int, vocab: int) -> Path:
    """A bf16 Llama with ``layers`` layers, written tensor by tensor (random values)."""
    if (path / "config.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    heads, kv, head_dim = hidden // 128, max(1, hidden // 512), 128
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
    shapes["model.norm.weight"] = (hidden,)
    key = mx.random.key(0)
    tensors = {}
    for name, shape in shapes.items():
        key, sub = mx.random.split(key)
        base = 1.0 if len(shape) == 1 else 0.0
        tensors[name] = (base + 0.02 * mx.random.normal(shape, key=sub)).astype(mx.bfloat16)
    write_weights(path, tensors, max_shard_bytes=512 << 20)
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(path, vocab)
    return path


_IMPORTS = {
    "loom convert": "from mlx_loom.convert import convert",
    "mlx_lm.convert": "from mlx_lm.convert import convert",
}


def peak_rss(code: str) -> tuple[float, float]:
    """(peak RSS in GB, seconds) of ``python -c code`` in a fresh process (its own ru_maxrss)."""
    report = "\nimport resource, sys\nprint(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code + report], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{code!r} failed:\n{done.stderr[-3000:]}")
    seconds = time.perf_counter() - start
    return int(done.stdout.split()[-1]) / 1e6, seconds  # ru_maxrss is in KiB on Linux


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=5632)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()
    name = f"llama-{args.layers}x{args.hidden}-bf16"
    src = write_source(
        CACHE_DIR / name,
        layers=args.layers,
        hidden=args.hidden,
        inter=args.inter,
        vocab=args.vocab,
    )
    size = sum(f.stat().st_size for f in src.glob("*.safetensors")) / 1e9
    rows = [(f"{tool}: imports only", code, None) for tool, code in _IMPORTS.items()]
    conversions = {
        "copy": ("", "{}"),
        "4-bit": ("quantize_=True", "dict(quantize=True)"),
        "4-bit, float16": (
            "quantize_=True, dtype='float16'",
            "dict(quantize=True, dtype='float16')",
        ),
    }
    work = Path(tempfile.mkdtemp(prefix="convert-memory-"))
    try:
        for tool, call in (
            ("loom convert", "convert({src!r}, {out!r}, progress=False, {kw})"),
            ("mlx_lm.convert", "convert({src!r}, {out!r}, **{lm})"),
        ):
            for label, (ours, theirs) in conversions.items():
                out = str(work / f"out-{len(rows)}")
                code = call.format(src=str(src), out=out, kw=ours, lm=theirs)
                rows.append((f"{tool}, {label}", f"{_IMPORTS[tool]}\n{code}", out))
        print(f"source: {name}, {size:.2f} GB of bf16 safetensors\n")
        print("| conversion | peak RSS (GB) | seconds |\n|---|---|---|")
        for label, code, out in rows:
            peak, seconds = peak_rss(code)
            if out is not None:
                shutil.rmtree(out)
            print(f"| {label} | {peak:.2f} | {seconds:.1f} |", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TQDM_DISABLE", "1")
    sys.exit(main())
