"""Fixtures of the Qwen3 tests; the helpers live in ``qwen3_testkit``."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # make qwen3_testkit importable
