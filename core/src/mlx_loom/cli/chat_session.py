"""One ``loom chat`` session: turns, ``/commands``, and stopping an answer with Ctrl-C.

The REPL never sends a line that starts with ``/`` to the model: it is a
command, answered here — an unknown one with a pointer to ``/help``. A message
that really starts with a slash is typed with two (``//etc/hosts``).

Ctrl-C while an answer streams stops the answer, not the chat. The first
press asks the stream to stop after the current token, which closes the
generator at a token boundary so the prompt cache stays exact; a second press
interrupts at once (during a long prefill, say), and because the caches may
then hold a token their bookkeeping missed, the prompt cache is started
afresh. Either way the partial answer is kept: it is what the user saw.
"""

from __future__ import annotations

import functools
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from ..errors import LoomError
from ..generation import PromptCache, stream_generate
from ..model import Model
from ..text import TemplateBudget, Tokenizer
from . import doors
from .conversation import Conversation
from .flags import speak_flags
from .generate_cmd import print_stats


@dataclass(frozen=True)
class Command:
    usage: str
    help: str
    run: Callable[[ChatSession, str], bool]  # returns False to end the chat


class StopOnInterrupt:
    """SIGINT handling while one answer streams (see the module docstring).

    Not ``active`` (a rank other than 0 of a split model, which follows rank
    0's decision), it leaves SIGINT's handling as it is.
    """

    def __init__(self, *, active: bool = True) -> None:
        self.requested = False
        self.active = active
        self._previous: Any = None

    def __enter__(self) -> StopOnInterrupt:
        if self.active:
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc: object) -> None:
        if self.active:
            signal.signal(signal.SIGINT, self._previous)


