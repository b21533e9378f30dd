"""The real ``loom`` command in a subprocess, tiny checkpoints of every family, and a terminal.

Every subprocess gets a private home: an empty Hugging Face cache (offline),
its own data directory (so chat history lands in the test's tmp dir), an
empty inputrc, and no plugin policy.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import mlx_loom
from mlx_loom.cli.main import main
from mlx_loom.testing.checkpoints import write_checkpoint

from .terminal import Terminal

#: One model type per family, plus Gemma 4's wrapper layout (text_config).
FAMILIES = ["llama", "qwen3_next", "gemma4_text", "gemma4"]


def loom_command() -> list[str]:
    """The installed console script next to this interpreter (the command users type)."""
    script = shutil.which("loom", path=str(Path(sys.executable).parent))
    return [script] if script else [sys.executable, "-m", "mlx_loom.cli.main"]


@pytest.fixture
def loom_env(tmp_path) -> dict[str, str]:
    home = tmp_path / "home"
    (home / "hub").mkdir(parents=True)
    (home / "inputrc").write_text("")
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("HF_", "HUGGINGFACE_", "MLX_LOOM_", "XDG_"))
    }
    env.update(
        HOME=str(home),
        XDG_DATA_HOME=str(home / "data"),
        HF_HUB_CACHE=str(home / "hub"),
        HF_HUB_OFFLINE="1",
        INPUTRC=str(home / "inputrc"),
        TERM="dumb",
        PYTHONUNBUFFERED="1",
    )
    return env


@pytest.fixture
def loom(loom_env, tmp_path) -> Callable[..., subprocess.CompletedProcess]:
    """``loom(*args, input=None)``: run the CLI to completion and capture its output."""

    def run(*args: str, input: str | None = None, env: dict[str, str] | None = None):
        return subprocess.run(
            [*loom_command(), *map(str, args)],
            input=input,
            capture_output=True,
            text=True,
            env={**loom_env, **(env or {})},
            cwd=tmp_path,
            timeout=120,
        )

    return run


@pytest.fixture
def terminal(loom_env, tmp_path) -> Callable[..., Terminal]:
    """``terminal(*args)``: ``loom ARGS`` on a pseudo-terminal, closed after the test."""
    opened: list[Terminal] = []

    def start(*args: str) -> Terminal:
        term = Terminal([*loom_command(), *map(str, args)], env=loom_env, cwd=tmp_path)
        opened.append(term)
        return term

    yield start
    for term in opened:
        term.close()


def family_checkpoint(root: Path, model_type: str, **text_config) -> Path:
    """The plugin's own tiny checkpoint for ``model_type``, with text-config overrides."""
    claim = mlx_loom.default_host().registry.model_types[model_type]
    config = dict(claim.tiny_config)
    if "text_config" in config:
        config["text_config"] = {**config["text_config"], **text_config}
    else:
        config.update(text_config)
    return write_checkpoint(root / model_type, config, claim.checkpoint_tensors(config))


@pytest.fixture(scope="session")
def short_context(tmp_path_factory) -> dict[str, Path]:
    """Every family with a 64-token context, so a few chat turns overflow it."""
    root = tmp_path_factory.mktemp("short-context")
    return {t: family_checkpoint(root, t, max_position_embeddings=64) for t in FAMILIES}


@pytest.fixture(scope="session")
def long_talker(tmp_path_factory) -> Path:
    """A random-weight Llama that greedily writes thousands of tokens without an EOS.

    Its context is large so an answer can stream long enough to be stopped by
    a Ctrl-C from the test.
    """
    root = tmp_path_factory.mktemp("long-talker")
    return family_checkpoint(root, "llama", max_position_embeddings=1 << 20)


@pytest.fixture
def chat(monkeypatch, capsys):
    """``chat(*args, input=...)`` -> (exit code, stdout, stderr) of ``loom chat ARGS``."""

    def run(*args: str, input: str) -> tuple[int, str, str]:
        monkeypatch.setattr("sys.stdin", io.StringIO(input))
        code = main(["chat", *map(str, args)])
        out, err = capsys.readouterr()
        return code, out, err

    return run
