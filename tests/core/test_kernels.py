"""Kernel registry: per-(name, backend) registration, device selection, refusal."""

import mlx.core as mx
import pytest

from mlx_loom.backends import (
    Kernel,
    KernelRegistry,
    Provider,
    active_backend,
    runnable_backends,
)
from mlx_loom.errors import KernelUnavailable, RegistrationError


def k(name="step", backend="cpu", plugin="fam"):
    return Kernel(
        name, backend, fn=lambda: backend, provider=Provider(plugin, f"dist-{plugin}", "1.0")
    )


def test_this_machine_runs_the_cpu_backend():
    assert not mx.metal.is_available()
    assert active_backend() == "cpu"
    assert runnable_backends() == frozenset({"cpu"})


def test_resolve_picks_the_registration_for_the_active_backend():
    registry = KernelRegistry([k(backend="metal"), k(backend="cpu")])
    assert registry.resolve("step").backend == "cpu"
    assert registry.resolve("step").fn() == "cpu"


def test_a_metal_only_kernel_is_refused_on_a_cpu_device_never_substituted():
    registry = KernelRegistry([k(backend="metal")])
    with pytest.raises(KernelUnavailable) as err:
        registry.resolve("step")
    assert "no 'cpu' registration" in err.value.message
    assert "registered backends: metal" in err.value.message


def test_pinning_a_backend_that_cannot_run_here_is_refused_naming_the_kernel():
    registry = KernelRegistry([k(backend="metal"), k(backend="cpu")])
    with pytest.raises(KernelUnavailable, match="Kernel 'step' is pinned to backend 'metal'"):
        registry.resolve("step", "metal")


def test_duplicate_registration_names_both_providers():
    with pytest.raises(RegistrationError) as err:
        KernelRegistry([k(plugin="a"), k(plugin="b")])
    assert "dist-a" in err.value.message and "dist-b" in err.value.message


def test_unknown_backend_is_rejected():
    with pytest.raises(RegistrationError, match="backend 'vulkan'"):
        k(backend="vulkan")


def test_empty_kernel_name_is_rejected():
    with pytest.raises(RegistrationError, match="Kernel.name must be a non-blank string"):
        k(name="")


def test_a_forged_kernel_is_rechecked_when_registered():
    forged = k()
    object.__setattr__(forged, "backend", "vulkan")
    with pytest.raises(RegistrationError, match="backend 'vulkan'"):
        KernelRegistry([forged])
