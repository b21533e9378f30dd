"""One process against two: speed, per-rank memory and per-rank weight bytes, per family.

Run by hand (not a test)::

    .venv/bin/python benchmarks/distributed.py                 # every family
    .venv/bin/python benchmarks/distributed.py --rows llama --repeats 3

For each family a random-weight bf16 checkpoint in MLX layout (what
``mlx_lm.convert`` writes) is generated once under ``benchmarks/.checkpoints``.
Each row then runs the same greedy generation — a fixed random prompt, then
decode — in one process, and on two local ranks (``mlx.launch --backend ring
-n 2``) in tensor and in pipeline mode. Per rank it reports the bytes of its
parameters, the bytes it read from the checkpoint while loading (``rchar``
of ``/proc/self/io``: file reads by the process, whatever the page cache
held), and its peak MLX memory; rank 0 reports prompt and decode tokens per
second (best of ``--repeats``) and how many of its greedy tokens, from the
first, equal the single-process run's. Two ranks share this machine's cores, so speed here
shows the cost of the collectives more than the gain of a second machine.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CACHE_DIR = HERE / ".checkpoints" / "distributed"

ROWS: dict[str, dict] = {
    "llama": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "vocab_size": 32000,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    },
    "qwen3_next": {
        "model_type": "qwen3_next",
        "architectures": ["Qwen3NextForCausalLM"],
        "hidden_size": 512,
        "num_hidden_layers": 8,
        "intermediate_size": 1536,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "linear_num_value_heads": 8,
        "linear_num_key_heads": 4,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "linear_conv_kernel_dim": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 512,
        "mlp_only_layers": [],
        "moe_intermediate_size": 256,
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "vocab_size": 32000,
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "max_position_embeddings": 4096,
        "full_attention_interval": 4,
        "tie_word_embeddings": False,
    },
    "gemma4_text": {
        "model_type": "gemma4_text",
        "hidden_size": 512,
        "num_hidden_layers": 8,
        "intermediate_size": 1536,
        "num_attention_heads": 8,
        "head_dim": 64,
        "global_head_dim": 128,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "vocab_size": 32000,
        "vocab_size_per_layer_input": 32000,
        "hidden_size_per_layer_input": 64,
        "sliding_window": 128,
        "layer_types": ["sliding_attention"] * 3
        + ["full_attention"]
        + ["sliding_attention"] * 3
        + ["full_attention"],
        "num_kv_shared_layers": 2,
        "final_logit_softcapping": 30.0,
        "use_double_wide_mlp": False,
        "enable_moe_block": True,
        "num_experts": 8,
        "top_k_experts": 2,
        "moe_intermediate_size": 256,
        "tie_word_embeddings": True,
        "max_position_embeddings": 4096,
    },
}
MODES = ("single", "tensor", "pipeline")


def checkpoint(name: str) -> Path:
    """The row's bf16 checkpoint in MLX layout (the graph's own names), written once."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    import mlx_loom
    from mlx_loom.testing.checkpoints import write_checkpoint

    path = CACHE_DIR / name
    if (path / "model.safetensors").exists():
        return path
    config = ROWS[name]
    claim = mlx_loom.default_host().registry.model_types[config["model_type"]]
    tensors = {n: (s, "BF16") for n, (s, _) in claim.checkpoint_tensors(config).items()}
    with tempfile.TemporaryDirectory() as tmp:
        hf = write_checkpoint(Path(tmp) / name, config, tensors)
        model, _ = mlx_loom.load(hf)
        path.mkdir(parents=True, exist_ok=True)
        weights = dict(tree_flatten(model.module.parameters()))
        mx.save_safetensors(str(path / "model.safetensors"), weights, {"format": "mlx"})
        for item in hf.iterdir():
            if item.name != "model.safetensors":
                shutil.copy(item, path / item.name)
    return path


def _rchar() -> int:
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["rchar"])


