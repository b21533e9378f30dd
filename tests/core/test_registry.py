"""Implementation registry: immutability, duplicates, composition, and selection by id."""

import pytest

from mlx_loom.cache import CACHE_KINDS, KVCache
from mlx_loom.errors import (
    ImplementationUnavailable,
    IncompatibleImplementation,
    KernelUnavailable,
    ProfileError,
    RegistrationError,
)
from mlx_loom.host import Execution, Implementation, Kernel, ModelType, Profile, Provider, Registry

from .toyfamily import GRAPH, LOADER, ToyConfig, build_toy, family_profile

FP_A, FP_C = "sha256:artifact", "sha256:config"


def provider(plugin: str) -> Provider:
    return Provider(plugin, f"mlx-loom-{plugin}", "0.3")


def impl(id=GRAPH, *, model_types=("toy_lm",), kernels=(), plugin="toy", **changes):
    fields = dict(
        id=id,
        graph=GRAPH,
        loader=LOADER,
        model_types=frozenset(model_types),
        factory=build_toy,
        kernels=tuple(kernels),
        capabilities=frozenset({"generate"}),
        provider=provider(plugin),
    )
    fields.update(changes)
    return Implementation(**fields)


def owned(profile: Profile, plugin: str = "toy") -> Profile:
    """The profile as a plugin's registration (the host tags it with its provider)."""
    return profile.model_copy(update={"provider": provider(plugin)})


def exact_profile(implementation=None, *, plugin="tuner", **execution) -> Profile:
    fields = dict(graph=GRAPH, loader=LOADER, specialization="artifact")
    fields.update(execution)
    return owned(
        Profile(
            id=f"{plugin}/exact",
            model_types=frozenset({"toy_lm"}),
            execution=Execution(implementation=implementation, **fields),
            artifact_fingerprint=FP_A,
            config_fingerprint=FP_C,
            capabilities=frozenset({"generate"}),
        ),
        plugin,
    )


def select_exact(registry: Registry, profile: Profile):
    return registry.select("toy_lm", profile, config_fingerprint=FP_C, artifact_fingerprint=FP_A)


# --- the selection rule ---------------------------------------------------------


def test_a_family_profile_selects_the_implementation_whose_id_is_its_graph():
    registry = Registry(implementations=[impl()], profiles=[owned(family_profile())])
    binding = registry.select("toy_lm", family_profile())
    assert binding.implementation.id == GRAPH
    assert binding.backend == "cpu"


def test_installing_more_implementations_of_the_graph_changes_no_family_resolution():
    tuned = [
        impl("toy.tuned", plugin="toy"),
        impl("tuner.fast", plugin="tuner"),
        impl("other.fast", plugin="other"),
    ]
    registry = Registry(implementations=[impl(), *tuned], profiles=[owned(family_profile())])
    assert registry.select("toy_lm", family_profile()).implementation.id == GRAPH


def test_an_exact_profile_gets_the_implementation_it_names_from_any_plugin():
    exact = exact_profile("tuner.fast")
    registry = Registry(
        implementations=[impl(), impl("tuner.fast", plugin="tuner")],
        profiles=[owned(family_profile()), exact],
    )
    assert select_exact(registry, exact).implementation.id == "tuner.fast"
    assert registry.select("toy_lm", family_profile()).implementation.id == GRAPH


def test_a_generated_profile_selects_the_graph_generated_implementation():
    generated = owned(
        family_profile(execution=Execution(graph=GRAPH, loader=LOADER, specialization="generated"))
    )
    registry = Registry(implementations=[impl(), impl(f"{GRAPH}-generated")], profiles=[generated])
    assert registry.select("toy_lm", generated).implementation.id == f"{GRAPH}-generated"


def test_a_generated_profile_without_its_generated_implementation_is_refused():
    generated = owned(
        family_profile(execution=Execution(graph=GRAPH, loader=LOADER, specialization="generated"))
    )
    registry = Registry(implementations=[impl()], profiles=[generated])
    with pytest.raises(ImplementationUnavailable, match=f"'{GRAPH}-generated'"):
        registry.select("toy_lm", generated)


