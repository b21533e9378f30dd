"""``loom``: the command line.

Exit codes: 0 success, 1 bad input (config, weights, request parameters, a
broken plugin), 2 usage error (a bad flag value, an inconsistent plugin
policy), 3 refusal (what the artifact needs is not installed, not allowed, or
cannot run on this device), 130 interrupted (Ctrl-C), 141 the reader of the
output went away (``loom generate | head``). Errors print the message and, on
its own line, the fix — spelled with the command's flags, not the Python API's
parameter names.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Sequence

from .. import __version__
from ..errors import LoomError, PolicyError, Refusal, UsageError
from .flags import LoomArgumentParser, speak_flags

#: Each command, the module that implements it, and its one-line help. A
#: command's module (and what it imports: MLX, the host, the server) is
#: imported only when that command runs or its parser is wanted, so `loom`,
#: `loom --help` and `loom --version` start in a fraction of a second. A test
#: keeps these help lines equal to the modules' own.
COMMANDS: dict[str, tuple[str, str]] = {
    "plugins": ("plugins_cmd", "list discovered plugins and what they register"),
    "models": ("models_cmd", "list the models on this machine that can be run"),
    "explain": ("explain_cmd", "show how a model would be resolved, without loading weights"),
    "generate": ("generate_cmd", "generate text from a prompt"),
    "chat": ("chat_cmd", "chat interactively with a model"),
    "serve": ("serve_cmd", "serve models over OpenAI- and Anthropic-compatible HTTP APIs"),
    "convert": ("convert_cmd", "convert a Hugging Face checkpoint to MLX, optionally quantized"),
    "fuse": ("fuse_cmd", "fuse a LoRA/DoRA adapter into its base model"),
}

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_REFUSAL = 0, 1, 2, 3
EXIT_INTERRUPTED, EXIT_BROKEN_PIPE = 130, 141  # 128 + SIGINT, 128 + SIGPIPE, as a shell reports


def build_parser(command: str | None = None, *, only: bool = False) -> argparse.ArgumentParser:
    """The ``loom`` parser: every command's full parser, or with ``only=True``
    just ``command``'s (the others listed by name and help, unimported)."""
    parser = LoomArgumentParser(
        prog="loom",
        description="mlx-loom: LLM inference on MLX with pluggable model families.",
        epilog="Exit codes: 0 success, 1 bad input, 2 usage error, 3 refusal.",
    )
    parser.add_argument("--version", action="version", version=f"mlx-loom {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_line) in COMMANDS.items():
        if only and name != command:
            sub.add_parser(name, help=help_line)
        else:
            importlib.import_module(f".{module}", __package__).register(sub)
    return parser


def exit_code_for(err: LoomError) -> int:
    if isinstance(err, Refusal):
        return EXIT_REFUSAL
    if isinstance(err, (PolicyError, UsageError)):
        return EXIT_USAGE
    return EXIT_ERROR


def report_error(err: LoomError, *, as_json: bool = False) -> int:
    """Print ``err`` for a person (or as JSON) and return its exit code."""
    code = exit_code_for(err)
    if as_json:
        print(json.dumps({**err.to_dict(), "exit_code": code}, indent=2))
    else:
        kind = "refused" if isinstance(err, Refusal) else "error"
        print(f"loom: {kind}: {speak_flags(err.message)}", file=sys.stderr)
        if err.fix:
            print(f"fix: {speak_flags(err.fix)}", file=sys.stderr)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _run(argv)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # also from --help piped into head
        return _reader_went_away()


def _run(argv: Sequence[str] | None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    command = next((w for w in words if not w.startswith("-")), None)
    parser = build_parser(command, only=True)
    args, extras = parser.parse_known_args(argv)
    if extras:  # reported by the command's own parser, so the fix names its --help
        getattr(args, "_parser", parser).error(f"unrecognized arguments: {' '.join(extras)}")
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    try:
        return int(args.handler(args) or EXIT_OK)
    except LoomError as err:
        return report_error(err, as_json=getattr(args, "json", False))


def _reader_went_away() -> int:
    """Exit quietly when stdout's reader closed the pipe (``loom generate | head``).

    Whatever is still buffered for stdout can never be written; pointing
    stdout at /dev/null keeps the interpreter's final flush from printing a
    second traceback. Python ignores SIGPIPE, so this exception is how we
    learn of it; we do not restore the default handler, because the server's
    sockets would then kill the process when a client disconnects.
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout already closed or not a real file
        pass
    return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
