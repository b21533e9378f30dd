"""Streaming detokenization: token ids in, final UTF-8 text out, one token at a time.

The contract: after feeding ``ids`` and calling :meth:`StreamingDetokenizer.finalize`,
the concatenated output equals ``tokenizers.Tokenizer.decode(ids)`` exactly —
for every prefix of every id sequence, including invalid byte sequences (they
become U+FFFD exactly where ``decode`` puts them). Text is released only once no
later token can change it, so a consumer never sees a broken multi-byte
character or a U+FFFD that a later byte would have completed.

How: ``decode`` applies the tokenizer's decoder chain to the list of token
strings. The chains real LLM checkpoints ship are streamable, so we interpret
them incrementally from the decoder's own serialization (no vocabulary-wide
tables, O(1) work per token):

* ``ByteLevel`` (GPT-2, Llama 3, Qwen): each token maps to bytes; the whole
  byte string is decoded as lossy UTF-8. We run an incremental UTF-8 decoder,
  which holds an incomplete trailing sequence and replaces invalid bytes the
  same way Rust's ``from_utf8_lossy`` does (checked by fuzzing in the tests).
* SentencePiece chains (Llama 2, Mistral, Gemma, T5): per-token ``Replace`` /
  ``Strip`` / ``Metaspace`` steps, optionally ``ByteFallback``, optionally
  ``Fuse`` followed by a leading ``Strip`` or single-character ``Replace``.
  ``ByteFallback`` turns a *whole run* of ``<0xHH>`` tokens into text if the
  run is valid UTF-8 and into one U+FFFD per byte otherwise, so a run is held
  until a non-byte token ends it (or :meth:`finalize`): releasing a valid
  prefix early could be contradicted by a later invalid byte in the same run.

Any other decoder falls back to windowed re-decoding through the tokenizer
itself (prefix/read offsets), which is still amortised O(1) per token.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import tokenizers

from mlx_loom.bounded_json import parse_json
from mlx_loom.errors import TokenizerError

REPLACEMENT = "\ufffd"


def _gpt2_char_to_byte() -> dict[str, int]:
    """The GPT-2 byte-to-printable-character table, inverted.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes are
    shifted to code points 256+n in byte order.
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


_CHAR_TO_BYTE = _gpt2_char_to_byte()


def _byte_token_value(token: str) -> int | None:
    """Value of a ``<0xHH>`` byte-fallback token, else ``None``."""
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        try:
            return int(token[3:5], 16)
        except ValueError:
            return None
    return None


# --- stages: one per decoder family -----------------------------------------


class _Stage:
    """Consumes decoder-input token strings; returns text that is now final."""

    def push(self, token: str) -> str:
        raise NotImplementedError

    def flush(self) -> str:
        raise NotImplementedError


class _ByteLevelStage(_Stage):
    def __init__(self, token_bytes: Callable[[str], bytes]) -> None:
        self._token_bytes = token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: str) -> str:
        return self._utf8.decode(self._token_bytes(token))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


PerTokenOp = Callable[[str, int], str]
StreamOp = Callable[[str], str]


class _PieceStage(_Stage):
    """Per-token steps, an optional ByteFallback run, then stream-level steps."""

    def __init__(
        self, pre: list[PerTokenOp], byte_fallback: bool, post: list[Callable[[], StreamOp]]
    ) -> None:
        self._pre = pre
        self._byte_fallback = byte_fallback
        self._post = [make() for make in post]
        self._index = 0
        self._run = bytearray()

    def push(self, token: str) -> str:
        index = self._index
        self._index += 1
        for op in self._pre:
            token = op(token, index)
        if self._byte_fallback:
            value = _byte_token_value(token)
            if value is not None:
                self._run.append(value)
                return ""
            token = self._end_run() + token
        return self._stream(token)

    def flush(self) -> str:
        return self._stream(self._end_run())

    def _end_run(self) -> str:
        if not self._run:
            return ""
        try:
            text = self._run.decode("utf-8")
        except UnicodeDecodeError:
            text = REPLACEMENT * len(self._run)  # ByteFallback: one per byte token
        self._run.clear()
        return text

    def _stream(self, text: str) -> str:
        for op in self._post:
            text = op(text)
        return text


def _replace_op(pattern: str, content: str) -> PerTokenOp:
    return lambda token, _index: token.replace(pattern, content)


def _strip_op(char: str, start: int, stop: int) -> PerTokenOp:
    def strip(token: str, _index: int) -> str:
        left = 0
        while left < start and left < len(token) and token[left] == char:
            left += 1
        right = len(token)
        while len(token) - right < stop and right > left and token[right - 1] == char:
            right -= 1
        return token[left:right]

    return strip


