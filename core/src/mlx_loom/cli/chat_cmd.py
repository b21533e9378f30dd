"""``loom chat``: an interactive conversation that keeps its cache between turns."""

from __future__ import annotations

import argparse
import sys

from ..errors import RequestError, TokenizerError
from ..generate import PromptCache, stream_generate
from ..parallel import doors
from .generate_cmd import (
    add_model_options,
    add_sampling_options,
    load_from_args,
    print_stats,
    sampling_kwargs,
)

HELP = "Type a message. Commands: /reset (forget the conversation), /exit (or Ctrl-D)."


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "chat",
        help="chat interactively with a model",
        description="An interactive chat. The conversation and its KV cache are kept between "
        "turns, so each turn only processes the new text.",
    )
    add_model_options(parser)
    parser.add_argument("--system", help="system message")
    parser.add_argument("--stats", action="store_true", help="print speed after each reply")
    add_sampling_options(parser)
    parser.set_defaults(handler=run, _parser=parser)


def run(args: argparse.Namespace) -> int:
    model, tokenizer = load_from_args(args)
    if not tokenizer.has_chat_template:
        raise TokenizerError(
            f"The tokenizer in {model.model_dir} has no chat template, so `loom chat` cannot "
            "format a conversation.",
            fix="Use `loom generate --no-chat-template`, or add chat_template.jinja to the model.",
        )
    options = sampling_kwargs(args)
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    cache = PromptCache(model)
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"[{model.model_dir.name}] {HELP}")
    while True:
        line = doors.read_line(model, ">> " if interactive else "")
        if line is None:
            break
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            messages = list(system)
            cache.reset()
            print("(conversation reset)")
            continue
        messages.append({"role": "user", "content": text})
        ids = tokenizer.encode_chat(messages)
        reply, last = [], None
        try:
            for last in stream_generate(model, tokenizer, ids, prompt_cache=cache, **options):
                print(last.text, end="", flush=True)
                reply.append(last.text)
        except RequestError as err:
            messages.pop()
            print(f"\nloom: error: {err.message}\nfix: {err.fix}", file=sys.stderr)
            continue
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})
        if args.stats:
            print_stats(last)
    return 0
