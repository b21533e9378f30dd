"""``loom chat``: an interactive conversation that keeps its cache between turns.

The pieces: :mod:`.repl` reads what is typed (readline, history, multi-line
messages), :mod:`.chat_session` runs turns and ``/commands``, and
:mod:`.conversation` keeps the transcript inside the model's context.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..assets import BUNDLED_MODEL_ALIAS
from ..errors import TokenizerError
from ..model import Model
from . import doors, flags
from .chat_session import COMMANDS, ChatSession
from .flags import usage_error
from .generate_cmd import (
    add_model_options,
    add_sampling_options,
    add_structured_options,
    constraint_kwargs,
    load_from_args,
    sampling_kwargs,
    template_budget_from_args,
)
from .repl import HISTORY_ENV, EndOfInput, LineReader, default_history_path
from .speculation import add_speculation_options, speculation_kwargs


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "chat",
        help="chat interactively with a model",
        description="An interactive chat. The conversation and its KV cache are kept between "
        "turns, so each turn only processes the new text; when the conversation outgrows the "
        "context, the oldest turns are left out (the system message is kept). Type /help in "
        "the chat for its commands.",
    )
    add_model_options(parser)
    parser.add_argument(
        "--system",
        "--system-prompt",
        dest="system",
        metavar="TEXT",
        help="system message (also: /system in the chat)",
    )
    parser.add_argument("--stats", action="store_true", help="print speed after each reply")
    parser.add_argument(
        "--max-kv-size",
        type=flags.MAX_KV_SIZE,
        metavar="N",
        help="tokens the conversation may occupy, prompt and reply together "
        "(default: the model's context length); older turns are left out to stay inside it",
    )
    history = parser.add_mutually_exclusive_group()
    history.add_argument(
        "--history-file",
        type=Path,
        metavar="FILE",
        help=f"where to keep typed lines (default: ${HISTORY_ENV}, else chat_history in the "
        "mlx-loom data directory)",
    )
    history.add_argument(
        "--no-history", action="store_true", help="do not read or write a history file"
    )
    add_structured_options(parser)
    add_speculation_options(parser)
    add_sampling_options(parser)
    parser.set_defaults(handler=run, _parser=parser)


def context_budget(args: argparse.Namespace, model: Model) -> int | None:
    """Tokens the conversation may occupy: ``--max-kv-size``, capped by the model's context."""
    context = model.context_length
    if args.max_kv_size is None:
        return context
    if context is not None and args.max_kv_size > context:
        raise usage_error(
            "--max-kv-size",
            f"{args.max_kv_size} is more than the model's context of {context} tokens "
            "(max_position_embeddings)",
            f"pass --max-kv-size {context} or less, or omit it to use the whole context",
        )
    return args.max_kv_size


#: Commands that read or write this machine's files: in a split chat the other
#: ranks' machines may not hold the same file, so the ranks would leave step.
_LOCAL_FILE_COMMANDS = ("/save", "/load")


def _split_reader(model: Model, read):
    """``read`` for a split chat: rank 0 reads, and every rank gets the same line.

    Rank 0's end of input and Ctrl-C at the prompt reach the other ranks as
    the same exceptions, so every rank's session does the same thing.
    """
    if model.parallel is None:
        return read

    def leader_event() -> dict:
        try:
            line = read()
        except KeyboardInterrupt:
            return {"interrupt": True}
        except EndOfInput as end:
            return {"eof": end.unfinished}
        if line.split(" ", 1)[0] in _LOCAL_FILE_COMMANDS:
            print("(/save and /load are not available in a split chat)", file=sys.stderr)
            return {"line": ""}
        return {"line": line}

    def shared() -> str:
        event = doors.shared_input(model, leader_event)
        if "interrupt" in event:
            raise KeyboardInterrupt
        if "eof" in event:
            raise EndOfInput(unfinished=event["eof"])
        return event["line"]

    return shared


def run(args: argparse.Namespace) -> int:
    template_budget = template_budget_from_args(args)
    model, tokenizer = load_from_args(args)
    if not tokenizer.has_chat_template:
        raise TokenizerError(
            f"The tokenizer in {model.model_dir} has no chat template, so `loom chat` cannot "
            "format a conversation.",
            fix="Use `loom generate --no-chat-template`, or add chat_template.jinja to the model.",
        )
    name = args.model or BUNDLED_MODEL_ALIAS
    budget = context_budget(args, model)
    session = ChatSession(
        model,
        tokenizer,
        options={
            **sampling_kwargs(args, model),
            **speculation_kwargs(args),
            **constraint_kwargs(args),
        },
        budget=budget,
        name=name,
        system=args.system,
        stats=args.stats,
        template_budget=template_budget,
    )
    interactive = sys.stdin.isatty()
    history = None if args.no_history else (args.history_file or default_history_path())
    with LineReader(interactive=interactive, history=history, commands=COMMANDS) as reader:
        read = _split_reader(model, reader.read)
        if reader.history_error:
            session.note(reader.history_error)
        if interactive:
            context = f"{budget}-token context" if budget else "context not declared"
            print(f"[{name}, {context}] Type a message; /help for commands, Ctrl-D to leave.")
        while True:
            try:
                if not session.handle(read()):
                    break
            except KeyboardInterrupt:  # at the prompt: drop the half-typed line
                session.recover()
                print(file=sys.stdout, flush=True)
            except EndOfInput as end:
                if interactive:
                    print(flush=True)  # leave the shell's prompt on a line of its own
                if end.unfinished:
                    session.note("the unfinished multi-line message was not sent")
                break
    return 0
