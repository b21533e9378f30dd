"""``loom serve``: serve one model over an OpenAI-compatible HTTP API."""

from __future__ import annotations

import argparse
import logging
import sys

from ..assets import BUNDLED_MODEL_NAME
from ..serve import DEFAULT_MAX_TOKENS_LIMIT, make_server
from . import flags
from .generate_cmd import add_model_options, load_from_args, template_budget_from_args


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Load a model once and serve /v1/completions, /v1/chat/completions, "
        "/v1/models and /health. Requests are generated one at a time, in arrival order; "
        "one prompt cache is kept across requests.",
    )
    add_model_options(parser)
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default: 127.0.0.1, reachable from this machine only)",
    )
    parser.add_argument(
        "--port",
        type=flags.PORT,
        default=8080,
        metavar="PORT",
        help="default: 8080; 0 picks a free port",
    )
    parser.add_argument(
        "--max-tokens-limit",
        type=flags.MAX_TOKENS_LIMIT,
        metavar="N",
        default=DEFAULT_MAX_TOKENS_LIMIT,
        help=f"largest max_tokens a request may ask for (default: {DEFAULT_MAX_TOKENS_LIMIT})",
    )
    parser.add_argument("--log-requests", action="store_true", help="log each request to stderr")
    parser.set_defaults(handler=run, _parser=parser)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=logging.INFO if args.log_requests else logging.WARNING,
        format="%(asctime)s %(name)s: %(message)s",
    )
    template_budget = template_budget_from_args(args)
    model, tokenizer = load_from_args(args)
    server = make_server(
        model,
        tokenizer,
        host=args.host,
        port=args.port,
        model_id=args.model or BUNDLED_MODEL_NAME,
        max_tokens_limit=args.max_tokens_limit,
        template_budget=template_budget,
    )
    if not server.loopback_only:
        print(
            f"loom: warning: listening on {server.host}, reachable from other machines; "
            "the server has no authentication.",
            file=sys.stderr,
        )
    print(
        f"loom: serving {server.app.model_id} at {server.url}/v1 (Ctrl-C to stop)",
        file=sys.stderr,
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print(file=sys.stderr)
    finally:
        server.stop()
    return 0
