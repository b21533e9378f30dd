"""Checkpoints shared by the CPU tests: each family's tiny config with random
weights stored in bf16, and the same quantized to 4 bits (group 64) by
mlx-lm's converter, which keeps bf16 scales — how mlx-community ships."""

from __future__ import annotations

import os
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from mlx_loom.cpu import native
from mlx_loom.host import default_host
from mlx_loom.testing.checkpoints import write_checkpoint

_FEATURES = dict(native.module().cpu_features()) if native.unavailable_reason() is None else {}
#: Whether the kernels' AVX-512 variants can run here (F/BW/VL with VNNI).
AVX512 = all(_FEATURES.get(f, False) for f in ("avx512f", "avx512bw", "avx512vl", "avx512vnni"))
needs_avx512 = pytest.mark.skipif(not AVX512, reason="this CPU lacks AVX-512 VNNI")


@pytest.fixture
def isa():
    """Switch the 4-bit kernels' instruction set; restores the process's own
    choice after (the environment's, or auto), which no other test changes."""
    nat = native.module()
    yield nat.set_cpu_isa
    nat.set_cpu_isa(os.environ.get("MLX_LOOM_CPU_ISA") or "auto")


def on_both_isas(isa, fn):
    """``fn()`` evaluated on AVX2, then on AVX-512 named (so one activation
    row runs it too, whatever this CPU's one-row rule says): the two results."""
    isa("avx2")
    a = fn()
    mx.eval(a)
    isa("avx512")
    b = fn()
    mx.eval(b)
    return a, b


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """``checkpoints(family, "bf16" | "q4", **config)``: written once per session;
    ``config`` overrides fields of the family's tiny config (e.g. Gemma 4's MoE block)."""
    made: dict[tuple[str, str, str], Path] = {}

    def get(family: str, kind: str, **config) -> Path:
        key = (family, kind, repr(sorted(config.items())))
        if key not in made:
            root = tmp_path_factory.mktemp(f"{family}-{kind}")
            made[key] = _write(family, kind, root, config)
        return made[key]

    return get


def _write(family: str, kind: str, root: Path, overrides: dict) -> Path:
    mt = default_host().registry.model_type(family)
    config = {**(mt.tiny_config or {}), **overrides}
    assert mt.checkpoint_tensors is not None
    spec = {
        name: (shape, "bfloat16" if dtype in ("float32", "F32", "BF16", "bfloat16") else dtype)
        for name, (shape, dtype) in mt.checkpoint_tensors(config).items()
    }
    bf16 = write_checkpoint(root / "bf16", config, spec, seed=3)
    if kind == "bf16":
        return bf16
    from mlx_lm.utils import load_model, quantize_model, save_config

    model, cfg = load_model(bf16)
    model, cfg = quantize_model(model, cfg, 64, 4)
    dst = root / "q4"
    dst.mkdir()
    mx.save_safetensors(str(dst / "model.safetensors"), dict(tree_flatten(model.parameters())))
    save_config(cfg, dst / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (bf16 / name).exists():
            (dst / name).write_bytes((bf16 / name).read_bytes())
    return dst
