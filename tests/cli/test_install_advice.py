"""Install and policy fixes that are true for how this installation was made."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

import pytest

from mlx_loom.host import PluginPolicy
from mlx_loom.host import _advice as advice
from mlx_loom.host._advice import allow_plugin_fix, install_command

from .conftest import family_checkpoint


class FakeDistribution:
    def __init__(self, direct_url: dict | None) -> None:
        self.direct_url = direct_url

    def read_text(self, name: str) -> str | None:
        assert name == "direct_url.json"
        return None if self.direct_url is None else json.dumps(self.direct_url)


def installed_from(monkeypatch, direct_url: dict | None) -> None:
    monkeypatch.setattr(advice.metadata, "distribution", lambda name: FakeDistribution(direct_url))


@pytest.fixture
def checkout(tmp_path) -> Path:
    """A clone of the repository: core/ and plugins/minicpm5/ with their pyproject files."""
    for part in ("core", "plugins/minicpm5"):
        (tmp_path / "repo" / part).mkdir(parents=True)
        (tmp_path / "repo" / part / "pyproject.toml").write_text("[project]\n")
    return tmp_path / "repo"


def test_an_editable_core_gets_the_editable_family_from_the_same_checkout(monkeypatch, checkout):
    installed_from(
        monkeypatch, {"url": (checkout / "core").as_uri(), "dir_info": {"editable": True}}
    )
    assert install_command("minicpm5", "mlx-loom-minicpm5") == (
        f"pip install -e {checkout / 'plugins' / 'minicpm5'}"
    )


def test_a_core_installed_from_a_directory_gets_the_family_directory(monkeypatch, checkout):
    installed_from(monkeypatch, {"url": (checkout / "core").as_uri(), "dir_info": {}})
    assert install_command("minicpm5", "mlx-loom-minicpm5") == (
        f"pip install {checkout / 'plugins' / 'minicpm5'}"
    )


def test_a_core_installed_from_a_wheel_gets_the_family_wheel_beside_it(monkeypatch, tmp_path):
    core = tmp_path / "mlx_loom-0.1.0-py3-none-any.whl"
    family = tmp_path / "mlx_loom_minicpm5-0.1.0-py3-none-any.whl"
    core.write_bytes(b"")
    family.write_bytes(b"")
    installed_from(monkeypatch, {"url": core.as_uri(), "archive_info": {}})
    assert install_command("minicpm5", "mlx-loom-minicpm5") == f"pip install {family}"


def test_a_wheel_without_its_family_beside_it_says_how_to_build_one(monkeypatch, tmp_path):
    core = tmp_path / "mlx_loom-0.1.0-py3-none-any.whl"
    core.write_bytes(b"")
    installed_from(monkeypatch, {"url": core.as_uri(), "archive_info": {}})
    fix = install_command("gemma4", "mlx-loom-gemma4")
    assert "pip install mlx-loom-gemma4" in fix and "pip wheel --no-deps plugins/gemma4" in fix


@pytest.mark.parametrize("direct_url", [None, {"url": "https://example.org/x.whl"}])
def test_a_core_from_an_index_gets_the_package_name(monkeypatch, direct_url):
    installed_from(monkeypatch, direct_url)
    assert install_command("qwen3_next", "mlx-loom-qwen3-next") == "pip install mlx-loom-qwen3-next"


def test_a_core_without_metadata_gets_the_package_name(monkeypatch):
    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(advice.metadata, "distribution", missing)
    assert install_command("gemma4", "mlx-loom-gemma4") == "pip install mlx-loom-gemma4"


@pytest.mark.parametrize(
    ("policy", "fix"),
    [
        (
            PluginPolicy.deny("minicpm5"),
            "Remove '-minicpm5' from MLX_LOOM_PLUGINS (it is the "
            "only entry, so unset MLX_LOOM_PLUGINS)",
        ),
        (
            PluginPolicy.deny("minicpm5", "gemma4"),
            "Remove '-minicpm5' from MLX_LOOM_PLUGINS (set MLX_LOOM_PLUGINS=-gemma4)",
        ),
        (
            PluginPolicy.allow("gemma4"),
            "Add 'minicpm5' to MLX_LOOM_PLUGINS (e.g. MLX_LOOM_PLUGINS=gemma4,minicpm5)",
        ),
        (PluginPolicy.none(), "Set MLX_LOOM_PLUGINS=minicpm5"),
    ],
)
def test_the_allow_fix_follows_the_form_of_the_policy(policy, fix):
    assert allow_plugin_fix("minicpm5", policy).startswith(fix)


def test_a_deny_policy_refusal_tells_the_user_to_remove_the_dash_name(loom):
    result = loom("generate", "-m", "2", env={"MLX_LOOM_PLUGINS": "-minicpm5"})
    assert result.returncode == 3
    assert "fix: Remove '-minicpm5' from MLX_LOOM_PLUGINS" in result.stderr
    assert "add 'minicpm5'" not in result.stderr.lower()


def test_the_not_installed_refusal_names_the_command_for_this_installation(tmp_path):
    """The real CLI with the core installed as it is here, and no family plugin."""
    site = tmp_path / "site"
    site.mkdir()
    families = ("mlx_loom_minicpm5", "mlx_loom_qwen3_next", "mlx_loom_gemma4", "mlx_loom_gpt_oss")
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        name = entry.name.lower().replace("-", "_")
        if not any(family in name for family in families):  # keep the core, drop the families
            (site / entry.name).symlink_to(entry)
    checkpoint = family_checkpoint(tmp_path, "llama")
    script = (
        f"import site, sys; site.addsitedir({str(site)!r}); "
        "from mlx_loom.cli.main import main; sys.exit(main(sys.argv[1:]))"
    )
    result = subprocess.run(
        [sys.executable, "-S", "-c", script, "explain", str(checkpoint)],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        timeout=120,
    )
    assert result.returncode == 3, result.stderr
    assert "needs the 'minicpm5' family plugin, which is not installed" in result.stderr
    assert f"fix: {install_command('minicpm5', 'mlx-loom-minicpm5')}" in result.stderr
