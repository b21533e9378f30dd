"""Reading what a person types into ``loom chat``: lines, multi-line messages, history.

At a terminal, ``input()`` goes through readline (line editing, Up/Down
through history, Tab to complete ``/commands``); the history persists in a
file under the user's data directory, readable only by them, unless the user
opts out. From a pipe, lines are read plainly and nothing is recorded.

A message is one line, or several when

* a line ends with a backslash (the backslash is dropped and the message
  continues on the next line), or
* it starts with ``\"\"\"``: everything up to a line ending in ``\"\"\"`` is
  one message (the same convention as Ollama's REPL).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType

__all__ = [
    "CONTINUATION_PROMPT",
    "HISTORY_ENV",
    "PROMPT",
    "EndOfInput",
    "LineReader",
    "data_dir",
    "default_history_path",
]

PROMPT = ">> "
CONTINUATION_PROMPT = "... "
BLOCK = '"""'
HISTORY_ENV = "MLX_LOOM_CHAT_HISTORY"
HISTORY_LENGTH = 1000


def data_dir() -> Path:
    """Where mlx-loom keeps per-user data, following each platform's convention."""
    home = Path.home()
    if sys.platform == "darwin":
        base = home / "Library" / "Application Support"
    elif os.name == "nt":
        base = Path(os.environ.get("APPDATA") or home / "AppData" / "Roaming")
    else:
        base = Path(os.environ.get("XDG_DATA_HOME") or home / ".local" / "share")
    return base / "mlx-loom"


def default_history_path() -> Path | None:
    """``$MLX_LOOM_CHAT_HISTORY`` if set (empty: no history), else ``<data dir>/chat_history``."""
    value = os.environ.get(HISTORY_ENV)
    if value is not None:
        return Path(value).expanduser() if value.strip() else None
    return data_dir() / "chat_history"


class EndOfInput(EOFError):
    """Input ended (Ctrl-D or the end of a pipe); ``unfinished`` if a message was cut off."""

    def __init__(self, unfinished: bool = False) -> None:
        super().__init__("end of input")
        self.unfinished = unfinished


class LineReader:
    """Reads one message at a time; use as a context manager to load and save history."""

    def __init__(
        self,
        *,
        interactive: bool,
        history: Path | None = None,
        commands: Iterable[str] = (),
    ) -> None:
        self.interactive = interactive
        self.history = history if interactive else None
        self._commands = sorted(commands)
        self._readline: ModuleType | None = None
        self.history_error: str | None = None

    # --- readline and history -----------------------------------------------------

    def __enter__(self) -> LineReader:
        if not self.interactive:
            return self
        try:
            import readline  # optional: absent on some platforms
        except ImportError:  # a Python built without readline: plain input() still works
            return self
        self._readline = readline
        readline.set_completer_delims(" \t\n")
        readline.set_completer(self._complete)
        if "libedit" in (readline.__doc__ or ""):
            readline.parse_and_bind("bind ^I rl_complete")
        else:
            readline.parse_and_bind("tab: complete")
        readline.set_history_length(HISTORY_LENGTH)
        if self.history is not None and self.history.is_file():
            try:
                readline.read_history_file(str(self.history))
            except OSError as err:
                self.history_error = f"cannot read the chat history {self.history}: {err}"
        return self

    def __exit__(self, *exc: object) -> None:
        readline, self._readline = self._readline, None
        if readline is None:
            return
        readline.set_completer(None)
        if self.history is None:
            return
        try:
            self.history.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            # Create it private before writing: chat history can hold anything typed.
            os.close(os.open(self.history, os.O_WRONLY | os.O_CREAT, 0o600))
            readline.write_history_file(str(self.history))
        except OSError as err:
            print(
                f"loom: warning: cannot save the chat history {self.history}: {err}",
                file=sys.stderr,
            )

    def _complete(self, text: str, state: int) -> str | None:
        matches = [c for c in self._commands if c.startswith(text)] if text.startswith("/") else []
        return matches[state] if state < len(matches) else None

    # --- reading ------------------------------------------------------------------

    def _line(self, prompt: str) -> str:
        return input(prompt if self.interactive else "")

    def read(self) -> str:
        """The next message, its continuation lines joined with newlines.

        Raises :class:`EndOfInput` at the end of input and lets
        ``KeyboardInterrupt`` through (a half-typed message is then dropped).
        """
        try:
            first = self._line(PROMPT)
        except EOFError:
            raise EndOfInput() from None
        if first.lstrip().startswith(BLOCK):
            return self._block(first.lstrip()[len(BLOCK) :])
        parts = []
        line = first
        while line.endswith("\\"):
            parts.append(line[:-1])
            line = self._more()
        parts.append(line)
        return "\n".join(parts)

    def _block(self, rest: str) -> str:
        parts = []
        line = rest
        while not line.rstrip().endswith(BLOCK):
            parts.append(line)
            line = self._more()
        parts.append(line.rstrip()[: -len(BLOCK)])
        return "\n".join(parts).strip("\n")

    def _more(self) -> str:
        try:
            return self._line(CONTINUATION_PROMPT)
        except EOFError:
            raise EndOfInput(unfinished=True) from None
