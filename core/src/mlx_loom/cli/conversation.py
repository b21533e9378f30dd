"""A chat's conversation: the full transcript, the window the model sees, and its file format.

The model has a fixed context (``max_position_embeddings``, or less when
``--max-kv-size`` asks for less). A conversation outgrows it after a few
turns — on the bundled 256-token model, by the third. Rather than failing
every later turn, the window the model sees drops the oldest whole turns (a
user message and its reply together, so the roles still alternate, which
many chat templates insist on) and always keeps the system message.

The budget is computed here, from the model's declared context and the
rendered prompt's length, not from the generation engine's internals:

* each turn reserves room for a reply of ``min(max_tokens, budget // 2)``
  tokens, and old turns are dropped until the prompt leaves that room;
* the reply is then capped at whatever room is left, so prompt plus reply
  never exceeds the budget — whatever the engine would do at the limit.

Dropped turns leave the window, not the transcript: ``/save`` writes every
message, so nothing typed or answered is lost.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..bounded_json import JsonLimits, read_json_file
from ..errors import RequestError

__all__ = [
    "MAX_CONVERSATION_BYTES",
    "ChatMessage",
    "Conversation",
    "SavedConversation",
    "TurnPlan",
]

#: Largest conversation file ``/load`` reads. Far above any real chat (a
#: 128K-token context is ~0.5 MB of text); it bounds memory for a wrong or
#: hostile file before the JSON parser sees it.
MAX_CONVERSATION_BYTES = 16 * 1024 * 1024
FORMAT: Literal["mlx-loom-chat"] = "mlx-loom-chat"


class ChatMessage(BaseModel):
    """One message, in the role/content shape every chat API uses."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    role: Literal["system", "user", "assistant"]
    content: str


class SavedConversation(BaseModel):
    """The ``/save`` file: OpenAI-shaped ``messages``, the system message first if any.

    ``/load`` also accepts a bare list of messages, so a conversation saved by
    another tool in the common shape loads too.
    """

    model_config = ConfigDict(frozen=True, extra="ignore")

    format: Literal["mlx-loom-chat"] = FORMAT
    version: Literal[1] = 1
    model: str | None = None
    messages: list[ChatMessage] = Field(default_factory=list)


@dataclass(frozen=True)
class TurnPlan:
    """What the next generation will see: its prompt ids and how long it may answer."""

    prompt: list[int]
    max_tokens: int
    dropped: int  # turns newly dropped from the window for this prompt


