"""Routed experts on the native CPU kernels: decode and prefill before -> after.

A Qwen3-Next-shaped model (hidden 1024, 8 layers, 32 experts of width 384,
top-4, a shared expert, vocab 32000; ~0.4 B parameters) with random weights,
quantized to 4 bits (group 64, bf16 scales) by mlx-lm's converter. Both
engines load it with ``cpu_kernels="cpu-native"`` and float32 activations;
"before" keeps the routed experts on MLX's ``gather_qmm`` (as before the
native expert node existed), "after" runs them on the native node. Rounds
alternate between the two in one process; min / median of each.

    python benchmarks/moe_cpu_native.py [--rounds 5] [--tokens 32]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

CONFIG = {
    "model_type": "qwen3_next",
    "architectures": ["Qwen3NextForCausalLM"],
    "hidden_size": 1024,
    "num_hidden_layers": 8,
    "intermediate_size": 2048,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "linear_num_value_heads": 16,
    "linear_num_key_heads": 8,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "num_experts": 32,
    "num_experts_per_tok": 4,
    "decoder_sparse_step": 1,
    "shared_expert_intermediate_size": 512,
    "mlp_only_layers": [],
    "moe_intermediate_size": 384,
    "norm_topk_prob": True,
    "rms_norm_eps": 1e-6,
    "vocab_size": 32000,
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.25,
    "max_position_embeddings": 4096,
    "full_attention_interval": 4,
    "tie_word_embeddings": False,
}


def checkpoint(root: Path) -> Path:
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model, quantize_model, save_config

    from mlx_loom.host import default_host
    from mlx_loom.testing.checkpoints import write_checkpoint

    mt = default_host().registry.model_type("qwen3_next")
    assert mt.checkpoint_tensors is not None
    spec = {
        name: (shape, "bfloat16" if dtype in ("float32", "F32", "BF16", "bfloat16") else dtype)
        for name, (shape, dtype) in mt.checkpoint_tensors(CONFIG).items()
    }
    bf16 = write_checkpoint(root / "bf16", CONFIG, spec, seed=3)
    model, cfg = quantize_model(*load_model(bf16), 64, 4)
    dst = root / "q4"
    dst.mkdir()
    mx.save_safetensors(str(dst / "model.safetensors"), dict(tree_flatten(model.parameters())))
    save_config(cfg, dst / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (bf16 / name).exists():
            (dst / name).write_bytes((bf16 / name).read_bytes())
    return dst


def build(path: Path, native_experts: bool):
    from mlx_loom.cpu import experts, layers
    from mlx_loom.host import resolve_model
    from mlx_loom.loader import build_model
    from mlx_loom.nn import SwitchGLU

    swappable = layers.swappable
    if not native_experts:  # the routed experts as they ran before: MLX's gather_qmm
        layers.swappable = lambda m: (  # type: ignore[assignment]
            False if type(m) in experts.SWAPS or type(m) is SwitchGLU else swappable(m)
        )
    try:
        model = build_model(resolve_model(path, compute_dtype="float32", cpu_kernels="cpu-native"))
    finally:
        layers.swappable = swappable  # type: ignore[assignment]
    return model


def run(model, prompt: list[int], tokens: int) -> tuple[float, float, list[int]]:
    """(prefill tok/s, decode tok/s, the greedy tokens)."""
    cache = model.make_cache()
    t0 = time.perf_counter()
    logits = model(mx.array([prompt]), cache=cache)[:, -1, :]
    token = mx.argmax(logits, axis=-1)
    mx.eval(token)
    t1 = time.perf_counter()
    out = []
    for _ in range(tokens):
        out.append(int(np.asarray(token).reshape(-1)[0]))
        token = mx.argmax(model(token.reshape(1, 1), cache=cache)[:, -1, :], axis=-1)
        mx.eval(token)
    t2 = time.perf_counter()
    return len(prompt) / (t1 - t0), tokens / (t2 - t1), out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = checkpoint(Path(tmp))
        engines = {"before": build(path, False), "after": build(path, True)}
        prompt = [(7 * i + 3) % 32000 for i in range(args.prompt)]
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
        greedy = {}
        for name, model in engines.items():  # warm-up
            greedy[name] = run(model, prompt, 4)[2]
        for _ in range(args.rounds):
            for name, model in engines.items():
                prefill, decode, tokens = run(model, prompt, args.tokens)
                results[name].append((prefill, decode))
                greedy[name] = tokens
        print(f"greedy tokens equal: {greedy['before'] == greedy['after']}")
        for name, rows in results.items():
            pre = [r[0] for r in rows]
            dec = [r[1] for r in rows]
            print(
                f"{name:7s} decode tok/s min {min(dec):7.2f} median {statistics.median(dec):7.2f}"
                f" | prefill ({args.prompt} tokens) tok/s min {min(pre):7.1f}"
                f" median {statistics.median(pre):7.1f}"
            )


if __name__ == "__main__":
    main()
