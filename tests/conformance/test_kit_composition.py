"""The kit judges a plugin in company: implementation-only plugins, and collisions that would
change what other plugins' checkpoints resolve to. (minicpm5, installed with the repository,
is the family the plugins here build on or collide with.)"""

from __future__ import annotations

import types

import pytest

from mlx_loom.host import PluginHost, PluginPolicy, resolve_model
from mlx_loom.plugin import (
    GENERATE,
    PLUGIN_API_VERSION,
    Execution,
    Implementation,
    Profile,
    hookimpl,
)
from mlx_loom.testing import run_conformance
from mlx_loom_minicpm5.plugin import TINY_CONFIG, checkpoint_tensors

from . import tuned_plugin


def statuses(report):
    return {r.name: r.status for r in report.results}


@pytest.fixture(scope="module")
def tuned_report(tmp_path_factory):
    return run_conformance(
        tuned_plugin.NAME, plugin=tuned_plugin.module(), workdir=tmp_path_factory.mktemp("tuned")
    )


def test_an_implementation_only_plugin_conforms(tuned_report):
    assert tuned_report.passed, tuned_report.format()
    assert "implementation-only plugin" in tuned_report.result("registrations").detail


def test_the_kit_builds_the_owners_tiny_checkpoint_with_the_tuned_implementation(tuned_report):
    construct = tuned_report.result("construct[llama]")
    assert construct.status == "pass"
    assert f"implementation {tuned_plugin.IMPLEMENTATION}" in construct.detail
    assert tuned_report.result("forward[llama]").status == "pass"


def test_the_kit_checks_that_other_checkpoints_resolve_as_before(tuned_report):
    detail = tuned_report.result("no-collisions").detail
    assert "tiny checkpoints of ['llama'] resolve as before" in detail


def test_a_tuned_profile_that_captures_the_families_checkpoints_is_a_collision(tmp_path):
    # Fingerprints of minicpm5's own tiny checkpoint: the "tuned" profile would take it over.
    from mlx_loom.testing import write_checkpoint

    probe = write_checkpoint(tmp_path / "probe", TINY_CONFIG, checkpoint_tensors(TINY_CONFIG))
    summary = resolve_model(probe, host=PluginHost(policy=PluginPolicy.allow("minicpm5"))).summary
    greedy = tuned_plugin.module(
        artifact=summary.artifact_fingerprint, config=summary.config_fingerprint
    )
    report = run_conformance(tuned_plugin.NAME, plugin=greedy, workdir=tmp_path / "kit")
    result = report.result("no-collisions")
    assert result.status == "fail"
    assert "changes what another plugin's checkpoint resolves to" in result.detail
    assert "minicpm5/llama / minicpm5.llama -> tuned/artifact / tuned.llama" in result.detail


class Claimer:
    """A plugin adding a second family profile for minicpm5's model type."""

    @hookimpl
    def loom_plugin_api_version(self):
        return PLUGIN_API_VERSION

    @hookimpl
    def loom_implementations(self):
        return tuned_plugin.module().loom_implementations()

    @hookimpl
    def loom_profiles(self):
        return [
            Profile(
                id="tuned/llama",
                model_types=frozenset({"llama"}),
                execution=Execution(graph="tuned.llama", loader="minicpm5.hf-safetensors"),
                capabilities=frozenset({GENERATE}),
            )
        ]


def test_a_second_family_profile_for_another_plugins_model_type_is_a_collision(tmp_path):
    report = run_conformance("tuned", plugin=Claimer(), workdir=tmp_path)
    result = report.result("no-collisions")
    assert result.status == "fail" and "'llama'" in result.detail


def test_an_implementation_id_another_plugin_registers_is_a_collision(tmp_path):
    class Duplicate(Claimer):
        @hookimpl
        def loom_implementations(self):
            (impl,) = tuned_plugin.module().loom_implementations()
            return [Implementation(**{**vars_of(impl), "id": "minicpm5.llama"})]

        @hookimpl
        def loom_profiles(self):
            return []

    report = run_conformance("tuned", plugin=Duplicate(), workdir=tmp_path)
    result = report.result("no-collisions")
    assert result.status == "fail"
    assert "'minicpm5.llama' is registered twice" in result.detail
    assert "quarantines both" in result.detail


def test_an_implementation_only_profile_must_name_its_implementation(tmp_path):
    unnamed = tuned_plugin.module()
    (profile,) = unnamed.loom_profiles()
    bare = profile.model_copy(
        update={"execution": profile.execution.model_copy(update={"implementation": None})}
    )
    unnamed.loom_profiles = hookimpl(lambda: [bare])
    report = run_conformance("tuned", plugin=unnamed, workdir=tmp_path, collisions=False)
    detail = report.result("registrations").detail
    assert report.result("registrations").status == "fail"
    assert "must name the implementation it tunes" in detail


def test_an_implementation_no_profile_selects_fails_registrations(tmp_path):
    lonely = tuned_plugin.module()
    lonely.loom_profiles = hookimpl(lambda: [])
    report = run_conformance("tuned", plugin=lonely, workdir=tmp_path, collisions=False)
    detail = report.result("registrations").detail
    assert "'tuned.llama': no profile selects it" in detail


def test_an_implementation_only_plugin_for_an_unclaimed_model_type_fails(tmp_path):
    orphan = types.ModuleType("orphan")
    (impl,) = tuned_plugin.module().loom_implementations()
    (profile,) = tuned_plugin.module().loom_profiles()
    orphan.loom_plugin_api_version = hookimpl(lambda: PLUGIN_API_VERSION)
    orphan.loom_implementations = hookimpl(
        lambda: [Implementation(**{**vars_of(impl), "model_types": frozenset({"mamba9"})})]
    )
    orphan.loom_profiles = hookimpl(
        lambda: [profile.model_copy(update={"model_types": frozenset({"mamba9"})})]
    )
    report = run_conformance("tuned", plugin=orphan, workdir=tmp_path, collisions=False)
    assert "which no installed plugin claims" in report.result("registrations").detail


def vars_of(impl: Implementation) -> dict:
    return {f: getattr(impl, f) for f in impl.__dataclass_fields__ if f != "provider"}
