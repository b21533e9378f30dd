"""The adapter tests' session checkpoints (``base``), shared with the conversion tests."""

from __future__ import annotations

from ..adapters.conftest import base  # noqa: F401  (a fixture, re-exported for this directory)
