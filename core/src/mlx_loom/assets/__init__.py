"""Data shipped with the core: the bundled tiny MiniCPM5-architecture model.

It is an artifact like any other — config, weights, tokenizer — and needs the
``mlx-loom-minicpm5`` plugin to run; without it ``loom generate`` refuses and
names the package to install. Its short name, ``tiny``, is accepted wherever
a model reference is (see :mod:`mlx_loom.artifacts.reference`).
"""

from pathlib import Path

#: The bundled model's directory name (also accepted as a model reference).
BUNDLED_MODEL_NAME = "tiny-minicpm5"
#: The short name ``loom generate --model tiny`` and ``mlx_loom.load("tiny")`` accept.
BUNDLED_MODEL_ALIAS = "tiny"
#: Where the bundled model lives inside the installed package.
BUNDLED_MODEL: Path = Path(__file__).parent / BUNDLED_MODEL_NAME
