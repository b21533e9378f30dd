"""Plugin code under a time limit, with everything it can raise caught.

Importing a plugin, asking its API version and calling its hooks run plugin
code the host does not control. Each call runs on a fresh daemon worker
thread and the host waits at most ``timeout`` seconds for it:

* whatever the code raises — any ``Exception``, and ``BaseException``
  subclasses such as ``SystemExit``, ``GeneratorExit`` or a
  ``KeyboardInterrupt`` it raises itself — becomes a :class:`PluginFault`
  with the traceback, and the host quarantines the plugin;
* code still running after ``timeout`` is abandoned (a thread cannot be
  killed; it is a daemon, so it never keeps the process alive) and the
  plugin is quarantined for hanging.

The user's own Ctrl-C still stops the program: Python delivers signals to
the main thread only, so a real ``KeyboardInterrupt`` arrives in the thread
that is *waiting* (the caller) and propagates from here untouched, while one
raised by plugin code can only ever be raised on the worker.

Two consequences for plugin code, both documented for authors: it must not
rely on running in the caller's thread, and MLX arrays it leaves *lazy*
cannot be evaluated from another thread (MLX streams belong to the thread
that made them) — so after an import the host evaluates the module's
top-level arrays on the worker, and hooks should return registrations, not
arrays.

The limit defaults to :data:`DEFAULT_TIMEOUT` seconds per call and is tuned
with ``MLX_LOOM_PLUGIN_TIMEOUT`` (seconds) or ``PluginHost(timeout=...)``;
a plugin whose import legitimately takes longer (a large native extension
on a slow disk) needs a larger value.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from types import ModuleType
from typing import Any, TypeVar

import mlx.core as mx

from ..errors import LoomError, PolicyError

T = TypeVar("T")

TIMEOUT_ENV = "MLX_LOOM_PLUGIN_TIMEOUT"
#: Seconds one import or hook call may take before its plugin is quarantined.
DEFAULT_TIMEOUT = 60.0


class PluginFault(Exception):
    """Plugin code raised or hung; ``reason`` is one line, ``trace`` the traceback."""

    def __init__(self, reason: str, trace: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.trace = trace


def timeout_from_env(environ: dict[str, str] | None = None) -> float:
    env = os.environ if environ is None else environ
    raw = env.get(TIMEOUT_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (0 < value < float("inf")):
        raise PolicyError(
            f"{TIMEOUT_ENV}={raw!r} is not a positive number of seconds.",
            fix=f"Set {TIMEOUT_ENV} to a positive number, e.g. {DEFAULT_TIMEOUT:g}, or unset it.",
        )
    return value


def describe(err: BaseException) -> str:
    """``Type: message`` on one line, bounded (a plugin's message can be anything)."""
    try:
        text = err.message if isinstance(err, LoomError) else str(err)
    except Exception:  # noqa: BLE001 - a hostile __str__ must not escape
        text = "<message could not be read>"
    text = " ".join(text.split())
    if len(text) > 500:
        text = text[:497] + "..."
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def call(fn: Callable[[], T], *, what: str, timeout: float, raised: str | None = None) -> T:
    """Run ``fn()`` on a worker thread; its result, or :class:`PluginFault`.

    ``what`` names the call in the reason; ``raised`` replaces the default
    ``"<what> raised"`` prefix of the reason for an exception.
    """
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as err:  # noqa: BLE001 - anything plugin code raises is its fault
            outcome["error"] = err
            outcome["trace"] = traceback.format_exc()

    worker = threading.Thread(target=run, name=f"mlx-loom plugin call: {what}", daemon=True)
    worker.start()
    # Waiting in short slices keeps the wait interruptible however the
    # interrupt is raised (a real SIGINT, or an embedding IDE's
    # interrupt_main); a KeyboardInterrupt here is the user's and propagates.
    deadline = time.monotonic() + timeout
    while worker.is_alive() and (left := deadline - time.monotonic()) > 0:
        worker.join(min(left, 0.05))
    if worker.is_alive():
        raise PluginFault(
            f"{what} did not return within {timeout:g} s (the limit is set by {TIMEOUT_ENV})"
        )
    if "error" in outcome:
        prefix = raised if raised is not None else f"{what} raised"
        raise PluginFault(f"{prefix} {describe(outcome['error'])}", outcome["trace"])
    return outcome["value"]


def import_plugin(load: Callable[[], T], *, what: str, timeout: float) -> T:
    """Import a plugin through ``load`` and evaluate arrays it left lazy at module level.

    What the import prints goes to standard error (standard output may be
    the host's own machine-readable answer, ``loom plugins --json``). An
    import that changes the recursion limit or MLX's own attributes is
    undone and refused (:func:`._import_check.guard_globals`).
    """
    from ._import_check import guard_globals  # that module imports this one

    def load_and_settle() -> tuple[T, list[str]]:
        to_stderr = _ToStderr()
        with (
            contextlib.redirect_stdout(to_stderr),
            contextlib.redirect_stderr(to_stderr),
            guard_globals() as changed,
        ):
            obj = load()
        if not changed and isinstance(obj, ModuleType):
            arrays = [v for v in vars(obj).values() if isinstance(v, mx.array)]
            if arrays:
                mx.eval(arrays)
        return obj, changed

    obj, changed = call(load_and_settle, what=what, timeout=timeout, raised="import failed:")
    if changed:
        raise PluginFault("; ".join(changed))
    return obj


class _ToStderr(io.TextIOBase):
    """``sys.stdout``/``sys.stderr`` while a plugin imports: writes go to the
    real standard error; ``close()`` (a plugin closing "stdout") does nothing."""

    def __init__(self) -> None:
        self._target = sys.stderr

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        try:
            return self._target.write(text)
        except (OSError, ValueError):  # the real stream is gone: the text with it
            return len(text)

    def flush(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._target.flush()

    def close(self) -> None:
        pass