@pytest.mark.parametrize(
    "change, named",
    [
        ({"graph": "other-graph"}, "graph"),
        ({"loader": "other"}, "loader"),
        ({"loop": "speculative"}, "loop"),
    ],
)
def test_a_named_implementation_that_differs_from_the_profile_is_refused_not_substituted(
    change, named
):
    capabilities = frozenset({"generate", "speculative"})
    exact = exact_profile("tuner.odd")
    registry = Registry(
        implementations=[
            impl(),
            impl("tuner.odd", plugin="tuner", capabilities=capabilities, **change),
        ],
        profiles=[owned(family_profile()), exact],
    )
    with pytest.raises(IncompatibleImplementation) as err:
        select_exact(registry, exact)
    assert "'tuner.odd'" in err.value.message and "never replaced" in err.value.message
    assert named in err.value.message


def test_a_family_profile_gets_no_implementation_but_the_one_its_graph_names():
    # Plugin API 1.0 gave such a profile its plugin's one implementation of the
    # graph; that rule is gone: the graph names the implementation, or nothing.
    registry = Registry(
        implementations=[impl("old.lm.v1", plugin="old")], profiles=[owned(family_profile(), "old")]
    )
    with pytest.raises(ImplementationUnavailable, match=f"selects implementation '{GRAPH}'"):
        registry.select("toy_lm", family_profile())


def test_another_plugins_implementation_is_never_a_default():
    registry = Registry(
        implementations=[impl("other.lm", plugin="other")],
        profiles=[owned(family_profile(), "old")],
    )
    with pytest.raises(ImplementationUnavailable, match=f"'{GRAPH}'"):
        registry.select("toy_lm", family_profile())


def test_an_implementation_named_like_another_plugins_graph_does_not_become_its_default():
    registry = Registry(
        implementations=[impl("old.lm.v1", plugin="old"), impl(GRAPH, plugin="intruder")],
        profiles=[owned(family_profile(), "old")],
    )
    with pytest.raises(ImplementationUnavailable, match="never a default"):
        registry.select("toy_lm", family_profile())


def test_a_profile_the_host_composed_may_use_any_plugins_implementation_by_id():
    registry = Registry(implementations=[impl(plugin="toy")]).with_(profiles=[family_profile()])
    assert registry.select("toy_lm", family_profile()).implementation.id == GRAPH


# --- select() re-validates what it is handed ------------------------------------


def test_select_refuses_a_profile_that_does_not_claim_the_model_type():
    registry = Registry(implementations=[impl(model_types=("toy_lm", "other"))])
    with pytest.raises(ProfileError, match="not 'other'"):
        registry.select("other", family_profile())


def test_select_refuses_an_exact_profile_without_the_artifacts_fingerprints():
    exact = exact_profile(GRAPH)
    registry = Registry(implementations=[impl()], profiles=[exact])
    with pytest.raises(ProfileError, match="is for artifact sha256:artifact"):
        registry.select("toy_lm", exact)
    with pytest.raises(ProfileError, match="this artifact is sha256:other"):
        registry.select(
            "toy_lm", exact, config_fingerprint=FP_C, artifact_fingerprint="sha256:other"
        )


def test_select_refuses_a_hand_built_profile_impersonating_a_registered_id():
    registry = Registry(implementations=[impl()], profiles=[owned(family_profile())])
    forged = family_profile(capabilities=frozenset({"generate", "batch"}))
    with pytest.raises(ProfileError, match="differs from the registered profile"):
        registry.select("toy_lm", forged)


def test_select_revalidates_a_profile_that_bypassed_construction():
    registry = Registry(implementations=[impl()])
    forged = Profile.model_construct(
        id="toy/forged",
        model_types=frozenset({"toy_lm"}),
        execution=Execution(graph=GRAPH, loader=LOADER),
        artifact_fingerprint=None,
        config_fingerprint=None,
        capabilities=frozenset(),  # the autoregressive loop needs 'generate'
        description="",
        provider=None,
    )
    with pytest.raises(ProfileError, match="implies capabilities"):
        registry.select("toy_lm", forged)


# --- registrations, composition, fit --------------------------------------------


