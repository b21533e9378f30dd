"""Import installed plugins once in a child process first, where a hang can be stopped.

The in-process import (:func:`._bounded.import_plugin`) runs on a worker
thread under a time limit, which stops a plugin that *waits*. It cannot stop
one that computes while holding the interpreter lock (a catastrophic regex
at import): the waiting thread never runs again, and neither does Ctrl-C.
Nor can any thread survive a plugin that calls ``os._exit`` or closes the
process's standard streams at import.

So before the host imports an installed plugin it has not imported yet, one
child interpreter imports each such plugin in turn and reports, per plugin,
whether the import finished and what it changed that the host cares about:

* it did not finish within the limit (the child is killed; the host goes on
  with the rest in a fresh child);
* it ended the child (``os._exit``, a signal);
* it closed standard input, output or error;
* it changed the interpreter's recursion limit;
* it changed attributes of ``mlx.core`` or ``mlx.core.fast`` (a monkeypatch
  of MLX changes the numerics of every family, not only its own).

Each is a reason to quarantine the plugin without importing it in-process.
An exception at import is *not* reported here: the in-process import raises
it again and quarantines the plugin with its traceback. What the plugin
prints goes nowhere in the child. A child that cannot start at all (no
progress report) leaves the decision to the in-process import.

The in-process import repeats the last two checks (:func:`guard_globals`) for
plugins handed in as objects and in case an import differs from the child's.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from ._bounded import TIMEOUT_ENV

#: ``MLX_LOOM_PLUGIN_IMPORT_CHECK=0`` skips the child (an embedding host that
#: vouches for its plugins saves its start-up, about a second).
IMPORT_CHECK_ENV = "MLX_LOOM_PLUGIN_IMPORT_CHECK"

#: The modules whose attributes a plugin import must leave alone.
WATCHED_MODULES = ("mlx.core", "mlx.core.fast")

#: Seconds the child may take to start (import MLX) before any plugin.
STARTUP_S = 60.0

_CHILD = r"""
import importlib, json, os, sys
report = os.fdopen(int(sys.argv[1]), "w", buffering=1)
entries = json.loads(sys.argv[2])
watched = json.loads(sys.argv[3])
from importlib_metadata import EntryPoint
modules = [importlib.import_module(name) for name in watched]
import mlx_loom.plugin  # the core's own import is start-up, not the first plugin's time

def snapshot():
    return {m.__name__ + "." + k: id(v) for m in modules for k, v in list(vars(m).items())}

def closed_streams():
    out = []
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        stream = getattr(sys, name, None)
        try:
            os.fstat(fd)
            gone = stream is None or stream.closed
        except (OSError, AttributeError):
            gone = True
        if gone:
            out.append(name)
    return out

report.write(json.dumps({"ready": True}) + "\n")
for name, value, group in entries:
    report.write(json.dumps({"start": name}) + "\n")
    before, limit = snapshot(), sys.getrecursionlimit()
    try:
        EntryPoint(name=name, value=value, group=group).load()
    except BaseException:
        pass  # the in-process import raises it again, with its traceback
    problems = []
    gone = closed_streams()
    if gone:
        problems.append("closed the process's " + " and ".join(gone))
        for fd, stream in enumerate(("stdin", "stdout", "stderr")):
            if stream in gone:  # fresh streams, so the next plugin is judged alone
                null = os.open(os.devnull, os.O_RDWR)
                if null != fd:
                    os.dup2(null, fd)
                    os.close(null)
                setattr(sys, stream, os.fdopen(fd, "r" if fd == 0 else "w", closefd=False))
    if sys.getrecursionlimit() != limit:
        problems.append(
            "changed the interpreter's recursion limit from %d to %d"
            % (limit, sys.getrecursionlimit())
        )
        sys.setrecursionlimit(limit)
    after = snapshot()
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    if changed:
        shown = ", ".join(changed[:8]) + (" ..." if len(changed) > 8 else "")
        problems.append("changed MLX itself at import (" + shown + ")")
    report.write(json.dumps({"done": name, "problems": problems}) + "\n")
os._exit(0)
"""


def module_of(value: str) -> str:
    """The module an entry point's ``module:attr`` value imports."""
    return value.split(":", 1)[0].strip()


