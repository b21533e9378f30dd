"""Registration: kernels per backend, capabilities, end-to-end resolution, KV quantization."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import maybe_quantize_kv_cache as lm_maybe_quantize
from mlx_lm.models.cache import make_prompt_cache

from mlx_loom.backends import KernelRegistry
from mlx_loom.cache import maybe_quantize_kv_cache
from mlx_loom.errors import KernelUnavailable
from mlx_loom.host import (
    ADAPTERS,
    BATCH,
    GENERATE,
    KV_QUANTIZATION,
    PROMPT_CACHE,
    SPECULATIVE,
    PluginHost,
    Registry,
    resolve_model,
)
from mlx_loom.host._profiles import validate_profile
from mlx_loom.loader import build_model
from mlx_loom_qwen3_next import kernels as qk
from mlx_loom_qwen3_next import plugin

PROMPT = [1, 5, 7, 9, 11, 200, 3, 4, 8, 100, 42, 17]


def _registry() -> Registry:
    return PluginHost(plugins=[("qwen3_next", plugin)], entry_points=False).registry


def test_every_kernel_is_registered_for_every_backend():
    reg = KernelRegistry(plugin.FAMILY.kernels)
    for name in qk.KERNEL_NAMES:
        assert reg.backends_for(name) == ("metal", "cuda", "cpu")


def test_the_ops_kernels_are_selected_on_this_device():
    reg = KernelRegistry(plugin.FAMILY.kernels)
    assert reg.resolve(qk.GATED_DELTA).fn is qk.gated_delta_ops
    assert reg.resolve(qk.CAUSAL_CONV).fn is qk.causal_conv_silu_ops


def test_the_cuda_registrations_are_the_ops_kernels():
    cuda = {k.name: k for k in plugin.FAMILY.kernels if k.backend == "cuda"}
    cpu = {k.name: k for k in plugin.FAMILY.kernels if k.backend == "cpu"}
    assert set(cuda) == set(qk.KERNEL_NAMES)
    assert all(cuda[name].fn is cpu[name].fn for name in cuda)
    assert all("registered for cpu and cuda" in k.description for k in cuda.values())


def test_pinning_metal_here_is_refused_naming_the_kernel():
    registry = _registry().with_(kernel_backend="metal")
    profile = next(p for p in registry.profiles if "qwen3_next" in p.model_types)
    with pytest.raises(KernelUnavailable, match="qwen3_next.gated_delta"):
        registry.select("qwen3_next", profile)


def test_metal_registrations_carry_their_kernel_sources():
    metal = {k.name: k for k in qk.metal_kernels()}
    assert "simd_sum" in metal[qk.GATED_DELTA].source
    assert "mask[batch * T + step]" in metal[qk.GATED_DELTA_MASKED].source
    # the replay is the forward's state statements, each row stopping at its kept length
    assert "lengths[batch]" in metal[qk.GATED_DELTA_REPLAY].source
    assert "new_tail" in metal[qk.CAUSAL_CONV].source


def test_profiles_are_valid_and_declare_the_capabilities_the_caches_support():
    for profile in _registry().profiles:
        validate_profile(profile)
        assert profile.capabilities == {
            GENERATE,
            BATCH,
            PROMPT_CACHE,
            KV_QUANTIZATION,
            SPECULATIVE,
            ADAPTERS,
        }


@pytest.mark.parametrize("kind", ["qwen3_next-fp32", "qwen3_5-fp32"])
def test_mlx_loom_resolves_and_builds_the_checkpoint(kind, ckpt_dir, loaders):
    path = ckpt_dir(kind)
    # MLX operations in the checkpoint's dtype: the plugin's own arithmetic, bit for bit.
    model = build_model(resolve_model(path, compute_dtype="checkpoint", cpu_kernels="cpu-ops"))
    assert model.backend == "cpu"
    x = mx.array([PROMPT])
    assert mx.array_equal(model(x), loaders(kind)[0](x))


def test_kv_quantized_attention_layers_match_mlx_lm(loaders):
    ours, ref = loaders("qwen3_next_hd32-fp32")
    ca, cb = ours.make_cache(), make_prompt_cache(ref)
    la, lb = ours(mx.array([PROMPT]), cache=ca), ref(mx.array([PROMPT]), cache=cb)
    maybe_quantize_kv_cache(ca, kv_bits=8, kv_group_size=32, quantized_kv_start=0)
    lm_maybe_quantize(cb, quantized_kv_start=0, kv_group_size=32, kv_bits=8)
    assert [(type(c).__name__, getattr(c, "codec", None)) for c in ca] == [
        ("RecurrentCache", None),
        ("KVCache", "affine"),
        ("RecurrentCache", None),
        ("KVCache", "affine"),
    ]
    for _ in range(8):
        t = mx.argmax(la[:, -1], -1)[:, None]
        la, lb = ours(t, cache=ca), ref(t, cache=cb)
        assert mx.array_equal(la, lb)


def test_the_cores_batch_loop_gives_each_row_its_own_greedy_tokens(ckpt_dir):
    from mlx_loom.generation.batch import batch_generate_tokens

    model = build_model(resolve_model(ckpt_dir("qwen3_next-fp32")))
    prompts = [PROMPT, PROMPT[4:9], PROMPT[:7]]
    got = batch_generate_tokens(model, prompts, max_tokens=8)
    for prompt, (tokens, _) in zip(prompts, got, strict=True):
        cache = model.make_cache()
        logits = model(mx.array([prompt]), cache)
        want = []
        for _ in range(8):
            t = mx.argmax(logits[:, -1], -1)
            want.append(t.item())
            logits = model(t[:, None], cache)
        assert tokens == want


def _on_a_cuda_device(monkeypatch):
    """A test double for a CUDA machine: the default device reports cuda, and cuda runs.

    Patched where the core's selection looks the two functions up (found through
    the selection functions themselves, so the double follows the core's modules).
    """
    for fn in (KernelRegistry.resolve, Registry.select, Registry._default_backend):
        names = fn.__globals__
        if "active_backend" in names:
            monkeypatch.setitem(names, "active_backend", lambda: "cuda")
        if "runnable_backends" in names:
            monkeypatch.setitem(names, "runnable_backends", lambda: frozenset({"cpu", "cuda"}))


@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5"])
def test_on_a_cuda_device_selection_picks_the_ops_kernels(model_type, monkeypatch):
    _on_a_cuda_device(monkeypatch)
    registry = _registry()
    profile = next(p for p in registry.profiles if model_type in p.model_types)
    binding = registry.select(model_type, profile)
    assert binding.backend == "cuda"
    assert binding.kernels[qk.GATED_DELTA].fn is qk.gated_delta_ops
    assert binding.kernels[qk.CAUSAL_CONV].fn is qk.causal_conv_silu_ops
    assert {k.backend for k in binding.kernels.values()} == {"cuda"}


def test_a_checkpoint_builds_and_runs_with_cuda_kernels(ckpt_dir, loaders, monkeypatch):
    # The CPU model it is compared with is loaded first: under the CUDA double
    # its CPU kernel set would (rightly) be refused. Loading it here, not
    # relying on an earlier test's cache, lets this test run alone.
    cpu_model = loaders("qwen3_next-fp32")[0]
    _on_a_cuda_device(monkeypatch)
    path = ckpt_dir("qwen3_next-fp32")
    model = build_model(resolve_model(path, kernel_backend="cuda"))
    assert model.backend == "cuda"
    x = mx.array([PROMPT])
    assert mx.array_equal(model(x), cpu_model(x))
