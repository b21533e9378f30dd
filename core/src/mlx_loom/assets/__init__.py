"""Data shipped with the core: the bundled tiny MiniCPM5-architecture model.

It is an artifact like any other — config, weights, tokenizer — and needs the
``mlx-loom-minicpm5`` plugin to run; without it ``loom generate`` refuses and
names the package to install.
"""

from pathlib import Path

BUNDLED_MODEL = "tiny-minicpm5"


def default_model_path() -> Path:
    """Where the bundled model lives inside the installed package."""
    return Path(__file__).parent / BUNDLED_MODEL
