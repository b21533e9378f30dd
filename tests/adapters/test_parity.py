"""Adapters against mlx-lm: ``mlx_loom.load(base, adapter_path=...)`` equals
``mlx_lm.load(base, adapter_path=...)`` for every family, bit for bit.

The adapted layers compute mlx-lm's expressions in mlx-lm's order on the
same base graph, so the comparison is exact (``mx.array_equal``) at the
prompt and at every greedy decode step, on each engine's own caches. Bases:
the family's tiny fp32 checkpoint and mlx-lm's 4-bit conversion of it.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

import mlx_loom

from . import adapterkit as kit

BASES = ["fp32", "q4"]

#: DoRA keys per family: mlx-lm defines DoRA only for linear and embedding
#: layers, so MoE families list their dense projections explicitly.
DORA_KEYS = {
    "llama": None,
    "qwen3_next": ["self_attn.q_proj", "self_attn.o_proj", "linear_attn.out_proj", "mlp.gate"],
    "qwen3_5": ["self_attn.v_proj", "linear_attn.in_proj_qkv", "linear_attn.in_proj_z"],
    "gemma4_text": ["self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj", "router.proj"],
    "gemma4": ["self_attn.q_proj", "mlp.up_proj", "per_layer_input_gate"],
    "gpt_oss": ["self_attn.q_proj", "self_attn.v_proj", "mlp.router"],
}


def _both(base, adapter):
    return kit.load_ours(base, adapter), kit.load_theirs(base, adapter)


@pytest.mark.parametrize("kind", BASES)
@pytest.mark.parametrize("model_type", kit.FAMILIES)
def test_lora_matches_mlx_lm(base, tmp_path, model_type, kind):
    path = base(model_type, kind)
    adapter = kit.write_adapter(path, tmp_path / "lora", num_layers=2)
    ours, theirs = _both(path, adapter)
    kit.assert_same_run(ours, theirs)
    plain = kit.load_ours(path)
    x = kit.prompt()
    assert not mx.array_equal(ours(x), plain(x)), "the adapter changed nothing"


@pytest.mark.parametrize("kind", BASES)
@pytest.mark.parametrize("model_type", kit.FAMILIES)
def test_dora_matches_mlx_lm(base, tmp_path, model_type, kind):
    path = base(model_type, kind)
    adapter = kit.write_adapter(
        path, tmp_path / "dora", fine_tune_type="dora", num_layers=3, keys=DORA_KEYS[model_type]
    )
    ours, theirs = _both(path, adapter)
    kit.assert_same_run(ours, theirs)
    assert ours.adapter.kind == "dora"


@pytest.mark.parametrize("model_type", ["qwen3_next", "gemma4_text", "gpt_oss"])
def test_routed_expert_projections_carry_lora(base, tmp_path, model_type):
    path = base(model_type, "q4")
    adapter = kit.write_adapter(path, tmp_path / "lora", num_layers=-1)
    ours, theirs = _both(path, adapter)
    experts = [p for p in ours.adapter.modules if ".switch_" in p or ".experts." in p]
    assert experts, ours.adapter.modules
    kit.assert_same_run(ours, theirs)


@pytest.mark.parametrize("fine_tune_type", ["lora", "dora"])
@pytest.mark.parametrize("kind", ["mxfp4", "nvfp4"])
def test_adapters_on_a_microscaling_base_match_mlx_lm(base, tmp_path, kind, fine_tune_type):
    # DoRA reads the dequantized base weight: in the base's own mode.
    path = base("llama", kind)
    adapter = kit.write_adapter(path, tmp_path / "a", fine_tune_type=fine_tune_type)
    kit.assert_same_run(*_both(path, adapter))


def test_routed_experts_in_mxfp4_carry_lora(base, tmp_path):
    path = base("qwen3_next", "mxfp4")
    adapter = kit.write_adapter(path, tmp_path / "lora", num_layers=-1)
    ours, theirs = _both(path, adapter)
    assert any(".switch_" in p for p in ours.adapter.modules)
    kit.assert_same_run(ours, theirs)


def test_every_layer_and_the_output_head_match_mlx_lm(base, tmp_path):
    path = base("llama")
    keys = ["self_attn.k_proj", "mlp.up_proj", "lm_head", "model.embed_tokens"]
    adapter = kit.write_adapter(path, tmp_path / "all", num_layers=0, keys=keys, rank=8)
    ours, theirs = _both(path, adapter)
    assert {"lm_head", "model.embed_tokens", "model.layers.0.mlp.up_proj"} <= set(
        ours.adapter.modules
    )
    kit.assert_same_run(ours, theirs)


@pytest.mark.parametrize("fine_tune_type", ["lora", "dora"])
def test_a_tied_embedding_adapted_as_lookup_and_head_matches_mlx_lm(base, tmp_path, fine_tune_type):
    path = base("gemma4_text")  # tied: the embedding is also the output head
    adapter = kit.write_adapter(
        path, tmp_path / "emb", fine_tune_type=fine_tune_type, keys=["model.embed_tokens"]
    )
    ours, theirs = _both(path, adapter)
    assert ours.adapter.modules == ("model.embed_tokens",)
    kit.assert_same_run(ours, theirs)


@pytest.mark.parametrize("fine_tune_type", ["lora", "dora"])
def test_bf16_base_with_bf16_factors_matches_mlx_lm(base, tmp_path, fine_tune_type):
    path = base("llama", "bf16")
    adapter = kit.write_adapter(
        path, tmp_path / "bf16", fine_tune_type=fine_tune_type, dtype=mx.bfloat16
    )
    ours, theirs = _both(path, adapter)
    kit.assert_same_run(ours, theirs)


def test_a_full_fine_tune_matches_mlx_lm(base, tmp_path):
    path = base("qwen3_5")
    adapter = kit.write_full_finetune(path, tmp_path / "full", num_layers=2)
    ours, theirs = _both(path, adapter)
    kit.assert_same_run(ours, theirs)
    assert ours.adapter.kind == "full"


def test_greedy_generation_with_an_adapter_matches_mlx_lm_generate(base, tmp_path):
    from mlx_lm import load as lm_load
    from mlx_lm import stream_generate as lm_stream_generate

    path = base("qwen3_next")
    adapter = kit.write_adapter(path, tmp_path / "lora")
    model, tokenizer = mlx_loom.load(path, adapter_path=adapter, **kit.ORACLE_PATH)
    lm_model, lm_tokenizer = lm_load(str(path), adapter_path=str(adapter))
    prompt = tokenizer.encode("the cat")
    ours = [r.token for r in mlx_loom.stream_generate(model, tokenizer, prompt, max_tokens=12)]
    theirs = [r.token for r in lm_stream_generate(lm_model, lm_tokenizer, prompt, max_tokens=12)]
    assert ours == theirs and len(ours) == 12


@pytest.mark.parametrize("fine_tune_type", ["lora", "dora"])
def test_on_the_cpus_default_path_adapters_wrap_the_native_layers(base, tmp_path, fine_tune_type):
    """fp32 activations on the native kernels (the CPU default): the adapter wraps the
    native layers and gives mlx-lm's greedy tokens, logits within the native
    kernels' stated 1e-4 of their scale."""
    from mlx_loom.cpu.layers import NativeLinear

    path = base("llama", "bf16")
    adapter = kit.write_adapter(path, tmp_path / "a", fine_tune_type=fine_tune_type)
    ours, _ = mlx_loom.load(path, adapter_path=adapter)
    wrapped = [m.base for _, m in ours.module.named_modules() if hasattr(m, "adapters")]
    if ours.cpu_path.kernel_set == "cpu-native":
        assert wrapped and all(isinstance(b, NativeLinear) for b in wrapped)
    theirs = kit.load_theirs(path, adapter)
    theirs.set_dtype(mx.float32)
    x = kit.prompt()
    a = kit.greedy_logits(ours, x, ours.make_cache(), 6)
    b = kit.greedy_logits(theirs, x, theirs.make_cache(), 6)
    for la, lb in zip(a, b, strict=True):
        assert mx.argmax(la[0, -1]).item() == mx.argmax(lb[0, -1]).item()
        assert mx.abs(la - lb).max().item() <= 1e-4 * max(1.0, mx.abs(lb).max().item())