class ChatSession:
    """The conversation, its prompt cache, and what each typed line does."""

    def __init__(
        self,
        model: Model,
        tokenizer: Tokenizer,
        *,
        options: dict[str, Any],
        budget: int | None,
        name: str,
        system: str | None = None,
        stats: bool = False,
        out: TextIO | None = None,
        err: TextIO | None = None,
        template_budget: TemplateBudget | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        # Each turn renders the whole conversation: under this budget (a turn
        # past it is reported and dropped, like any other refused turn).
        self.encode_chat = functools.partial(
            tokenizer.encode_chat, template_budget=template_budget or TemplateBudget.from_env()
        )
        self.options = options
        self.budget = budget
        self.name = name
        self.stats = stats
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.conversation = Conversation(system=system)
        self.cache = PromptCache(model)
        self._said_dropping = False

    # --- output -------------------------------------------------------------------

    def note(self, text: str) -> None:
        """A remark from the REPL (not the model), on stderr so piped replies stay clean."""
        print(f"({text})", file=self.err, flush=True)

    def report(self, err: LoomError) -> None:
        print(f"loom: error: {speak_flags(err.message)}", file=self.err)
        if err.fix:
            print(f"fix: {speak_flags(err.fix)}", file=self.err, flush=True)

    # --- one typed message ----------------------------------------------------------

    def handle(self, text: str) -> bool:
        """Act on one message or command; False means the chat should end."""
        if not text.strip():
            return True
        if text.startswith("/") and not text.startswith("//"):
            return self.command(text)
        self.turn(text[1:] if text.startswith("//") else text)
        return True

    def turn(self, text: str) -> None:
        conversation = self.conversation
        conversation.add("user", text)
        asked = self.options["max_tokens"]
        try:
            plan = conversation.plan(self.encode_chat, budget=self.budget, max_tokens=asked)
            stream = stream_generate(
                self.model,
                self.tokenizer,
                plan.prompt,
                prompt_cache=self.cache,
                **{**self.options, "max_tokens": plan.max_tokens},
            )
        except LoomError as err:
            conversation.pop_user()
            self.report(err)
            return
        if plan.dropped and not self._said_dropping:
            self._said_dropping = True
            self.note(
                f"the conversation no longer fits the {self.budget}-token context: the oldest "
                "turns are left out of what the model sees from now on; the system message is "
                "kept, and /save still writes every turn"
            )
        reply: list[str] = []
        last = None
        failure: LoomError | None = None
        torn = False  # interrupted mid-step: the caches may hold what the bookkeeping missed
        with StopOnInterrupt(active=not doors.is_follower(self.model)) as interrupt:
            try:
                for last in stream:
                    reply.append(last.text)  # first: a second Ctrl-C may land in the write
                    self.out.write(last.text)
                    self.out.flush()
                    if interrupt.requested:
                        break
            except KeyboardInterrupt:
                if self.model.parallel is not None:
                    # Mid-step on rank 0 alone: the ranks cannot meet again; end them.
                    raise SystemExit(130) from None
                torn = True
            except LoomError as err:
                failure = err
            finally:
                stream.close()  # records what was fed in the prompt cache
        # Split across ranks, every rank keeps as much of the answer as rank 0 did.
        reply = reply[: doors.kept_together(self.model, len(reply))]
        if torn:
            self.cache.reset()  # after close(), which would record into a fresh cache
        if failure is not None and not reply:
            conversation.pop_user()
            self.report(failure)
            return
        print(file=self.out, flush=True)
        conversation.add("assistant", "".join(reply))
        if failure is not None:
            self.report(failure)
        elif interrupt.requested:
            self.note("stopped")
        elif last is not None and last.finish_reason == "length" and plan.max_tokens < asked:
            self.note(f"the reply reached the end of the {self.budget}-token context")
        if self.stats:
            print_stats(last, out=self.err)

    def recover(self) -> None:
        """After a Ctrl-C outside an answer: withdraw a message that got no reply.

        The interrupt may have landed anywhere in that turn (rendering the
        prompt, a prefill), so the prompt cache is started afresh too. At the
        prompt itself there is nothing to undo.
        """
        messages = self.conversation.messages
        if messages and messages[-1].role == "user":
            self.conversation.pop_user()
            self.cache.reset()

    # --- commands ------------------------------------------------------------------

    def command(self, text: str) -> bool:
        name, _, arg = text.partition(" ")
        found = COMMANDS.get(name)
        if found is None:
            self.note(
                f"unknown command {name}: /help lists the commands; to send a message that "
                "starts with '/', type '//'"
            )
            return True
        return found.run(self, arg.strip())

    def _help(self, arg: str) -> bool:
        width = max(len(c.usage) for c in COMMANDS.values())
        seen = set()
        for command in COMMANDS.values():
            if command.usage in seen:
                continue
            seen.add(command.usage)
            print(f"  {command.usage:<{width}}  {command.help}", file=self.out)
        print(
            '  A line ending in \\ continues on the next line; """ starts and ends a '
            "multi-line message.\n  Ctrl-C stops an answer; Ctrl-D (or /exit) leaves.",
            file=self.out,
            flush=True,
        )
        return True

    def _exit(self, arg: str) -> bool:
        return False

    def _reset(self, arg: str) -> bool:
        self.conversation.reset()
        self.note("conversation reset")
        return True

    def _system(self, arg: str) -> bool:
        if not arg:
            current = self.conversation.system
            self.note(f"system message: {current!r}" if current else "no system message")
        elif arg == "--clear":
            self.conversation.system = None
            self.note("system message removed")
        else:
            self.conversation.system = arg
            self.note("system message set")
        return True

    def _save(self, arg: str) -> bool:
        if not arg:
            self.note("usage: /save FILE")
            return True
        try:
            self.conversation.save(Path(arg).expanduser(), model=self.name)
        except LoomError as err:
            self.report(err)
            return True
        self.note(f"saved {self.conversation.turns} turn(s) to {arg}")
        return True

    def _load(self, arg: str) -> bool:
        if not arg:
            self.note("usage: /load FILE")
            return True
        try:
            self.conversation = Conversation.load(Path(arg).expanduser())
        except LoomError as err:
            self.report(err)
            return True
        self.note(f"loaded {self.conversation.turns} turn(s) from {arg}")
        return True


COMMANDS: dict[str, Command] = {
    "/help": Command("/help", "show this help", ChatSession._help),
    "/reset": Command(
        "/reset", "forget the conversation (the system message stays)", ChatSession._reset
    ),
    "/system": Command(
        "/system [TEXT|--clear]",
        "show, set or remove the system message",
        ChatSession._system,
    ),
    "/save": Command(
        "/save FILE", "write the whole conversation to FILE (JSON)", ChatSession._save
    ),
    "/load": Command(
        "/load FILE", "replace the conversation with one saved by /save", ChatSession._load
    ),
    "/exit": Command("/exit, /quit", "leave the chat", ChatSession._exit),
    "/quit": Command("/exit, /quit", "leave the chat", ChatSession._exit),
}
