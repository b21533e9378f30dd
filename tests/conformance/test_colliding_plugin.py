"""A plugin that claims a model type another installed plugin claims: both are
quarantined, and every command says so.

The template is scaffolded as ``llama`` (minicpm5's model type) and "installed"
as a distribution on ``sys.path``. The host quarantines both plugins;
``loom plugins check`` must then refuse (exit 3) for either name rather than
check it alone and report it conforms, and the fixes must say to uninstall or
disallow one of them. ``loom plugins new`` refuses the name up front.
"""

from __future__ import annotations

import sys

import pytest

import mlx_loom
from mlx_loom.cli.main import main
from mlx_loom.cli.plugins_new import write_plugin_package
from mlx_loom.errors import PluginUnavailable
from mlx_loom.host import PluginHost, PluginPolicy, resolve_model
from mlx_loom.testing.conformance import run_conformance

NAME = "llama"


@pytest.fixture
def collision(tmp_path, monkeypatch):
    write_plugin_package(NAME, tmp_path / "pkg")
    site = tmp_path / "site"
    site.mkdir()
    (site / f"mlx_loom_{NAME}").symlink_to(tmp_path / "pkg" / "src" / f"mlx_loom_{NAME}")
    info = site / f"mlx_loom_{NAME}-0.1.0.dist-info"
    info.mkdir()
    metadata = f"Metadata-Version: 2.1\nName: mlx-loom-{NAME}\nVersion: 0.1.0\n"
    (info / "METADATA").write_text(metadata)
    (info / "entry_points.txt").write_text(f"[mlx_loom]\n{NAME} = mlx_loom_{NAME}.plugin\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delenv("MLX_LOOM_PLUGINS", raising=False)
    before = set(sys.modules)
    yield
    for module in set(sys.modules) - before:
        if module.startswith(f"mlx_loom_{NAME}"):
            del sys.modules[module]


def test_both_colliding_plugins_are_quarantined_naming_each_other(collision):
    host = PluginHost()
    for name, other in ((NAME, "minicpm5"), ("minicpm5", NAME)):
        record = host.record(name)
        assert record is not None and record.status == "quarantined"
        assert record.conflicts_with == (other,)


@pytest.mark.parametrize("name", [NAME, "minicpm5"])
def test_check_refuses_a_quarantined_plugin_with_exit_3(collision, name, capsys):
    assert main(["plugins", "check", name]) == 3
    err = capsys.readouterr().err
    assert f"plugin {name!r}" in err and "is quarantined: conflicts with another plugin" in err
    assert "fix: Uninstall or disallow one of them" in err and "MLX_LOOM_PLUGINS=-" in err


def test_no_collisions_composes_with_a_partner_quarantined_for_the_collision(collision):
    # Checked alone (as a plugin author's own tests do), the partner must still
    # be composed with: it is quarantined only because of this very collision.
    report = run_conformance(NAME)
    check = next(r for r in report.results if r.name == "no-collisions")
    assert check.status == "fail" and "minicpm5" in check.detail
    assert not report.passed


def test_the_bundled_model_refusal_says_uninstall_or_disallow_not_reinstall(collision):
    with pytest.raises(PluginUnavailable) as info:
        resolve_model(mlx_loom.BUNDLED_MODEL, host=PluginHost())
    fix = info.value.fix
    assert "Uninstall or disallow one of them" in fix and "reinstall" not in fix
    assert f"MLX_LOOM_PLUGINS=-{NAME}" in fix or "MLX_LOOM_PLUGINS=-minicpm5" in fix


def test_the_disallow_fix_works(collision, monkeypatch):
    monkeypatch.setenv("MLX_LOOM_PLUGINS", f"-{NAME}")
    host = PluginHost(policy=PluginPolicy.from_env())
    assert host.record("minicpm5").status == "loaded"


def test_new_refuses_a_model_type_an_installed_plugin_claims(tmp_path, capsys):
    assert main(["plugins", "new", NAME, "--path", str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err
    assert "model_type 'llama' is already claimed by plugin 'minicpm5'" in err
    assert "fix:" in err and not (tmp_path / "x").exists()