def check_imports(entries: Sequence[tuple[str, str, str]], *, timeout: float) -> dict[str, str]:
    """Import each ``(name, value, group)`` entry point in a child; ``{name: reason}``.

    Only plugins whose import must be refused appear in the answer. After a
    plugin hangs or ends the child, the remaining ones go on in a new child.
    """
    reasons: dict[str, str] = {}
    if os.environ.get(IMPORT_CHECK_ENV, "").strip() == "0":
        return reasons
    pending = list(entries)
    while pending:
        finished, failed = _one_child(pending, timeout)
        if failed is None and not finished:
            break  # the child did not even start: the in-process import decides
        reasons.update({name: why for name, why in finished.items() if why})
        done = set(finished)
        if failed is not None:
            reasons[failed[0]] = failed[1]
            done.add(failed[0])
        pending = [e for e in pending if e[0] not in done]
    return reasons


def _one_child(
    entries: Sequence[tuple[str, str, str]], timeout: float
) -> tuple[dict[str, str], tuple[str, str] | None]:
    """Run one child over ``entries``: the plugins it finished (with a reason
    or ``""``), and the one it stopped on, if any, with why."""
    read_fd, write_fd = os.pipe()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    try:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _CHILD,
                str(write_fd),
                json.dumps([list(e) for e in entries]),
                json.dumps(WATCHED_MODULES),
            ],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=(write_fd,),
            start_new_session=True,  # its own process group: a kill takes all of it
        )
    except OSError:
        os.close(read_fd)
        os.close(write_fd)
        return {}, None
    os.close(write_fd)
    finished: dict[str, str] = {}
    current: str | None = None
    deadline = time.monotonic() + STARTUP_S
    buffer = b""
    try:
        with os.fdopen(read_fd, "rb", buffering=0) as pipe:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    _kill(proc)
                    if current is None:
                        return finished, None
                    return finished, (
                        current,
                        f"import did not return within {timeout:g} s (checked in a separate "
                        f"process, where a hang holding the interpreter lock can be stopped; "
                        f"the limit is set by {TIMEOUT_ENV})",
                    )
                ready, _, _ = select.select([pipe], [], [], min(left, 0.25))
                if not ready:
                    continue
                chunk = pipe.read(65536)
                if not chunk:
                    break
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    message = _message(line)
                    if "start" in message:
                        current = str(message["start"])
                        deadline = time.monotonic() + timeout
                    elif "done" in message:
                        finished[str(message["done"])] = "; ".join(map(str, message["problems"]))
                        current = None
                if len(finished) == len(entries):
                    break  # all reported: a process the plugin left holding the pipe is no wait
    except BaseException:  # the user's Ctrl-C while waiting: the child goes with it
        _kill(proc)
        raise
    finally:
        status = _reap(proc)
    if current is None:
        return finished, None
    if status < 0:
        try:
            signame = signal.Signals(-status).name
        except ValueError:
            signame = f"signal {-status}"
        ended = f"was killed by {signame}"
    else:
        ended = f"exited with status {status}"
    return finished, (current, f"import ended the process: it {ended} (os._exit, or a crash)")


def _message(line: bytes) -> dict[str, Any]:
    """One report line; anything else on the pipe (a plugin writing to it) is ignored."""
    try:
        message = json.loads(line)
    except ValueError:
        return {}
    if not isinstance(message, dict) or not isinstance(message.get("problems", []), list):
        return {}
    return message


def _kill(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _reap(proc: subprocess.Popen[bytes]) -> int:
    try:
        return proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        _kill(proc)
        return proc.wait()


def _watched_snapshot() -> dict[str, int]:
    out: dict[str, int] = {}
    for name in WATCHED_MODULES:
        module = importlib.import_module(name)
        out.update({f"{name}.{k}": id(v) for k, v in list(vars(module).items())})
    return out


@contextmanager
def guard_globals() -> Iterator[list[str]]:
    """Around an in-process import: yields a list that, after the block, holds
    what the import changed of the interpreter's recursion limit and the
    watched MLX attributes — each restored to what it was."""
    limit = sys.getrecursionlimit()
    modules = [importlib.import_module(name) for name in WATCHED_MODULES]
    saved = [dict(vars(m)) for m in modules]
    before = _watched_snapshot()
    problems: list[str] = []
    try:
        yield problems
    finally:
        if sys.getrecursionlimit() != limit:
            problems.append(
                f"changed the interpreter's recursion limit from {limit} to "
                f"{sys.getrecursionlimit()}"
            )
            sys.setrecursionlimit(limit)
        after = _watched_snapshot()
        changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        if changed:
            shown = ", ".join(changed[:8]) + (" ..." if len(changed) > 8 else "")
            problems.append(f"changed MLX itself at import ({shown})")
            for module, old in zip(modules, saved, strict=True):
                namespace = vars(module)
                for key in [k for k in namespace if k not in old]:
                    delattr(module, key)
                for key, value in old.items():
                    if namespace.get(key, _MISSING) is not value:
                        setattr(module, key, value)


_MISSING = object()
