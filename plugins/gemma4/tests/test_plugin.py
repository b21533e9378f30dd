"""Registrations, capabilities, and the core's load path end to end."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_loom.backends import KernelRegistry
from mlx_loom.host import Registry, resolve_model
from mlx_loom.host._profiles import validate_profile
from mlx_loom.loader import build_model
from mlx_loom.nn import switch_glu
from mlx_loom_gemma4 import plugin

REGISTERED = plugin.FAMILY.registrations()


def test_plugin_claims_both_layouts_and_declares_its_capabilities():
    impls = {i.id: i for i in REGISTERED.implementations}
    profiles = {p.id: p for p in REGISTERED.profiles}
    assert set(impls) == {"gemma4.text", "gemma4.gemma3-text"}
    assert set(profiles) == {"gemma4/text", "gemma4/gemma3-text"}
    assert {m.name for m in REGISTERED.model_types} == {
        "gemma4_text",
        "gemma4",
        "gemma3_text",
        "gemma3",
    }
    gemma4 = {"generate", "batch", "prompt-cache", "kv-quantization", "speculative", "adapters"}
    for impl_id, profile_id, types, caps in [
        ("gemma4.text", "gemma4/text", {"gemma4_text", "gemma4"}, gemma4),
        ("gemma4.gemma3-text", "gemma4/gemma3-text", {"gemma3_text", "gemma3"}, gemma4 | {"compiled-step"}),
    ]:
        impl, profile = impls[impl_id], profiles[profile_id]
        assert impl.model_types == profile.model_types == types
        assert impl.capabilities == profile.capabilities == caps
        validate_profile(profile)


def test_expert_kernel_is_registered_for_every_backend():
    backends = {(k.name, k.backend) for k in REGISTERED.kernels}
    assert backends == {("gemma4.switch_glu", b) for b in ("cpu", "cuda", "metal")}


def test_the_cuda_registration_is_the_ops_kernel_that_runs_here():
    by_backend = {k.backend: k for k in REGISTERED.kernels}
    assert by_backend["cuda"].fn is by_backend["cpu"].fn is switch_glu
    assert "registered for cpu and cuda" in by_backend["cuda"].description


def _core_forward(path, prompt):
    from mlx_loom.host import resolve_model
    from mlx_loom.loader import build_model

    # MLX operations in the checkpoint's dtype: the plugin's own arithmetic, bit for bit.
    resolved = resolve_model(path, compute_dtype="checkpoint", cpu_kernels="cpu-ops")
    assert resolved.summary.implementation == "gemma4.text"
    model = build_model(resolved)
    return model(prompt, cache=model.make_cache())


def test_core_loader_builds_a_gemma4_text_checkpoint(kit, checkpoint):
    path = checkpoint(**kit.MOE, **kit.PER_LAYER)
    prompt = kit.prompt_of(10)
    assert mx.array_equal(_core_forward(path, prompt), kit.load_ours(path)(prompt))


def test_core_loader_builds_a_gemma4_wrapper_checkpoint(kit, checkpoint):
    path = checkpoint(wrapper=True, **kit.SHARED)
    prompt = kit.prompt_of(10)
    assert mx.array_equal(_core_forward(path, prompt), kit.load_ours(path)(prompt))


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


@pytest.mark.parametrize("wrapper", [False, True])
def test_on_a_cuda_device_the_moe_checkpoint_builds_on_the_ops_kernel(
    kit, checkpoint, monkeypatch, wrapper
):
    path = checkpoint(wrapper=wrapper, **kit.MOE)
    prompt = kit.prompt_of(10)
    want = kit.load_ours(path)(prompt)
    _on_a_cuda_device(monkeypatch)
    resolved = resolve_model(path)
    assert resolved.binding.backend == "cuda"
    assert resolved.binding.kernels["gemma4.switch_glu"].fn is switch_glu
    model = build_model(resolved)
    assert mx.array_equal(model(prompt), want)
