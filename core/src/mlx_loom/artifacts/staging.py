"""Temporary names for files and directories written before they are renamed into place.

A prompt-cache file and a converted model are written under a temporary name
beside their target and renamed into place when complete, so a reader never
sees half a file. Two rules make that safe under concurrency and crashes:

* every writer gets its own name — the process id, then a random token — so
  two threads (or processes) saving to one path never write one file;
* a writer killed before its rename (``kill -9``, a power cut) leaves its
  temporary behind. The next write to the same target removes the
  temporaries whose owning process no longer exists on this machine. One
  whose owner is alive is left alone (it may still be writing), and so is
  any name this module did not make.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
from pathlib import Path

__all__ = ["remove_orphans", "temp_name"]


def temp_name(prefix: str, suffix: str = "") -> str:
    """``<prefix><pid>-<random><suffix>``: a name no other writer uses."""
    return f"{prefix}{os.getpid()}-{secrets.token_hex(6)}{suffix}"


def remove_orphans(directory: Path, prefix: str, suffix: str = "") -> list[Path]:
    """Remove what :func:`temp_name` made in ``directory`` for ``prefix`` whose
    owner is gone; return what was removed. Never raises for a file it cannot
    remove (another cleaner may have taken it first)."""
    pattern = re.compile(
        re.escape(prefix) + r"(\d{1,10})-[0-9a-f]{12}" + re.escape(suffix) + r"\Z"
    )
    removed: list[Path] = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        match = pattern.match(entry.name)
        if match is None or _alive(int(match.group(1))):
            continue
        path = Path(entry.path)
        try:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(path)
            else:
                path.unlink()
        except OSError:
            continue
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True  # exists (another user's), or unknowable: leave it
    return True
