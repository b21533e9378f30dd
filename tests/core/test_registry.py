"""Implementation registry: immutability, duplicates, composition, selection."""

import pytest

from mlx_loom.errors import (
    ImplementationUnavailable,
    IncompatibleImplementation,
    KernelUnavailable,
    RegistrationError,
)
from mlx_loom.host import Execution, Implementation, Kernel, Profile, Provider, Registry

from .toyfamily import GRAPH, LOADER, build_toy, family_profile


def impl(id="toy.lm.v1", *, model_types=("toy_lm",), kernels=(), plugin="toy", **changes):
    fields = dict(
        id=id,
        graph=GRAPH,
        loader=LOADER,
        model_types=frozenset(model_types),
        factory=build_toy,
        kernels=tuple(kernels),
        capabilities=frozenset({"generate"}),
        provider=Provider(plugin, f"mlx-loom-{plugin}", "0.3"),
    )
    fields.update(changes)
    return Implementation(**fields)


def test_select_returns_exactly_one_binding():
    registry = Registry(implementations=[impl()], profiles=[family_profile()])
    binding = registry.select("toy_lm", family_profile())
    assert binding.implementation.id == "toy.lm.v1"
    assert binding.backend == "cpu"


def test_duplicate_implementation_id_names_both_providers():
    with pytest.raises(RegistrationError) as err:
        Registry(implementations=[impl(plugin="a"), impl(plugin="b")])
    assert "mlx-loom-a 0.3" in err.value.message and "mlx-loom-b 0.3" in err.value.message


def test_empty_implementation_id_is_an_error():
    with pytest.raises(RegistrationError, match="empty id"):
        Registry(implementations=[impl(id="")])


def test_registrations_are_frozen():
    registry = Registry(implementations=[impl()])
    snapshot = registry.implementations
    snapshot["other"] = impl(id="other")  # a copy: the registry is unaffected
    assert set(registry.implementations) == {"toy.lm.v1"}
    with pytest.raises(AttributeError):
        registry.implementations["toy.lm.v1"].id = "changed"


def test_with_returns_a_new_registry_and_leaves_the_original():
    base = Registry(implementations=[impl()], profiles=[family_profile()])
    extended = base.with_(implementations=[impl(id="toy.lm.v2")], kernel_backend="cpu")
    assert set(base.implementations) == {"toy.lm.v1"}
    assert set(extended.implementations) == {"toy.lm.v1", "toy.lm.v2"}
    assert base.kernel_backend is None and extended.kernel_backend == "cpu"


def test_with_keeps_bindings_already_made():
    base = Registry(implementations=[impl()], profiles=[family_profile()])
    binding = base.select("toy_lm", family_profile())
    narrowed = base.with_(allow_implementations=["toy.lm.v1"], kernel_backend="cpu")
    assert binding.implementation is base.implementations["toy.lm.v1"]
    assert narrowed.select("toy_lm", family_profile()).implementation.id == "toy.lm.v1"


def test_no_implementation_for_the_profile_is_refused_naming_what_is_installed():
    registry = Registry(implementations=[impl(graph="other")])
    with pytest.raises(ImplementationUnavailable) as err:
        registry.select("toy_lm", family_profile())
    assert "needs graph 'toy-graph'" in err.value.message
    assert "'toy.lm.v1' from toy (mlx-loom-toy 0.3)" in err.value.message


def test_a_named_implementation_that_is_missing_is_refused_not_substituted():
    profile = Profile(
        id="toy/exact",
        model_types=frozenset({"toy_lm"}),
        execution=Execution(
            graph=GRAPH, loader=LOADER, specialization="artifact", implementation="toy.fast"
        ),
        artifact_fingerprint="sha256:a",
        config_fingerprint="sha256:c",
        capabilities=frozenset({"generate"}),
    )
    registry = Registry(implementations=[impl()], profiles=[profile])
    with pytest.raises(ImplementationUnavailable, match="requires implementation 'toy.fast'"):
        registry.select("toy_lm", profile)


def test_an_implementation_that_rejects_the_model_type_is_incompatible():
    registry = Registry(implementations=[impl(model_types=("other",))])
    with pytest.raises(IncompatibleImplementation, match="does not accept model_type 'toy_lm'"):
        registry.select("toy_lm", family_profile())


def test_missing_capability_makes_an_implementation_incompatible():
    registry = Registry(implementations=[impl()])
    profile = family_profile(capabilities=frozenset({"generate", "batch"}))
    with pytest.raises(IncompatibleImplementation, match=r"lacks capabilities \['batch'\]"):
        registry.select("toy_lm", profile)


def test_host_allow_list_restricts_selection():
    registry = Registry(implementations=[impl(), impl(id="toy.lm.v2")])
    narrowed = registry.with_(allow_implementations=["toy.lm.v2"])
    assert narrowed.select("toy_lm", family_profile()).implementation.id == "toy.lm.v2"


def test_host_allow_list_that_excludes_every_candidate_is_refused():
    registry = Registry(implementations=[impl(), impl(id="toy.lm.v2")])
    narrowed = registry.with_(allow_implementations=["toy.lm.v2"])
    only_v1 = Registry(implementations=[impl()]).with_(allow_implementations=["toy.lm.v1"])
    assert narrowed.allowed_implementations == frozenset({"toy.lm.v2"})
    assert only_v1.select("toy_lm", family_profile()).implementation.id == "toy.lm.v1"
    blocked = Registry(implementations=[impl(), impl(id="toy.lm.v2", graph="g2")]).with_(
        allow_implementations=["toy.lm.v2"]
    )
    with pytest.raises(ImplementationUnavailable, match="the host allows only"):
        blocked.select("toy_lm", family_profile())


def test_allowing_an_unknown_implementation_id_is_an_error():
    with pytest.raises(ImplementationUnavailable, match="'toy.nope'"):
        Registry(implementations=[impl()]).with_(allow_implementations=["toy.nope"])


def test_two_fitting_implementations_are_ambiguous():
    registry = Registry(implementations=[impl(), impl(id="toy.lm.v2")])
    with pytest.raises(ImplementationUnavailable, match="2 implementations fit"):
        registry.select("toy_lm", family_profile())


def test_needed_kernel_resolves_for_this_device():
    registry = Registry(
        implementations=[impl(kernels=["step"])],
        kernels=[Kernel("step", "cpu", fn=lambda: "cpu"), Kernel("step", "metal", fn=lambda: 0)],
    )
    binding = registry.select("toy_lm", family_profile())
    assert binding.backend == "cpu"
    assert binding.kernels["step"].backend == "cpu"


def test_needed_kernel_without_a_runnable_registration_is_refused():
    registry = Registry(
        implementations=[impl(kernels=["step"])],
        kernels=[Kernel("step", "metal", fn=lambda: 0, source="kernel void step() {}")],
    )
    with pytest.raises(KernelUnavailable) as err:
        registry.select("toy_lm", family_profile())
    assert "'step'" in err.value.message and "registered backends: metal" in err.value.message


def test_host_pinning_metal_without_metal_is_refused_naming_the_kernel():
    registry = Registry(
        implementations=[impl(kernels=["step"])],
        kernels=[Kernel("step", "cpu", fn=lambda: 0), Kernel("step", "metal", fn=lambda: 0)],
    ).with_(kernel_backend="metal")
    with pytest.raises(KernelUnavailable, match="Kernel 'step' is pinned to backend 'metal'"):
        registry.select("toy_lm", family_profile())
