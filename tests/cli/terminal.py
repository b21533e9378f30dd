"""A command on a pseudo-terminal, driven like a person at a keyboard.

The child becomes the session leader with the pty as its controlling
terminal, so the keys a test sends behave as typed keys do: ``\\x03`` makes
the terminal driver send SIGINT, ``\\x04`` is end-of-file at an empty line,
and readline sees arrow keys and Ctrl-A. The child is started by
``subprocess`` (fork and exec in C), then claims the terminal and execs the
real command.
"""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time

CTRL_A, CTRL_C, CTRL_D = "\x01", "\x03", "\x04"
UP, LEFT = "\x1b[A", "\x1b[D"

_CLAIM_TTY = (
    "import fcntl, os, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
    "os.execv(sys.argv[1], sys.argv[1:])"
)


class Terminal:
    def __init__(self, argv: list[str], *, env: dict[str, str], cwd: os.PathLike) -> None:
        master, slave = pty.openpty()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _CLAIM_TTY, *argv],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=env,
            cwd=cwd,
            start_new_session=True,
            close_fds=True,
        )
        os.close(slave)
        self.fd = master
        self.output = ""  # everything the command has written so far
        self._seen = 0  # how much of it expect() has consumed

    def _read(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return True
        try:
            data = os.read(self.fd, 65536)
        except OSError:  # EIO: the child closed the terminal
            return False
        if not data:
            return False
        self.output += data.decode("utf-8", errors="replace")
        return True

    def expect(self, text: str, timeout: float = 60.0) -> str:
        """Wait until ``text`` appears after what was already consumed; return what led to it."""
        deadline = time.monotonic() + timeout
        while True:
            at = self.output.find(text, self._seen)
            if at >= 0:
                before = self.output[self._seen : at]
                self._seen = at + len(text)
                return before
            remaining = deadline - time.monotonic()
            open_ = remaining > 0 and self._read(min(remaining, 0.5))
            if not open_ and (remaining <= 0 or self.proc.poll() is not None):
                raise AssertionError(
                    f"{text!r} did not appear within {timeout}s; output so far:\n{self.output}"
                )
            if not open_:
                time.sleep(0.05)

    def send(self, keys: str) -> None:
        os.write(self.fd, keys.encode())

    def wait(self, timeout: float = 60.0) -> int:
        """Collect the rest of the output and the exit code."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self._read(0.2):
            pass
        return self.proc.wait(max(deadline - time.monotonic(), 1))

    def rest(self) -> str:
        """What was written after the last ``expect``."""
        return self.output[self._seen :]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        os.close(self.fd)
