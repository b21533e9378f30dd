"""Plugin host: policy, quarantine, misspelt hooks, API versions, strict mode."""

import types

import pytest

from mlx_loom.errors import PluginError, PolicyError
from mlx_loom.host import PluginHost, PluginPolicy, hookimpl

from .toyfamily import ToyPlugin, family_profile


def host(*plugins, **kwargs) -> PluginHost:
    return PluginHost(plugins=list(plugins), entry_points=False, **kwargs)


def toy(name: str, model_type: str, *, profile_id: str | None = None) -> ToyPlugin:
    """A toy plugin whose ids are all its own (unless ``profile_id`` says otherwise)."""
    profile = family_profile(model_type, id=profile_id or f"{name}/{model_type}")
    return ToyPlugin(model_type=model_type, impl_id=f"{name}.lm", profiles=[profile])


def test_a_plugin_registers_and_is_recorded_with_its_provider():
    h = host(("toy", ToyPlugin()))
    record = h.record("toy")
    assert record.status == "loaded"
    assert record.registers["implementations"] == ("toy.lm.v1",)
    assert record.registers["profiles"] == ("toy/toy_lm",)
    impl = h.registry.implementations["toy.lm.v1"]
    assert impl.provider.plugin == "toy"
    assert h.registry.profile_provider("toy/toy_lm").plugin == "toy"


class Exploding:
    @hookimpl
    def loom_plugin_api_version(self):
        return "1.1"

    @hookimpl
    def loom_implementations(self):
        raise RuntimeError("weights table corrupt")


def test_a_plugin_raising_during_registration_is_quarantined_and_others_keep_working():
    h = host(("bad", Exploding()), ("toy", ToyPlugin()))
    bad = h.record("bad")
    assert bad.status == "quarantined"
    assert "loom_implementations raised RuntimeError: weights table corrupt" in bad.reason
    assert "Traceback" in bad.traceback
    assert h.record("toy").status == "loaded"
    assert "toy.lm.v1" in h.registry.implementations


class Misspelt:
    @hookimpl
    def loom_plugin_api_version(self):
        return "1.1"

    @hookimpl
    def loom_implementaions(self):
        return []


def test_a_misspelt_hook_quarantines_the_plugin_naming_the_hook():
    h = host(("typo", Misspelt()))
    record = h.record("typo")
    assert record.status == "quarantined"
    assert "loom_implementaions" in record.reason


def test_an_incompatible_plugin_api_is_refused_naming_both_versions():
    h = host(("old", ToyPlugin(api_version="0.9")))
    record = h.record("old")
    assert record.status == "quarantined"
    assert "plugin API 0.9" in record.reason and "plugin API 1.2" in record.reason


def test_a_plugin_that_does_not_declare_its_api_version_is_quarantined():
    plugin = types.SimpleNamespace()
    h = host(("silent", plugin))
    assert h.record("silent").status == "quarantined"
    assert "loom_plugin_api_version" in h.record("silent").reason


def test_a_registration_of_the_wrong_type_is_quarantined():
    class WrongType(ToyPlugin):
        @hookimpl
        def loom_profiles(self):
            return [{"id": "toy/dict"}]

    h = host(("wrong", WrongType()))
    assert "returned a dict; expected Profile" in h.record("wrong").reason


def test_an_invalid_profile_quarantines_its_plugin():
    bad = family_profile(capabilities=frozenset())
    h = host(("toy", ToyPlugin(profiles=[bad])))
    assert h.record("toy").status == "quarantined"
    assert "invalid profile" in h.record("toy").reason


def test_strict_mode_raises_instead_of_quarantining():
    with pytest.raises(PluginError, match="Plugin 'bad'"):
        host(("bad", Exploding()), strict=True)


def test_plugins_registering_the_same_id_are_both_quarantined_each_naming_the_other():
    h = host(
        ("a", ToyPlugin(model_type="m1")),
        ("b", ToyPlugin(model_type="m2")),
        (
            "c",
            ToyPlugin(model_type="m3", impl_id="c.lm", profiles=[family_profile("m3", id="c/m3")]),
        ),
    )
    a, b = h.record("a"), h.record("b")
    assert (a.status, b.status) == ("quarantined", "quarantined")
    assert "implementation 'toy.lm.v1' is also registered by b (in-process)" in a.reason
    assert "implementation 'toy.lm.v1' is also registered by a (in-process)" in b.reason
    assert h.record("c").status == "loaded"
    assert set(h.registry.implementations) == {"c.lm"}


def test_a_duplicate_profile_names_the_two_plugins_that_registered_it():
    h = host(
        (
            "a",
            ToyPlugin(model_type="m1", impl_id="a.lm", profiles=[family_profile("m1", id="p/x")]),
        ),
        (
            "b",
            ToyPlugin(model_type="m2", impl_id="b.lm", profiles=[family_profile("m2", id="p/x")]),
        ),
    )
    assert "profile 'p/x' is also registered by b (in-process)" in h.record("a").reason
    assert "profile 'p/x' is also registered by a (in-process)" in h.record("b").reason


def test_strict_mode_raises_on_a_conflict_between_plugins():
    with pytest.raises(PluginError, match="is also registered by"):
        host(("a", ToyPlugin(model_type="m1")), ("b", ToyPlugin(model_type="m2")), strict=True)


def test_allow_list_blocks_plugins_not_listed():
    h = host(
        ("a", ToyPlugin()),
        ("b", ToyPlugin(model_type="m2", impl_id="b.lm")),
        policy=PluginPolicy.allow("a"),
    )
    assert h.record("a").status == "loaded"
    assert h.record("b").status == "blocked"
    assert "blocked by plugin policy (allow a)" in h.record("b").reason
    assert "b.lm" not in h.registry.implementations


def test_deny_list_blocks_the_named_plugins():
    h = host(("a", ToyPlugin()), policy=PluginPolicy.deny("a"))
    assert h.record("a").status == "blocked"


def test_policy_none_blocks_everything():
    h = host(("a", ToyPlugin()), policy=PluginPolicy.none())
    assert h.record("a").status == "blocked"
    assert not h.registry.implementations


def test_a_policy_naming_an_uninstalled_plugin_is_an_error():
    with pytest.raises(PolicyError, match=r"names \['gemma5'\]"):
        host(("a", ToyPlugin()), policy=PluginPolicy.allow("a", "gemma5"))


@pytest.mark.parametrize(
    "value, mode, names",
    [
        ("", "none", set()),
        ("a,b", "allow", {"a", "b"}),
        (" a , b ", "allow", {"a", "b"}),
        ("-a,-b", "deny", {"a", "b"}),
        ("*", "all", set()),
    ],
)
def test_policy_environment_syntax(value, mode, names):
    policy = PluginPolicy.from_env({"MLX_LOOM_PLUGINS": value})
    assert policy.mode == mode and policy.names == names


def test_policy_environment_unset_allows_all():
    assert PluginPolicy.from_env({}).mode == "all"


def test_policy_environment_mixing_allow_and_deny_is_an_error():
    with pytest.raises(PolicyError, match="mixes"):
        PluginPolicy.parse("a,-b")