@dataclass
class Conversation:
    """The transcript plus where the model's window starts.

    ``window_start`` only moves forward: once a turn has left the window it
    stays out (until ``reset``/``load``), so the window does not flap and the
    prompt cache keeps a stable prefix.
    """

    system: str | None = None
    messages: list[ChatMessage] = field(default_factory=list)
    window_start: int = 0

    # --- editing ----------------------------------------------------------------

    def add(self, role: Literal["user", "assistant"], content: str) -> None:
        self.messages.append(ChatMessage(role=role, content=content))

    def pop_user(self) -> None:
        """Withdraw a user message whose turn failed before any reply."""
        if self.messages and self.messages[-1].role == "user":
            self.messages.pop()

    def reset(self) -> None:
        """Forget every turn; the system message stays."""
        self.messages.clear()
        self.window_start = 0

    @property
    def turns(self) -> int:
        return sum(1 for m in self.messages if m.role == "user")

    def window(self) -> list[dict[str, str]]:
        """The messages the model sees, as template-ready dicts."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [m.model_dump() for m in self.messages[self.window_start :]]

    # --- fitting the context ----------------------------------------------------

    def plan(
        self,
        encode: Callable[[list[dict[str, str]]], list[int]],
        *,
        budget: int | None,
        max_tokens: int,
    ) -> TurnPlan:
        """Fit the window (ending in the new user message) into ``budget`` tokens.

        Raises :class:`RequestError` when even the system message and the new
        message alone leave no room for a reply; the caller withdraws the
        message and the conversation is unchanged.
        """
        prompt = encode(self.window())
        if budget is None:
            return TurnPlan(prompt, max_tokens, 0)
        reserve = min(max_tokens, max(budget // 2, 1))
        dropped = 0
        while len(prompt) + reserve > budget:
            later = self._next_turn_start()
            if later is None:
                break
            self.window_start = later
            dropped += 1
            prompt = encode(self.window())
        room = budget - len(prompt)
        if room < 1:
            including = ", the system message included," if self.system else ""
            raise RequestError(
                f"The message is too long for the chat: the prompt{including} is "
                f"{len(prompt)} tokens and the context budget is {budget}.",
                fix="Send a shorter message (or a shorter /system message), or raise "
                "--max-kv-size if the model's context allows it.",
            )
        return TurnPlan(prompt, min(max_tokens, room), dropped)

    def _next_turn_start(self) -> int | None:
        """Index of the second user message in the window (the turn after the oldest)."""
        users = [
            i
            for i in range(self.window_start, len(self.messages))
            if self.messages[i].role == "user"
        ]
        return users[1] if len(users) > 1 else None

    # --- files ------------------------------------------------------------------

    def save(self, path: Path, *, model: str | None = None) -> None:
        """Write the whole transcript (dropped turns included) as JSON."""
        head = [ChatMessage(role="system", content=self.system)] if self.system else []
        saved = SavedConversation(model=model, messages=head + list(self.messages))
        text = json.dumps(saved.model_dump(mode="json"), indent=2, ensure_ascii=False)
        try:
            path.write_text(text + "\n", encoding="utf-8")
        except OSError as err:
            raise RequestError(
                f"Cannot save the conversation to {path}: {err.strerror or err}.",
                fix="Pass a path in a directory that exists and that you can write to.",
            ) from err

    @classmethod
    def load(cls, path: Path) -> Conversation:
        """Read a conversation written by :meth:`save` (or a bare list of messages)."""
        saved = _read_saved(path)
        messages = list(saved.messages)
        system = None
        if messages and messages[0].role == "system":
            system = messages.pop(0).content
        _check_roles(messages, path)
        return cls(system=system, messages=messages)


def _read_saved(path: Path) -> SavedConversation:
    fix = "Pass a file written by /save: JSON with a 'messages' list of {role, content}."
    # Bounded like every JSON the engine reads: size before reading, nesting,
    # containers and integer length before parsing, text that is valid Unicode.
    limits = JsonLimits(max_bytes=MAX_CONVERSATION_BYTES, allow_lone_surrogates=False)
    try:
        data: Any = read_json_file(path, error=RequestError, fix=fix, limits=limits)
    except FileNotFoundError as err:
        raise RequestError(
            f"Cannot read {path}: {err.strerror or err}.", fix="Check the path."
        ) from err
    if isinstance(data, list):
        data = {"messages": data}
    if not isinstance(data, dict):
        raise RequestError(f"{path} holds a JSON {type(data).__name__}, not an object.", fix=fix)
    try:
        return SavedConversation.model_validate(data)
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"]) or "the top level"
        raise RequestError(f"{path}: {where}: {first['msg']}.", fix=fix) from None


def _check_roles(messages: Sequence[ChatMessage], path: Path) -> None:
    """User and assistant alternate, starting with the user; a system message only first."""
    fix = "Edit the file so the roles alternate, or start a new conversation."
    for index, message in enumerate(messages):
        expected = "user" if index % 2 == 0 else "assistant"
        if message.role != expected:
            raise RequestError(
                f"{path}: message {index + 1} (after any system message) has role "
                f"{message.role!r}; a chat alternates user and assistant, starting with user, "
                "and only the first message may be a system message.",
                fix=fix,
            )
    if len(messages) % 2:
        raise RequestError(
            f"{path}: the last message is a user message with no reply; a loaded chat must "
            "end with the assistant's reply, so the next message you type can follow it.",
            fix=fix,
        )
