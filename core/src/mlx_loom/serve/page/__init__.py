"""The chat page ``loom serve`` answers ``GET /`` with: one self-contained HTML file.

No CDN, no build step: ``index.html`` holds its CSS and JavaScript and is
shipped as package data, read once and cached.
"""

from __future__ import annotations

import functools
from importlib.resources import files


@functools.cache
def html() -> bytes:
    return files(__package__).joinpath("index.html").read_bytes()
