"""Run a snippet of Python in a child process under a time and memory bound; report what happened.

A hostile-input reproducer that regresses must fail its test, not hang the
suite or take the machine's memory with it. So risky cases run here::

    outcome = run_bounded(
        '''
        from mlx_loom.artifacts import read_config
        read_config(ARGS["model_dir"])
        ''',
        args={"model_dir": str(path)},
    )
    outcome.expect_error("ConfigError", "deeper than the limit")

The snippet runs with ``ARGS`` (the JSON-serialisable ``args``) in scope. It
may ``return``-by-assigning ``RESULT = ...`` (any JSON value) for the parent
to inspect. The child gets:

* a wall-clock bound (``timeout_s``), enforced by the parent, which kills the
  child's whole process group when it runs out;
* an address-space bound (``memory_mb``, ``RLIMIT_AS``), enforced by the
  kernel where it supports it (Linux; macOS ignores it, so there only the
  time bound holds). Importing MLX and running a tiny model needs ~100 MB
  resident and well under 1 GB of address space.

The outcome says whether the snippet finished, raised (with the exception's
type, ``message``/``fix`` for a ``LoomError``), ran out of time, or died by a
signal (an abort or a segfault: ``crashed``), plus its peak resident memory.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_TIMEOUT_S = 60.0
DEFAULT_MEMORY_MB = 1536

# The child's side: limits first, then the snippet, then its report as JSON in a file.
_BOOTSTRAP = r"""
import json, os, resource, sys, traceback
limit = int(os.environ["HOSTILE_MEMORY_BYTES"])
if limit > 0:
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
scope = {"ARGS": json.loads(os.environ["HOSTILE_ARGS"]), "__name__": "__hostile__"}
report = {"status": "ok"}
try:
    exec(compile(os.environ["HOSTILE_CODE"], "<hostile>", "exec"), scope)
    report["result"] = scope.get("RESULT")
except BaseException as exc:
    report = {
        "status": "raised",
        "type": type(exc).__name__,
        "mro": [c.__name__ for c in type(exc).__mro__],
        "message": str(getattr(exc, "message", exc)),
        "fix": getattr(exc, "fix", None),
        "traceback": traceback.format_exc()[-4000:],
    }
report["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
try:
    text = json.dumps(report)
except (TypeError, ValueError):
    report["result"] = repr(report.get("result"))[:4000]
    text = json.dumps(report)
with open(os.environ["HOSTILE_RESULT_PATH"], "w") as out:
    out.write(text)
os._exit(0)
"""


@dataclass
class Outcome:
    """What one bounded run did."""

    status: str  # "ok" | "raised" | "timeout" | "crashed"
    seconds: float
    returncode: int | None = None
    error_type: str | None = None
    error_mro: tuple[str, ...] = ()
    message: str | None = None
    fix: str | None = None
    result: Any = None
    peak_rss_mb: float | None = None
    stderr: str = ""
    traceback: str = ""

    def describe(self) -> str:
        head = f"status={self.status} after {self.seconds:.1f}s (rc={self.returncode})"
        if self.status == "raised":
            head += f": {self.error_type}: {self.message}\n{self.traceback}"
        return head + (f"\nstderr:\n{self.stderr[-3000:]}" if self.stderr else "")

    def expect_error(self, error_type: str, *needles: str) -> Outcome:
        """Assert the snippet raised ``error_type`` (or a subclass) whose message has ``needles``.

        A typed error also has to carry a fix.
        """
        assert self.status == "raised", self.describe()
        assert error_type in self.error_mro, self.describe()
        for needle in needles:
            assert needle in (self.message or ""), f"{needle!r} not in: {self.describe()}"
        if "LoomError" in self.error_mro:
            assert self.fix, f"typed error without a fix: {self.describe()}"
        return self

    def expect_ok(self) -> Any:
        """Assert the snippet finished; return its ``RESULT``."""
        assert self.status == "ok", self.describe()
        return self.result


def run_bounded(
    code: str,
    *,
    args: dict[str, Any] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    memory_mb: int | None = DEFAULT_MEMORY_MB,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> Outcome:
    """Run ``code`` (dedented) in a fresh interpreter under the bounds; never raises for it."""
    with tempfile.TemporaryDirectory(prefix="hostile-") as tmp:
        result_path = Path(tmp) / "outcome.json"
        child_env = {
            **os.environ,
            **(env or {}),
            "HOSTILE_CODE": textwrap.dedent(code),
            "HOSTILE_ARGS": json.dumps(args or {}),
            "HOSTILE_RESULT_PATH": str(result_path),
            "HOSTILE_MEMORY_BYTES": str((memory_mb or 0) << 20),
            "PYTHONFAULTHANDLER": "1",
        }
        started = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-c", _BOOTSTRAP],
            env=child_env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own process group, so a timeout kills all of it
        )
        try:
            _, stderr = proc.communicate(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _, stderr = proc.communicate()
            timed_out = True
        seconds = time.monotonic() - started
        raw = result_path.read_bytes() if result_path.exists() else b""
    text = stderr.decode("utf-8", "replace")
    if timed_out:
        return Outcome("timeout", seconds, proc.returncode, stderr=text)
    if not raw:
        return Outcome("crashed", seconds, proc.returncode, stderr=text)
    report = json.loads(raw)
    return Outcome(
        status=report["status"],
        seconds=seconds,
        returncode=proc.returncode,
        error_type=report.get("type"),
        error_mro=tuple(report.get("mro", ())),
        message=report.get("message"),
        fix=report.get("fix"),
        result=report.get("result"),
        peak_rss_mb=report.get("peak_rss_mb"),
        stderr=text,
        traceback=report.get("traceback", ""),
    )


def write_text(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` (creating parents) and return the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path
