"""``loom``: the command line.

Exit codes: 0 success, 1 bad input (config, weights, request parameters, a
broken plugin), 2 usage error (including an inconsistent plugin policy),
3 refusal (what the artifact needs is not installed, not allowed, or cannot
run on this device). Errors print the message and, on its own line, the fix.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from .. import __version__
from ..errors import LoomError, PolicyError, Refusal, RequestError
from . import chat_cmd, convert_cmd, explain_cmd, fuse_cmd, generate_cmd, plugins_cmd, serve_cmd

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_REFUSAL = 0, 1, 2, 3


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loom",
        description="mlx-loom: LLM inference on MLX with pluggable model families.",
        epilog="Exit codes: 0 success, 1 bad input, 2 usage error, 3 refusal.",
    )
    parser.add_argument("--version", action="version", version=f"mlx-loom {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    plugins_cmd.register(sub)
    explain_cmd.register(sub)
    generate_cmd.register(sub)
    chat_cmd.register(sub)
    serve_cmd.register(sub)
    convert_cmd.register(sub)
    fuse_cmd.register(sub)
    return parser


def exit_code_for(err: LoomError) -> int:
    if isinstance(err, Refusal):
        return EXIT_REFUSAL
    if isinstance(err, PolicyError):
        return EXIT_USAGE
    return EXIT_ERROR


def report_error(err: LoomError, *, as_json: bool = False) -> int:
    """Print ``err`` for a person (or as JSON) and return its exit code."""
    code = exit_code_for(err)
    if as_json:
        print(json.dumps({**err.to_dict(), "exit_code": code}, indent=2))
    else:
        kind = "refused" if isinstance(err, Refusal) else "error"
        print(f"loom: {kind}: {err.message}", file=sys.stderr)
        if err.fix:
            print(f"fix: {err.fix}", file=sys.stderr)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    try:
        return int(args.handler(args) or EXIT_OK)
    except LoomError as err:
        if isinstance(err, RequestError) and not getattr(args, "json", False):
            parser_for = getattr(args, "_parser", parser)
            parser_for.print_usage(sys.stderr)
        return report_error(err, as_json=getattr(args, "json", False))
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