def test_duplicate_implementation_id_names_both_providers():
    with pytest.raises(RegistrationError) as err:
        Registry(implementations=[impl(plugin="a"), impl(plugin="b")])
    assert "mlx-loom-a 0.3" in err.value.message and "mlx-loom-b 0.3" in err.value.message


def test_duplicate_profile_id_names_both_providers():
    with pytest.raises(RegistrationError) as err:
        Registry(profiles=[owned(family_profile(), "a"), owned(family_profile(), "b")])
    assert "by a (mlx-loom-a 0.3) and by b (mlx-loom-b 0.3)" in err.value.message


@pytest.mark.parametrize("field", ["id", "graph", "loader", "loop"])
@pytest.mark.parametrize("bad", ["", "   ", "has space", None, 123])
def test_blank_or_non_string_implementation_ids_are_refused_naming_the_field(field, bad):
    with pytest.raises(RegistrationError, match=f"Implementation.{field} must be"):
        impl(**{field: bad})


def test_an_implementation_with_a_non_callable_factory_is_refused():
    with pytest.raises(RegistrationError, match="Implementation.factory must be a callable"):
        impl(factory="mlx_loom_toy.build")


def test_a_bare_string_of_model_types_is_refused_not_split_into_characters():
    with pytest.raises(RegistrationError, match="Implementation.model_types"):
        Implementation(
            id=GRAPH, graph=GRAPH, loader=LOADER, model_types="toy_lm", factory=build_toy
        )


@pytest.mark.parametrize("bad", ["", " ", 123, None])
def test_blank_or_non_string_model_type_names_are_refused(bad):
    with pytest.raises(RegistrationError, match="ModelType.name must be"):
        ModelType(name=bad, schema=ToyConfig, fingerprint_fields=("vocab_size",))


def test_a_model_type_schema_must_be_a_pydantic_model_class():
    with pytest.raises(RegistrationError, match="schema must be a pydantic model class"):
        ModelType(name="toy_lm", schema=dict, fingerprint_fields=("vocab_size",))


@pytest.mark.parametrize("bad", ["", " ", 5])
def test_blank_or_non_string_kernel_names_are_refused(bad):
    with pytest.raises(RegistrationError, match="Kernel.name must be"):
        Kernel(bad, "cpu", fn=lambda: 0)


def test_an_unknown_kernel_backend_is_refused_on_construction():
    with pytest.raises(RegistrationError, match="backend 'vulkan'"):
        Kernel("step", "vulkan", fn=lambda: 0)


def test_registrations_are_frozen():
    registry = Registry(implementations=[impl()])
    snapshot = registry.implementations
    snapshot["other"] = impl(id="other")  # a copy: the registry is unaffected
    assert set(registry.implementations) == {GRAPH}
    with pytest.raises(AttributeError):
        registry.implementations[GRAPH].id = "changed"


def test_with_returns_a_new_registry_and_leaves_the_original():
    base = Registry(implementations=[impl()], profiles=[owned(family_profile())])
    extended = base.with_(implementations=[impl(id="toy.lm.v2")], kernel_backend="cpu")
    assert set(base.implementations) == {GRAPH}
    assert set(extended.implementations) == {GRAPH, "toy.lm.v2"}
    assert base.kernel_backend is None and extended.kernel_backend == "cpu"


def test_with_keeps_bindings_already_made():
    base = Registry(implementations=[impl()], profiles=[owned(family_profile())])
    binding = base.select("toy_lm", family_profile())
    narrowed = base.with_(allow_implementations=[GRAPH], kernel_backend="cpu")
    assert binding.implementation is base.implementations[GRAPH]
    assert narrowed.select("toy_lm", family_profile()).implementation.id == GRAPH


def test_a_named_implementation_that_is_missing_is_refused_not_substituted():
    exact = exact_profile("toy.fast")
    registry = Registry(implementations=[impl()], profiles=[exact])
    with pytest.raises(ImplementationUnavailable, match="requires implementation 'toy.fast'"):
        select_exact(registry, exact)


