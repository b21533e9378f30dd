"""The hostile-input suite: every reproducer of a crash, hang or exhaustion, kept fixed.

Each test feeds the engine one hostile input through one door (the Python
API, ``loom generate``/``chat``/``serve``/``explain``, the HTTP server) and
asserts the typed error it must get — never a crash, a hang, an untyped
exception or a multi-GB allocation. Cases that would take the test process
down if they regressed (allocations of gigabytes, CPU for minutes, native
aborts) run in a child process under a time and memory bound with
:func:`tests.hostile.bounded.run_bounded`; cases whose failure is merely a
wrong exception run in-process.

To add a reproducer: pick the file for its class (JSON, templates,
prompt-cache files, quantization claims — or start a new ``test_<class>.py``),
build the hostile artifact with :func:`variant` from one of the
``family_dirs`` checkpoints, and assert the typed error. Run it bounded if a
regression could exhaust memory or time::

    outcome = run_bounded(
        '''
        import mlx_loom
        mlx_loom.load(ARGS["path"])
        ''',
        args={"path": str(path)},
        timeout_s=30,
    )
    outcome.expect_error("ConfigError", "num_hidden_layers")
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import mlx_loom
from mlx_loom.testing.checkpoints import write_checkpoint

#: One model type per family plugin: attention (minicpm5), hybrid recurrent
#: (qwen3_next), sliding window with shared KV (gemma4).
FAMILIES = ("llama", "qwen3_next", "gemma4_text")


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory) -> dict[str, Path]:
    """A tiny checkpoint (config, weights, tokenizer with a chat template) per family."""
    out = {}
    for name in FAMILIES:
        claim = mlx_loom.default_host().registry.model_types[name]
        path = tmp_path_factory.mktemp(f"hostile-{name}") / "ckpt"
        out[name] = write_checkpoint(
            path, claim.tiny_config, claim.checkpoint_tensors(claim.tiny_config)
        )
    return out


def variant(
    source: Path,
    target: Path,
    *,
    config: Callable[[dict[str, Any]], Any] | None = None,
    files: dict[str, str | bytes] | None = None,
) -> Path:
    """A copy of the checkpoint ``source`` at ``target``, made hostile.

    ``config`` edits the parsed ``config.json`` in place; ``files`` replaces
    whole files (text or bytes) by name — the raw way to write JSON that no
    JSON library would produce.
    """
    shutil.copytree(source, target)
    if config is not None:
        data = json.loads((target / "config.json").read_text())
        config(data)
        (target / "config.json").write_text(json.dumps(data))
    for name, content in (files or {}).items():
        path = target / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")
    return target
