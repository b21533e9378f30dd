"""The conformance kit as pytest fixtures (registered through the ``pytest11`` entry point).

Installed with mlx-loom, so any plugin package's tests can use them without a
conftest:

``loom_host(*plugins, entry_points=False, policy=None)``
    an isolated :class:`~mlx_loom.host.PluginHost` (and so registry) for
    this test: only the ``(name, module_or_object)`` plugins handed in, unless
    ``entry_points=True``. The environment's plugin policy does not leak in.
``loom_checkpoint(config, tensors, *, name="model", seed=0, tokenizer=True)``
    a tiny random-weight checkpoint in Hugging Face layout under ``tmp_path``.
``loom_tiny_checkpoint(model_type, *, host, seed=0)``
    the same, from a registered model type's ``tiny_config`` and
    ``checkpoint_tensors``.
``loom_conformance(name, *, plugin=None, host=None, collisions=None)``
    run the conformance suite; returns a
    :class:`~mlx_loom.testing.ConformanceReport` (``assert report.passed,
    report.format()``). With ``plugin`` given, collisions with installed
    plugins are not checked unless ``collisions=True``.

Importing this module must stay cheap: pytest loads it in every run of every
project that has mlx-loom installed, so heavy imports happen inside fixtures.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest


def _core() -> Any:
    """The core's host and testing packages, imported when a fixture first runs: pytest
    loads this plugin in every session of a project that installs mlx-loom, and
    importing MLX and the host then would slow every one of them."""
    from mlx_loom import host, testing  # start-up time; see above

    return host, testing


@pytest.fixture
def loom_host(monkeypatch):
    """Factory for an isolated plugin host; the env's plugin policy is cleared for the test."""
    host, _ = _core()
    monkeypatch.delenv(host.POLICY_ENV, raising=False)
    monkeypatch.delenv(host.STRICT_ENV, raising=False)

    def make(*plugins: tuple[str, object], entry_points: bool = False, policy: Any = None) -> Any:
        return host.PluginHost(
            policy=policy or host.PluginPolicy(), plugins=plugins, entry_points=entry_points
        )

    return make


@pytest.fixture
def loom_checkpoint(tmp_path):
    """Factory writing a tiny checkpoint (config, random weights, tokenizer) under tmp_path."""
    write_checkpoint = _core()[1].write_checkpoint

    def make(
        config: Mapping[str, Any],
        tensors: Mapping[str, Any],
        *,
        name: str = "model",
        seed: int = 0,
        tokenizer: bool = True,
    ) -> Path:
        return write_checkpoint(tmp_path / name, config, tensors, seed=seed, tokenizer=tokenizer)

    return make


@pytest.fixture
def loom_tiny_checkpoint(tmp_path):
    """Factory writing the tiny checkpoint a registered model type declares."""
    write_checkpoint = _core()[1].write_checkpoint

    def make(model_type: str, *, host: Any, seed: int = 0, name: str | None = None) -> Path:
        mt = host.registry.model_type(model_type)
        if mt.tiny_config is None or mt.checkpoint_tensors is None:
            pytest.fail(f"model type {model_type!r} declares no tiny_config/checkpoint_tensors")
        config = dict(mt.tiny_config)
        return write_checkpoint(
            tmp_path / (name or f"{model_type}-seed{seed}"),
            config,
            mt.checkpoint_tensors(config),
            seed=seed,
        )

    return make


@pytest.fixture
def loom_conformance(tmp_path, monkeypatch):
    """Factory running the conformance suite against one plugin."""
    host, testing = _core()
    run_conformance = testing.run_conformance
    monkeypatch.delenv(host.POLICY_ENV, raising=False)
    monkeypatch.delenv(host.STRICT_ENV, raising=False)

    def run(
        name: str, *, plugin: object | None = None, host: Any = None, collisions: bool | None = None
    ):
        check_collisions = collisions if collisions is not None else plugin is None
        return run_conformance(
            name,
            plugin=plugin,
            host=host,
            workdir=tmp_path / "conformance",
            collisions=check_collisions,
        )

    return run
