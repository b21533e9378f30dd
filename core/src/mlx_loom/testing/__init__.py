"""The conformance kit: prove that a model-family plugin honours the core's contracts.

For plugin authors::

    from mlx_loom.testing import run_conformance
    report = run_conformance("myfamily")          # the installed plugin
    report = run_conformance("myfamily", plugin=my_plugin_module)   # not installed
    assert report.passed, report.format()

The same suite runs as ``loom plugins check NAME``, and as pytest fixtures
(``loom_conformance``, ``loom_host``, ``loom_checkpoint``,
``loom_tiny_checkpoint``) that mlx-loom registers through the ``pytest11``
entry point. ``write_checkpoint`` writes tiny random-weight checkpoints in
Hugging Face layout with a small real tokenizer.

:mod:`mlx_loom.testing.parity` is the mlx-lm parity harness: tiny
checkpoints written from mlx-lm's own model classes in Hugging Face and MLX
layout (quantized too), both engines loaded, greedy tokens and logits held
bit-equal (mlx-lm, a test dependency, is imported only when it is used).
"""

from . import parity
from .checkpoints import random_tensors, write_checkpoint
from .conformance import CheckResult, ConformanceReport, plugin_host, run_conformance
from .tokenizer import write_tokenizer

__all__ = [
    "CheckResult",
    "ConformanceReport",
    "parity",
    "plugin_host",
    "random_tensors",
    "run_conformance",
    "write_checkpoint",
    "write_tokenizer",
]