def worker(model_dir: str, mode: str, out: str, repeats: int, prompt_len: int, tokens: int) -> None:
    """One rank (or the single process): load, generate, write what it measured."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    import mlx_loom

    mlx_loom.default_host()  # plugin discovery reads files too: not the checkpoint's
    before = _rchar()
    model, tokenizer = mlx_loom.load(model_dir, parallel=None if mode == "single" else mode)
    read = _rchar() - before
    rank = model.parallel.rank if model.parallel else 0
    prompt = mx.random.randint(3, 1000, (prompt_len,), key=mx.random.key(0)).tolist()
    best = {"prompt_tps": 0.0, "generation_tps": 0.0}
    out_tokens: list[int] = []
    for attempt in range(repeats + 1):  # the first is a warm-up
        last, out_tokens = None, []
        for last in mlx_loom.stream_generate(model, tokenizer, prompt, max_tokens=tokens):
            out_tokens.append(last.token)
        if attempt and last is not None:
            best["prompt_tps"] = max(best["prompt_tps"], last.prompt_tps)
            best["generation_tps"] = max(best["generation_tps"], last.generation_tps)
    mx.synchronize()
    weights = sum(v.nbytes for _, v in tree_flatten(model.module.parameters()))
    record = {
        "rank": rank,
        "weight_bytes": weights,
        "read_bytes": read,
        "peak_bytes": mx.get_peak_memory(),
        "tokens": out_tokens,
        **best,
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    if model.parallel is not None:  # leave together: the last step's collectives finish first
        model.parallel.lockstep().share_int(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(name: str, mode: str, args: argparse.Namespace) -> list[dict]:
    model_dir = checkpoint(name)
    with tempfile.TemporaryDirectory() as out:
        command = [
            sys.executable,
            __file__,
            "--worker",
            str(model_dir),
            "--mode",
            mode,
            "--out",
            out,
            "--repeats",
            str(args.repeats),
            "--prompt",
            str(args.prompt),
            "--tokens",
            str(args.tokens),
        ]
        if mode != "single":
            launcher = shutil.which("mlx.launch", path=str(Path(sys.executable).parent))
            port = str(_free_port())
            command = [launcher, "--backend", "ring", "-n", "2", "-p", port, "--", *command]
        done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
        ranks = sorted(Path(out).glob("rank*.json"))
        if not ranks:
            raise RuntimeError(f"{name}/{mode} produced nothing:\n{done.stdout}\n{done.stderr}")
        return [json.loads(p.read_text()) for p in ranks]


def _per(ranks: list[dict], key: str) -> str:
    """Each rank's figure in MB, rank 0 first."""
    return " / ".join(f"{r[key] / 1e6:.0f}" for r in ranks)


def _agreeing(tokens: list[int], reference: list[int]) -> int:
    """How many tokens, from the first, equal the reference's."""
    pairs = zip(tokens, reference, strict=False)
    return next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(tokens), len(reference)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated families")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    parser.add_argument("--tokens", type=int, default=32, help="tokens to generate")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="single", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.mode, args.out, args.repeats, args.prompt, args.tokens)
        return
    print(
        "| family | mode | ranks | weights / rank MB | read / rank MB | peak / rank MB "
        "| prefill tok/s | decode tok/s | tokens equal to 1 process |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.rows.split(","):
        single = None
        for mode in MODES:
            ranks = run(name, mode, args)
            zero = ranks[0]
            single = single or zero
            memory = " | ".join(
                _per(ranks, k) for k in ("weight_bytes", "read_bytes", "peak_bytes")
            )
            speed = f"{zero['prompt_tps']:.1f} | {zero['generation_tps']:.1f}"
            agree = f"{_agreeing(zero['tokens'], single['tokens'])}/{len(single['tokens'])}"
            print(f"| {name} | {mode} | {len(ranks)} | {memory} | {speed} | {agree} |", flush=True)


if __name__ == "__main__":
    main()
