"""Registrations, capabilities, and the core's load path end to end."""

from __future__ import annotations

import mlx.core as mx

from mlx_loom.host._profiles import validate_profile
from mlx_loom_gemma4 import plugin


def test_plugin_claims_both_layouts_and_declares_its_capabilities():
    (impl,) = plugin.loom_implementations()
    (profile,) = plugin.loom_profiles()
    assert {m.name for m in plugin.loom_model_types()} == {"gemma4_text", "gemma4"}
    assert impl.model_types == profile.model_types == {"gemma4_text", "gemma4"}
    assert (
        impl.capabilities
        == profile.capabilities
        == {"generate", "batch", "prompt-cache", "kv-quantization", "speculative", "adapters"}
    )
    validate_profile(profile)


def test_expert_kernel_is_registered_for_cpu_and_metal():
    backends = {(k.name, k.backend) for k in plugin.loom_kernels()}
    assert backends == {("gemma4.switch_glu", "cpu"), ("gemma4.switch_glu", "metal")}


def _core_forward(path, prompt):
    from mlx_loom.host import build_model, resolve_model

    resolved = resolve_model(path)
    assert resolved.summary.implementation == plugin.IMPLEMENTATION_ID
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
