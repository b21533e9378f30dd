"""Stop strings and stop token sequences, with hold-back.

A streamed reply must never show a stop string (or the start of one that turns
out to be a stop), yet must not withhold text longer than needed. Both matchers
here therefore release everything except the longest tail that is still a
proper prefix of some stop; that tail is held until the next input decides it.

When several stops could match, the one that *completes first* in the stream
wins (ties: the one that starts first, i.e. the longest). That is the answer a
char-by-char (or token-by-token) consumer would get, so the result does not
depend on how the input happens to be chunked.

:class:`StopStrings` works on text; :class:`StopTokenSequences` works on token
ids and is meant to sit *before* the detokenizer, so the text of a stop
sequence is never produced at all.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Generic, NamedTuple, TypeVar

from mlx_loom.errors import RequestError

T = TypeVar("T", str, tuple)


class StopCheck(NamedTuple, Generic[T]):
    """Result of feeding a matcher; unpacks as ``emit, stop = matcher.feed(...)``.

    ``emit``: what is safe to pass on now. ``stop``: the stop that matched, or
    ``None``; when set, ``emit`` is everything before the stop and the matcher
    accepts no more input.
    """

    emit: T
    stop: T | None = None

    @property
    def stopped(self) -> bool:
        return self.stop is not None


def _find(haystack: Sequence, needle: Sequence, start: int = 0) -> int:
    if isinstance(haystack, str):
        return haystack.find(needle, start)  # type: ignore[arg-type]
    n = len(needle)
    for i in range(start, len(haystack) - n + 1):
        if haystack[i : i + n] == needle:
            return i
    return -1


class _HoldBack(Generic[T]):
    """The shared algorithm over strings (of chars) or tuples (of token ids)."""

    def __init__(self, stops: Iterable[T], empty: T, what: str) -> None:
        self._stops: tuple[T, ...] = tuple(dict.fromkeys(stops))
        if any(len(s) == 0 for s in self._stops):
            raise RequestError(
                f"an empty {what} was given",
                fix=f"remove the empty entry from the {what}s",
            )
        self._empty: T = empty
        self._longest = max((len(s) for s in self._stops), default=0)
        self._held: T = empty
        self._stop: T | None = None

    @property
    def stops(self) -> tuple[T, ...]:
        return self._stops

    @property
    def held(self) -> T:
        """Input received but not yet released (a possible start of a stop)."""
        return self._held

    @property
    def stopped(self) -> bool:
        return self._stop is not None

    def _feed(self, chunk: T) -> StopCheck[T]:
        if self._stop is not None:
            return StopCheck(self._empty, self._stop)
        buffer = self._held + chunk
        best: tuple[int, int, T] | None = None  # (end, start, stop)
        for stop in self._stops:
            at = _find(buffer, stop)
            if at >= 0:
                candidate = (at + len(stop), at, stop)
                if best is None or candidate[:2] < best[:2]:
                    best = candidate
        if best is not None:
            _end, start, stop = best
            self._held = self._empty
            self._stop = stop
            return StopCheck(buffer[:start], stop)
        keep = self._partial_tail(buffer)
        cut = len(buffer) - keep
        self._held = buffer[cut:]
        return StopCheck(buffer[:cut])

    def _partial_tail(self, buffer: T) -> int:
        """Length of the longest tail of ``buffer`` that is a proper prefix of a stop."""
        for k in range(min(len(buffer), self._longest - 1), 0, -1):
            tail = buffer[len(buffer) - k :]
            if any(len(s) > k and s[:k] == tail for s in self._stops):
                return k
        return 0

    def _flush(self) -> T:
        held, self._held = self._held, self._empty
        return held if self._stop is None else self._empty


class StopStrings(_HoldBack[str]):
    """Hold back text that may begin a stop string; report a completed stop.

    >>> stops = StopStrings(["</s>", "\\nUser:"])
    >>> stops.feed("Hello</").emit
    'Hello'
    >>> check = stops.feed("s> more")
    >>> (check.emit, check.stop)
    ('', '</s>')
    """

    def __init__(self, stops: Iterable[str] = ()) -> None:
        super().__init__((str(s) for s in stops), "", "stop string")

    def feed(self, text: str) -> StopCheck[str]:
        """Consume streamed text; return what may be emitted and any stop reached."""
        return self._feed(text)

    def flush(self, text: str = "") -> str:
        """Generation ended: feed the last ``text``, then release the held tail.

        The held tail is real text once no more input can complete a stop. If
        ``text`` completes a stop, only what precedes the stop is returned.
        """
        check = self._feed(text)
        return check.emit if check.stopped else check.emit + self._flush()


class StopTokenSequences(_HoldBack[tuple]):
    """Hold back token ids that may begin a stop sequence; report a completed one.

    Place it before the detokenizer: feed each sampled id, pass ``emit`` ids on
    to the detokenizer, and end generation when ``stop`` is set. The ids of the
    stop sequence itself are never detokenized.
    """

    def __init__(self, sequences: Iterable[Sequence[int]] = ()) -> None:
        super().__init__((tuple(int(t) for t in s) for s in sequences), (), "stop token sequence")

    def feed(self, token_id: int) -> StopCheck[tuple]:
        """Consume one sampled id; return the ids now safe to detokenize and any stop."""
        return self._feed((int(token_id),))

    def flush(self) -> tuple[int, ...]:
        """Generation ended without a stop: release the held ids."""
        return self._flush()


# The name the generation loop imports for the text matcher.