def _metaspace_op(replacement: str, prepend_scheme: str) -> PerTokenOp:
    # tokenizers' Metaspace decoder drops *every* replacement character of the
    # first decoder input (not only a leading one) unless the scheme is "never";
    # elsewhere it becomes a space. Verified against decoders.Metaspace in tests.
    def metaspace(token: str, index: int) -> str:
        if index == 0 and prepend_scheme != "never":
            return token.replace(replacement, "")
        return token.replace(replacement, " ")

    return metaspace


def _leading_strip(char: str, count: int) -> Callable[[], StreamOp]:
    """Strip up to ``count`` leading ``char`` from the start of the whole stream."""

    def make() -> StreamOp:
        state = {"left": count}

        def op(text: str) -> str:
            cut = 0
            while state["left"] > 0 and cut < len(text):
                if text[cut] != char:
                    state["left"] = 0
                    break
                cut += 1
                state["left"] -= 1
            return text[cut:]

        return op

    return make


def _stream_replace(pattern: str, content: str) -> Callable[[], StreamOp]:
    def make() -> StreamOp:
        return lambda text: text.replace(pattern, content)

    return make


# --- plan: which stage a tokenizer's decoder needs ---------------------------


class _Unsupported(Exception):
    """The decoder chain is not one we stream exactly; use windowed re-decoding."""


def _stage_factory(decoder: dict | None, token_bytes: Callable[[str], bytes]):
    if decoder is None:
        raise _Unsupported("no decoder")
    steps = decoder["decoders"] if decoder.get("type") == "Sequence" else [decoder]
    if steps and all(step.get("type") == "ByteLevel" for step in steps):
        # ByteLevel fuses into one string; a second ByteLevel would reinterpret
        # decoded text, which only the first can be streamed for.
        if len(steps) > 1:
            raise _Unsupported("repeated ByteLevel")
        return lambda: _ByteLevelStage(token_bytes)

    pre: list[PerTokenOp] = []
    post: list[Callable[[], StreamOp]] = []
    byte_fallback = False
    phase = "pre"  # pre -> after_byte_fallback -> fused
    for step in steps:
        kind = step.get("type")
        if phase == "fused":
            if kind == "Strip" and step.get("stop", 0) == 0 and len(step["content"]) == 1:
                post.append(_leading_strip(step["content"], int(step.get("start", 0))))
            elif kind == "Replace" and len(step["pattern"].get("String", "")) == 1:
                post.append(_stream_replace(step["pattern"]["String"], step["content"]))
            else:
                raise _Unsupported(f"{kind} after Fuse")
        elif kind == "Fuse":
            phase = "fused"
        elif phase == "after_byte_fallback":
            raise _Unsupported(f"{kind} between ByteFallback and Fuse")
        elif kind == "ByteFallback":
            byte_fallback = True
            phase = "after_byte_fallback"
        elif kind == "Replace" and "String" in step["pattern"]:
            pre.append(_replace_op(step["pattern"]["String"], step["content"]))
        elif kind == "Strip" and len(step["content"]) == 1:
            pre.append(_strip_op(step["content"], int(step["start"]), int(step["stop"])))
        elif kind == "Metaspace":
            scheme = step.get("prepend_scheme")
            if scheme is None:  # older serialization
                scheme = "always" if step.get("add_prefix_space", True) else "never"
            pre.append(_metaspace_op(step["replacement"], scheme))
        else:
            raise _Unsupported(str(kind))
    return lambda: _PieceStage(pre, byte_fallback, post)