def test_no_implementation_for_the_profile_is_refused_naming_what_is_installed():
    registry = Registry(implementations=[impl("toy.other", graph="other")])
    with pytest.raises(ImplementationUnavailable) as err:
        registry.select("toy_lm", family_profile())
    assert f"selects implementation '{GRAPH}'" in err.value.message
    assert "'toy.other' from toy (mlx-loom-toy 0.3)" in err.value.message


def test_an_implementation_that_rejects_the_model_type_is_incompatible():
    registry = Registry(implementations=[impl(model_types=("other",))])
    with pytest.raises(IncompatibleImplementation, match="does not accept model_type 'toy_lm'"):
        registry.select("toy_lm", family_profile())


def test_missing_capability_makes_an_implementation_incompatible():
    registry = Registry(implementations=[impl()])
    profile = family_profile(capabilities=frozenset({"generate", "batch"}))
    with pytest.raises(IncompatibleImplementation, match=r"lacks capabilities \['batch'\]"):
        registry.select("toy_lm", profile)


def test_host_allow_list_permits_the_selected_implementation():
    registry = Registry(implementations=[impl(), impl(id="toy.lm.v2")])
    narrowed = registry.with_(allow_implementations=[GRAPH])
    assert narrowed.allowed_implementations == frozenset({GRAPH})
    assert narrowed.select("toy_lm", family_profile()).implementation.id == GRAPH


def test_host_allow_list_excluding_the_selected_implementation_is_refused_not_swapped():
    registry = Registry(implementations=[impl(), impl(id="toy.lm.v2")])
    narrowed = registry.with_(allow_implementations=["toy.lm.v2"])
    with pytest.raises(ImplementationUnavailable, match="the host allows only"):
        narrowed.select("toy_lm", family_profile())


def test_allowing_an_unknown_implementation_id_is_an_error():
    with pytest.raises(ImplementationUnavailable, match="'toy.nope'"):
        Registry(implementations=[impl()]).with_(allow_implementations=["toy.nope"])


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


# --- cache kinds ----------------------------------------------------------------


class ToyStateCache:
    kind = "ToyStateCache"

    @classmethod
    def from_state(cls, state, meta_state):
        return cls()


def test_every_registry_knows_the_core_cache_kinds_and_bindings_carry_them():
    registry = Registry(implementations=[impl()])
    assert dict(registry.cache_kinds) == dict(CACHE_KINDS)
    binding = registry.select("toy_lm", family_profile())
    assert binding.cache_kinds["KVCache"] is KVCache


def test_a_registered_cache_kind_joins_the_table():
    registry = Registry(implementations=[impl()], cache_kinds=[ToyStateCache])
    assert registry.cache_kinds["ToyStateCache"] is ToyStateCache
    assert registry.with_().cache_kinds["ToyStateCache"] is ToyStateCache


def test_a_cache_kind_reusing_a_core_kind_name_is_refused():
    class Impostor(ToyStateCache):
        kind = "KVCache"

    with pytest.raises(RegistrationError, match="Cache kind 'KVCache' is claimed by both"):
        Registry(cache_kinds=[Impostor])


def test_a_cache_kind_without_from_state_is_refused():
    class NoState:
        kind = "NoState"

    with pytest.raises(RegistrationError, match="from_state"):
        Registry(cache_kinds=[NoState])


@pytest.mark.parametrize(
    ("plugins", "said", "fix"),
    [
        (
            ("toy", "other"),
            ": by toy (mlx-loom-toy 0.3) and by other (mlx-loom-other 0.3)",
            "Uninstall",
        ),
        (("toy", "toy"), ", both times by toy (mlx-loom-toy 0.3)", "Register it once in toy"),
        ((None, None), " (both registrations were passed in directly", "Pass each registration"),
    ],
)
def test_an_id_registered_twice_names_who_did_it_without_a_vague_repeat(plugins, said, fix):
    # Before: registrations without a provider read "by a plugin and by a plugin".
    twins = [impl(plugin=p) if p else impl(provider=None) for p in plugins]
    with pytest.raises(RegistrationError) as err:
        Registry(implementations=twins)
    message = err.value.message
    assert message.startswith(f"Implementation id {GRAPH!r} is registered twice{said}")
    assert "by a plugin and by a plugin" not in message and err.value.fix.startswith(fix)
