"""The commands the README and the usage guide show are commands the CLI accepts."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from mlx_loom.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def code_blocks(text: str) -> list[str]:
    return re.findall(r"```[a-z]*\n(.*?)```", text, re.S)


def loom_examples(text: str) -> list[str]:
    """Lines of code blocks that run ``loom`` (a leading ``$`` prompt is dropped)."""
    found = []
    for block in code_blocks(text):
        for line in block.splitlines():
            line = line.removeprefix("$ ").split("  #")[0].strip()
            if line.startswith("loom ") and "[" not in line and "|" not in line:
                found.append(line)
    return found


def quick_start() -> list[str]:
    return [b.strip() for b in code_blocks(README) if b.startswith("python3 -m venv")]


@pytest.mark.parametrize(
    "line",
    loom_examples(README) + loom_examples((ROOT / "docs" / "usage.md").read_text()),
)
def test_documented_loom_commands_parse(line):
    build_parser().parse_args(shlex.split(line)[1:])  # a usage error would exit 2


def test_the_first_quick_start_command_shows_pip_progress():
    first, _ = quick_start()
    assert " -q " not in first and "--quiet" not in first
    assert first.endswith('loom generate "Once upon a time"')


def test_ci_runs_the_readme_test_command_verbatim():
    _, test_command = quick_start()
    assert test_command in (ROOT / ".ci" / "run").read_text().splitlines()


def launch_examples(text: str) -> list[str]:
    """Lines of code blocks that start ``loom`` under ``mlx.launch``."""
    return [
        line.strip()
        for block in code_blocks(text)
        for line in block.splitlines()
        if line.strip().startswith("mlx.launch ") and " loom " in line
    ]


@pytest.mark.parametrize("line", launch_examples((ROOT / "docs" / "distributed.md").read_text()))
def test_documented_launch_commands_reach_loom_whole(line, monkeypatch, tmp_path):
    # mlx.launch parses its own flags anywhere in the line (parse_known_args):
    # `loom generate ... -p "..."` lost its -p to the launcher's port. What
    # reaches each rank must be the loom command exactly as written.
    from mlx._distributed_utils import launch

    hosts = tmp_path / "hosts.json"
    hosts.write_text('[{"ssh": "localhost", "ips": ["127.0.0.1"]}]')
    argv = shlex.split(line.replace("hosts.json", str(hosts)))
    seen: list[list[str]] = []
    monkeypatch.setattr(launch, "launch_ring", lambda parser, hosts, args, rest: seen.append(rest))
    monkeypatch.setattr("sys.argv", argv)
    launch.main()
    written = argv[argv.index("loom") :]
    assert seen == [written]
    build_parser().parse_args(written[1:])


def test_the_architecture_page_states_the_plugin_api_version_the_code_speaks():
    from mlx_loom.plugin import PLUGIN_API_VERSION

    page = (ROOT / "docs" / "architecture.md").read_text()
    stated = re.search(r"the plugin-API version \((\d+\.\d+)\)", page)
    assert stated is not None and stated[1] == PLUGIN_API_VERSION
