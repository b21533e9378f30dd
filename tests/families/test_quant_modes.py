"""MLX's microscaling quantization modes (mxfp4, nvfp4, mxfp8), for every family.

``tests/convert/test_convert.py`` converts each family with ``--q-mode`` through
both tools and checks tensors, configs and logits. Here: a checkpoint whose
modules mix every mode (as ``mlx_lm.convert``'s quantize path writes it, with a
per-module predicate) decodes with mlx-lm's logits bit for bit and its greedy
tokens; the native CPU kernels leave microscaling layers on MLX's products, and
``loom explain`` and ``loom generate`` say and do so.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from itertools import cycle
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

import mlx_loom
from mlx_loom.artifacts.quantization import MicroscalingEmbedding
from mlx_loom.cli.main import main
from mlx_loom.cpu.layers import NativeQuantizedLinear

from ..adapters import adapterkit as kit

#: The packings a mixed checkpoint cycles through, module by module.
SPECS = [
    {"group_size": 32, "bits": 4, "mode": "mxfp4"},
    {"group_size": 16, "bits": 4, "mode": "nvfp4"},
    {"group_size": 32, "bits": 8, "mode": "mxfp8"},
    {"group_size": 32, "bits": 8, "mode": "affine"},
]


def mixed_predicate():
    """A per-module predicate giving consecutive modules the next packing that fits them."""
    specs = cycle(SPECS)

    def predicate(path: str, module: nn.Module) -> bool | dict:
        for _ in SPECS:
            spec = next(specs)
            if module.weight.shape[-1] % spec["group_size"] == 0:
                return dict(spec)
        return False

    return predicate


def convert_with_mlx_lm(src: Path, dst: Path, **options) -> Path:
    from mlx_lm.convert import convert

    with contextlib.redirect_stdout(io.StringIO()):
        convert(str(src), str(dst), quantize=True, **options)
    return dst


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """``checkpoint(model_type, "mixed" | mode)``: mlx-lm's conversion of the tiny family."""
    root = tmp_path_factory.mktemp("quant-modes")
    made: dict[tuple[str, str], Path] = {}

    def get(model_type: str, kind: str) -> Path:
        if (model_type, kind) not in made:
            src = root / model_type / "hf"
            if not src.exists():
                kit.tiny_checkpoint(src, model_type)
            options = (
                {"q_mode": "mxfp4", "quant_predicate": mixed_predicate()}
                if kind == "mixed"
                else {"q_mode": kind}
            )
            made[model_type, kind] = convert_with_mlx_lm(src, root / model_type / kind, **options)
        return made[model_type, kind]

    return get


@pytest.mark.parametrize("model_type", kit.FAMILIES)
def test_a_checkpoint_mixing_every_mode_decodes_with_mlx_lms_logits_and_tokens(
    checkpoint, model_type
):
    path = checkpoint(model_type, "mixed")
    declared = json.loads((path / "config.json").read_text())["quantization"]
    modes = {v.get("mode", "affine") for v in declared.values() if isinstance(v, dict)}
    assert modes == {"mxfp4", "nvfp4", "mxfp8", "affine"}
    tokens = kit.assert_same_run(kit.load_ours(path), kit.load_theirs(path, None))
    assert len(tokens) == 7


def test_native_kernels_leave_microscaling_layers_on_mlx_products(checkpoint):
    # Gemma 4 at mxfp4 keeps its router at 8-bit affine: one mode per kind of module.
    model, tokenizer = mlx_loom.load(checkpoint("gemma4_text", "mxfp4"), cpu_kernels="cpu-native")
    layer = model.module.model.layers[0]
    assert type(layer.self_attn.q_proj) is nn.QuantizedLinear
    assert layer.self_attn.q_proj.mode == "mxfp4"
    assert type(layer.router.proj) is NativeQuantizedLinear
    embed = model.module.model.embed_tokens
    assert type(embed) is MicroscalingEmbedding and embed.lookup_dtype == mx.float32
    assert embed(mx.array([[1, 2, 3]])).dtype == mx.float32  # the compute dtype
    assert mlx_loom.generate(model, tokenizer, "hi", max_tokens=3) is not None


def test_explain_says_where_each_modes_products_run(checkpoint, capsys):
    assert main(["explain", str(checkpoint("gemma4_text", "mxfp4"))]) == 0
    rows = dict(
        re.split(r"\s{2,}", line, maxsplit=1)
        for line in capsys.readouterr().out.splitlines()
        if re.search(r"\S\s{2,}\S", line) and not line.startswith(" ")
    )
    assert rows["quantization"] == "mxfp4 + 8-bit, group 64"
    products = rows["quantized products"]
    assert "affine linear and tied head: mlx_loom.cpu._native affine_matmul" in products
    assert "mxfp4 linear and tied head: MLX quantized_matmul (the native kernels" in products
    # Its experts are mxfp4 (MLX's gather), its router 8-bit affine.
    assert "any mxfp4 routed experts: MLX gather_qmm" in products
    assert "any affine routed experts: mlx_loom.cpu._native gather_affine_matmul" in products


def test_loom_generate_runs_an_nvfp4_checkpoint_as_mlx_lm_does(checkpoint, capsys):
    from mlx_lm import generate, load

    path = checkpoint("llama", "nvfp4")
    argv = ["generate", "--model", str(path), "-p", "hi", "-m", "4", "--no-chat-template"]
    oracle = ["--compute-dtype", "checkpoint", "--cpu-kernels", "cpu-ops"]
    assert main([*argv, *oracle]) == 0
    ours = capsys.readouterr().out
    model, tokenizer = load(str(path))
    theirs = generate(model, tokenizer, "hi", max_tokens=4)
    assert theirs and theirs in ours


def test_loom_serve_answers_openai_and_anthropic_clients_from_a_mixed_checkpoint(checkpoint):
    import anthropic
    import openai

    from mlx_loom.serve import make_server

    model, tokenizer = mlx_loom.load(checkpoint("qwen3_next", "mixed"))
    messages = [{"role": "user", "content": "hi"}]
    server = make_server(model, tokenizer, host="127.0.0.1", port=0, model_id="m")
    server.start_in_background()
    try:
        url = server.url
        chat = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        reply = chat.chat.completions.create(
            model="m", messages=messages, max_tokens=4, temperature=0
        )
        expected = reply.choices[0].message.content
        assert expected and reply.usage.completion_tokens == 4
        message = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0).messages.create(
            model="m", max_tokens=4, messages=messages, extra_body={"temperature": 0}
        )
        assert "".join(b.text for b in message.content if b.type == "text") == expected
    finally:
        server.stop()
