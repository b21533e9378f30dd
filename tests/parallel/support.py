"""Helpers of the parallel tests: tiny checkpoints (plain and quantized), launching local ranks.

Two ranks run on this machine over MLX's ``ring`` backend, started by
``mlx.launch --backend ring -n 2`` exactly as a user starts them. Each launch
gets its own free ports (other test runs may share the machine).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

import mlx_loom
from mlx_loom.testing.checkpoints import write_checkpoint

HERE = Path(__file__).parent
#: Plain tiny checkpoints: every model type of the families (qwen3 dense is the llama plan).
MODEL_TYPES = ("llama", "qwen3_next", "qwen3_5", "gemma4_text", "gemma4", "qwen3_moe", "gpt_oss")
#: Quantized checkpoints (4-bit, groups of 32) need every split input slice to be
#: whole groups at two ranks: these dims are the tiny configs' with that property.
QUANTIZED = {
    "llama": {},
    "qwen3_next": {
        "linear_value_head_dim": 16,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
    },
    "gemma4_text": {"intermediate_size": 128, "moe_intermediate_size": 64},
    "qwen3_moe": {"moe_intermediate_size": 64},
}
GROUP_SIZE, BITS = 32, 4
#: A vocabulary two ranks do not divide: the last rank's block is one row short.
ODD_VOCAB = 255


def tiny_config(model_type: str, **overrides: Any) -> dict[str, Any]:
    claim = mlx_loom.default_host().registry.model_types[model_type]
    return {**claim.tiny_config, **overrides}


def write_tiny(path: Path, model_type: str, **overrides: Any) -> Path:
    claim = mlx_loom.default_host().registry.model_types[model_type]
    config = tiny_config(model_type, **overrides)
    return write_checkpoint(path, config, claim.checkpoint_tensors(config))


def write_quantized(
    src: Path, dst: Path, *, group_size: int = GROUP_SIZE, bits: int = BITS, mode: str = "affine"
) -> Path:
    """``src`` quantized in MLX layout (``mode``: affine, or mxfp4/nvfp4/mxfp8 at the group
    size and bits they fix): every linear, embedding and expert stack whose input
    dimension is a whole number of groups (the rest stay as they are)."""
    model, _ = mlx_loom.load(src)
    nn.quantize(
        model.module,
        group_size=group_size,
        bits=bits,
        mode=mode,
        class_predicate=lambda _, m: (
            hasattr(m, "to_quantized") and m.weight.shape[-1] % group_size == 0
        ),
    )
    dst.mkdir(parents=True)
    mx.save_safetensors(
        str(dst / "model.safetensors"), dict(tree_flatten(model.module.parameters()))
    )
    config = json.loads((src / "config.json").read_text())
    config["quantization"] = {"group_size": group_size, "bits": bits, "mode": mode}
    (dst / "config.json").write_text(json.dumps(config))
    for name in os.listdir(src):
        if name.startswith("tokenizer"):
            shutil.copy(src / name, dst / name)
    return dst


def free_ports(count: int) -> int:
    """A port ``p`` such that ``p .. p + count - 1`` are free now (mlx.launch's ring ports)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + count >= 65535:
            continue
        try:
            held = []
            for p in range(base, base + count):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", p))
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
        return base
    raise RuntimeError("no run of free ports found")


@dataclass
class Launch:
    returncode: int
    stdout: str
    stderr: str

    def explain(self) -> str:
        tail = f"--- stdout\n{self.stdout[-4000:]}\n--- stderr\n{self.stderr[-4000:]}"
        return f"exit {self.returncode}\n{tail}"


def mlx_launch(command: list[str], *, timeout: float, stdin: str = "", ranks: int = 2) -> Launch:
    """Run ``command`` on ``ranks`` local processes with ``mlx.launch --backend ring``."""
    launcher = shutil.which("mlx.launch", path=str(Path(sys.executable).parent))
    assert launcher is not None, "mlx.launch is not installed beside this Python"
    argv = [
        launcher,
        "--backend",
        "ring",
        "-n",
        str(ranks),
        "--starting-port",
        str(free_ports(ranks)),
        "--",
        *command,
    ]
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # so a timeout can stop the launcher and both ranks
    )
    try:
        out, err = proc.communicate(stdin, timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return Launch(-1, out, err + f"\n[timed out after {timeout} s]")
    return Launch(proc.returncode, out, err)


def run_ranks(cases: list[dict[str, Any]], tmp: Path, *, timeout: float) -> list[dict[str, Any]]:
    """Run ``ranks.py`` on two ranks; each rank's ``{case id: result}``."""
    spec = tmp / "cases.json"
    spec.write_text(json.dumps(cases))
    launch = mlx_launch(
        [sys.executable, str(HERE / "ranks.py"), str(spec), str(tmp)], timeout=timeout
    )
    results = []
    for rank in range(2):
        path = tmp / f"rank{rank}.json"
        results.append(json.loads(path.read_text()) if path.exists() else {})
    missing = [c["id"] for c in cases if any(c["id"] not in r for r in results)]
    assert launch.returncode == 0 and not missing, (
        f"cases without a result on every rank: {missing}\n{launch.explain()}"
    )
    return results