@dataclass
class DecodePlan:
    """Everything a detokenizer needs from one tokenizer, built once and shared.

    The per-token caches grow only with tokens actually generated, so building
    a plan costs nothing proportional to the vocabulary.
    """

    backend: tokenizers.Tokenizer
    special_ids: frozenset[int]
    stage_factory: Callable[[], _Stage] | None
    reason_unsupported: str | None = None
    _token_cache: dict[int, str | None] = field(default_factory=dict, repr=False)
    _bytes_cache: dict[str, bytes] = field(default_factory=dict, repr=False)

    @classmethod
    def for_backend(cls, backend: tokenizers.Tokenizer) -> DecodePlan:
        special = frozenset(
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special
        )
        decoder = backend.decoder
        spec = None
        if decoder is not None:
            spec = parse_json(
                decoder.__getstate__(),
                source="tokenizer.json's decoder",
                error=TokenizerError,
                fix="re-save the tokenizer with the tokenizers library",
            )
        plan = cls(backend=backend, special_ids=special, stage_factory=None)
        try:
            plan.stage_factory = _stage_factory(spec, plan.token_bytes)
        except _Unsupported as exc:
            plan.reason_unsupported = str(exc)
        except (KeyError, TypeError) as exc:
            raise TokenizerError(
                f"tokenizer.json has a malformed decoder: {spec!r}",
                fix="re-save the tokenizer with the tokenizers library",
            ) from exc
        return plan

    def token(self, token_id: int) -> str | None:
        """Token string as ``decode`` sees it; ``None`` for ids outside the vocabulary."""
        try:
            return self._token_cache[token_id]
        except KeyError:
            token = self.backend.id_to_token(token_id) if token_id >= 0 else None
            self._token_cache[token_id] = token
            return token

    def token_bytes(self, token: str) -> bytes:
        """ByteLevel bytes of a token: mapped per character, or raw UTF-8 if any
        character is outside the GPT-2 table (as tokenizers does per token)."""
        try:
            return self._bytes_cache[token]
        except KeyError:
            try:
                value = bytes(_CHAR_TO_BYTE[c] for c in token)
            except KeyError:
                value = token.encode("utf-8")
            self._bytes_cache[token] = value
            return value


class StreamingDetokenizer:
    """Turn a stream of token ids into final text, one id at a time.

    Use :meth:`add_token` (returns the text that became final), or read
    :attr:`text` / :attr:`last_segment` after adding; call :meth:`finalize`
    when generation ends to flush anything held back.
    """

    def __init__(self, plan: DecodePlan, *, skip_special_tokens: bool = False) -> None:
        self._plan = plan
        self._skip_special = skip_special_tokens
        self.reset()

    def reset(self) -> None:
        """Forget all tokens and text; keep the tokenizer-derived plan."""
        self.tokens: list[int] = []
        self._chunks: list[str] = []
        self._unread: list[str] = []  # released since the last read of last_segment
        self._finalized = False
        factory = self._plan.stage_factory
        self._stage = factory() if factory is not None else None
        # Windowed fallback state: ids decoded together so boundary effects of
        # the decoder (a stripped leading space) fall inside the prefix window.
        self._prefix_offset = 0
        self._read_offset = 0

    # --- feeding ---------------------------------------------------------

    def add_token(self, token_id: int) -> str:
        """Consume one id; return the text it made final (often ``""``)."""
        if self._finalized:
            raise TokenizerError(
                "token added to a finalized detokenizer",
                fix="call reset() before streaming a new sequence",
            )
        token_id = int(token_id)
        self.tokens.append(token_id)
        if self._stage is None:
            return self._emit(self._window_step())
        if self._skip_special and token_id in self._plan.special_ids:
            return ""
        token = self._plan.token(token_id)
        if token is None:  # decode silently drops ids it has no token for
            return ""
        return self._emit(self._stage.push(token))

    def add_tokens(self, token_ids: Iterable[int]) -> str:
        """Consume several ids; return the text they made final."""
        return "".join(self.add_token(t) for t in token_ids)

    def finalize(self) -> str:
        """Flush held-back text; return it. After this, :attr:`text` equals ``decode(tokens)``."""
        if self._finalized:
            return ""
        self._finalized = True
        if self._stage is None:
            full = self._plan.backend.decode(self.tokens, skip_special_tokens=self._skip_special)
            return self._emit(full[len(self.text) :])
        return self._emit(self._stage.flush())

    # --- reading ---------------------------------------------------------

    @property
    def text(self) -> str:
        """All final text so far (O(length) to build: streaming loops should use
        :attr:`last_segment` or the return value of :meth:`add_token`)."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    @property
    def last_segment(self) -> str:
        """Final text produced since the previous read of this property."""
        segment = "".join(self._unread)
        self._unread.clear()
        return segment

    # --- internals -------------------------------------------------------

    def _emit(self, text: str) -> str:
        if text:
            self._chunks.append(text)
            self._unread.append(text)
        return text

    def _window_step(self) -> str:
        # Generic path for decoders we do not interpret: decode the window
        # [prefix_offset:] and release what goes beyond the already-read part,
        # unless it ends in U+FFFD (a possibly incomplete character).
        decode = self._plan.backend.decode
        skip = self._skip_special
        window = self.tokens[self._prefix_offset :]
        before = decode(window[: self._read_offset - self._prefix_offset], skip_special_tokens=skip)
        after = decode(window, skip_special_tokens=skip)
        grew = len(after) > len(before) and after.startswith(before)
        if grew and not after.endswith(REPLACEMENT):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.tokens)
            return after[len(before) :]
        return ""
