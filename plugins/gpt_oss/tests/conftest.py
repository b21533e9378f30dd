"""Fixtures of the gpt-oss tests; the helpers live in ``gpt_oss_testkit``."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # make gpt_oss_testkit importable
