"""Plugins that misbehave at import: quarantined with a reason, ``loom`` keeps going.

Before: a plugin hanging in a regex (holding the interpreter lock) was never
quarantined and ignored Ctrl-C; ``os._exit``, closing stdout or lowering the
recursion limit at import took ``loom`` down; ``print()`` at import corrupted
``loom plugins --json``; a plugin that monkeypatched MLX showed as loaded.
Each case installs a plugin (module + ``.dist-info``) in a directory on the
path and runs ``loom plugins --json`` in a bounded child process.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from .bounded import run_bounded

PLUGIN = """
from mlx_loom.plugin import PLUGIN_API_VERSION, hookimpl

{extra}

@hookimpl
def loom_plugin_api_version():
    return PLUGIN_API_VERSION
"""

LIMIT = 3  # seconds per plugin import (MLX_LOOM_PLUGIN_TIMEOUT)


def install(site: Path, name: str, extra: str = "") -> None:
    module = f"hostileplug_{name}"
    (site / f"{module}.py").write_text(PLUGIN.format(extra=extra))
    info = site / f"hostileplug_{name}-1.0.dist-info"
    info.mkdir()
    metadata = f"Metadata-Version: 2.1\nName: hostileplug-{name}\nVersion: 1.0\n"
    (info / "METADATA").write_text(metadata)
    (info / "entry_points.txt").write_text(f"[mlx_loom]\n{name} = {module}\n")


def plugins_json(site: Path, names: str, env: dict[str, str] | None = None) -> dict:
    """``loom plugins --json`` with the site on the path; its exit status and parsed output."""
    outcome = run_bounded(
        """
import subprocess, sys
done = subprocess.run(
    [sys.executable, "-m", "mlx_loom.cli.main", "plugins", "--json"],
    capture_output=True, text=True, timeout=90,
)
RESULT = {"rc": done.returncode, "stdout": done.stdout, "stderr": done.stderr[-3000:]}
""",
        env={
            "PYTHONPATH": os.pathsep.join([str(site), *sys.path]),
            "MLX_LOOM_PLUGINS": names,
            "MLX_LOOM_PLUGIN_TIMEOUT": str(LIMIT),
            **(env or {}),
        },
        timeout_s=100,
    )
    result = outcome.expect_ok()
    assert result["rc"] == 0, result
    payload = json.loads(result["stdout"])  # valid JSON, whatever the plugins printed
    return {p["name"]: p for p in payload["plugins"]}


@pytest.fixture
def site(tmp_path) -> Path:
    root = tmp_path / "site"
    root.mkdir()
    install(root, "good")
    return root


CASES = {
    "regex": (
        "import re\nre.match(r'(a+)+$', 'a' * 64 + 'b')",
        f"import did not return within {LIMIT} s",
    ),
    "exits": ("import os\nos._exit(3)", "import ended the process: it exited with status 3"),
    "aborts": ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", "killed by SIGKILL"),
    "closes": ("import sys\nsys.stdout.close()", "closed the process's stdout"),
    "closes_fd": ("import os\nos.close(1)", "closed the process's stdout"),
    "recursion": ("import sys\nsys.setrecursionlimit(60)", "changed the interpreter's recursion"),
    "patches": (
        "import mlx.core as mx\nmx.fast.rope = lambda *a, **k: None",
        "changed MLX itself at import (mlx.core.fast.rope)",
    ),
}


def test_each_hostile_import_is_quarantined_with_its_reason(site):
    for name, (extra, _) in CASES.items():
        install(site, name, extra)
    install(site, "talks", "print('hello from the plugin')\nprint('{not json')")
    records = plugins_json(site, ",".join(["good", "talks", *CASES]))
    for name, (_, reason) in CASES.items():
        assert records[name]["status"] == "quarantined", (name, records[name])
        assert reason in records[name]["reason"], (name, records[name]["reason"])
    assert records["good"]["status"] == "loaded"
    assert records["talks"]["status"] == "loaded"


def test_a_plugin_that_prints_at_import_leaves_the_json_valid(site):
    install(site, "talks", "print('hello from the plugin')\nimport sys\nsys.stdout.write('[')")
    records = plugins_json(site, "good,talks")
    assert records["talks"]["status"] == "loaded"


@pytest.mark.parametrize("name", ["patches", "recursion", "closes"])
def test_the_in_process_import_refuses_and_undoes_the_same(site, name):
    """With the child check off, the in-process import still catches what it can."""
    extra, reason = CASES[name]
    install(site, name, extra)
    records = plugins_json(site, f"good,{name}", env={"MLX_LOOM_PLUGIN_IMPORT_CHECK": "0"})
    if name == "closes":  # the import ran against a stand-in stdout: the JSON still came out
        assert records[name]["status"] == "loaded"
        return
    assert records[name]["status"] == "quarantined"
    assert reason in records[name]["reason"]


def test_a_monkeypatch_is_undone_in_process(tmp_path, monkeypatch):
    import mlx.core as mx

    from mlx_loom.host._import_check import guard_globals

    rope = mx.fast.rope
    with guard_globals() as changed:
        mx.fast.rope = None
        mx.brand_new = 1
    assert mx.fast.rope is rope and not hasattr(mx, "brand_new")
    assert "mlx.core.fast.rope" in changed[0] and "mlx.core.brand_new" in changed[0]


def test_ctrl_c_stops_loom_while_a_plugin_hangs_holding_the_interpreter_lock(site):
    install(site, "regex", CASES["regex"][0])
    outcome = run_bounded(
        """
import os, signal, subprocess, sys, time
proc = subprocess.Popen(
    [sys.executable, "-m", "mlx_loom.cli.main", "plugins", "--json"],
    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
)
time.sleep(ARGS["after"])
proc.send_signal(signal.SIGINT)
started = time.monotonic()
proc.communicate(timeout=30)
RESULT = {"rc": proc.returncode, "seconds": time.monotonic() - started}
""",
        args={"after": 6},
        env={
            "PYTHONPATH": os.pathsep.join([str(site), *sys.path]),
            "MLX_LOOM_PLUGINS": "good,regex",
            "MLX_LOOM_PLUGIN_TIMEOUT": "120",
        },
        timeout_s=60,
    )
    result = outcome.expect_ok()
    assert result["rc"] == 130 and result["seconds"] < 10, result
