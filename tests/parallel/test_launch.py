"""The ``loom`` command itself under ``mlx.launch``: what a person at the terminal sees.

``mlx.launch`` merges every rank's output and hands stdin to every rank, so
these check the whole story at the real entry point: one copy of the answer,
the answer one process gives, and a refusal that says what would work.
(``mlx.launch`` itself exits 0 whatever the ranks do, and prints each failed
rank's exit code.)
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .support import mlx_launch

#: Each test launches two ranks of the real command: ~25 s each on 2 cores.
pytestmark = pytest.mark.slow

LOOM = shutil.which("loom", path=str(Path(sys.executable).parent))
ARGS = ["generate", "-p", "Once upon a time", "-m", "6", "--no-chat-template"]


def test_loom_generate_under_mlx_launch_prints_one_answer_the_single_process_one():
    alone = subprocess.run([LOOM, *ARGS], capture_output=True, text=True, timeout=120)
    assert alone.returncode == 0, alone.stderr
    launch = mlx_launch([LOOM, *ARGS, "--parallel", "pipeline"], timeout=180)
    assert launch.returncode == 0, launch.explain()
    assert launch.stdout == alone.stdout
    assert launch.stderr.count("Generation:") == 1
    assert "Parallel: pipeline across 2 ranks" in launch.stderr


def test_a_group_the_heads_do_not_fit_is_refused_with_the_sizes_that_work():
    # The bundled model: 6 heads, 2 key/value heads, intermediate 512, 4 layers.
    launch = mlx_launch([LOOM, *ARGS, "--parallel", "tensor"], timeout=180, ranks=3)
    # mlx.launch itself exits 0; it reports a rank's exit code (3: a refusal) and stops
    # the others.
    assert re.search(r"Node with rank \d exited with code 3", launch.stderr)
    assert "cannot run tensor parallel across 3 processes" in launch.stderr
    assert "num_key_value_heads = 2 does not divide across 3 processes" in launch.stderr
    assert "group sizes that would work: 2" in launch.stderr
    assert "use --parallel pipeline" in launch.stderr
