"""``loom serve``: serve one model over an OpenAI-compatible HTTP API."""

from __future__ import annotations

import argparse
import logging
import sys

from ..assets import BUNDLED_MODEL_NAME
from ..engine import EngineSettings
from ..engine.settings import (
    DEFAULT_DECODE_CONCURRENCY,
    DEFAULT_PREFILL_STEP,
    DEFAULT_PROMPT_CACHE_SIZE,
    DEFAULT_PROMPT_CONCURRENCY,
)
from ..serve import DEFAULT_MAX_TOKENS_LIMIT, make_server
from ..serve.app import DEFAULT_MAX_QUEUED, server_engine_settings
from . import flags
from .generate_cmd import add_model_options, load_from_args
from .speculation import add_speculation_options, speculation_from_args


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Load a model once and serve /v1/completions, /v1/chat/completions, "
        "/v1/models and /health. Concurrent requests are batched together (continuous "
        "batching); prompt caches are kept across requests in a shared prefix store.",
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
    add_engine_options(parser)
    add_speculation_options(parser)
    parser.set_defaults(handler=run, _parser=parser)


def _count(flag: str, low: int, what: str, example: int):
    return flags.integer(
        flag,
        low=low,
        valid=f"an integer >= {low} ({what})",
        fix=f"pass a count such as {{flag}} {example}",
    )


_SIZES = {"": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9}


def parse_size(text: str) -> int:
    """A byte count: ``1000000``, ``500MB``, ``2G`` (decimal units, as mlx-lm reads them)."""
    digits = text.strip()
    unit = digits.lstrip("0123456789.")
    number = digits[: len(digits) - len(unit)]
    factor = _SIZES.get(unit.strip().upper())
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if factor is None or value < 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: it must be a byte count, or a number with K, M or G\n"
            "fix: pass a size such as --prompt-cache-bytes 2GB, or omit it for no bound"
        )
    return int(value * factor)


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """The batching flags, with mlx-lm's server names, meanings and defaults."""
    group = parser.add_argument_group("batching (continuous batching engine)")
    group.add_argument(
        "--decode-concurrency",
        type=_count("--decode-concurrency", 1, "requests decoded together", 32),
        default=DEFAULT_DECODE_CONCURRENCY,
        metavar="N",
        help=f"most requests decoded together (default: {DEFAULT_DECODE_CONCURRENCY})",
    )
    group.add_argument(
        "--prompt-concurrency",
        type=_count("--prompt-concurrency", 1, "prompts prefilled at once", 8),
        default=DEFAULT_PROMPT_CONCURRENCY,
        metavar="N",
        help=f"most prompts prefilled at once (default: {DEFAULT_PROMPT_CONCURRENCY})",
    )
    group.add_argument(
        "--prefill-step-size",
        type=_count("--prefill-step-size", 1, "prompt tokens per prefill chunk", 2048),
        default=DEFAULT_PREFILL_STEP,
        metavar="N",
        help="prompt tokens per prefill chunk; smaller chunks stall running streams less "
        f"(default: {DEFAULT_PREFILL_STEP})",
    )
    group.add_argument(
        "--prompt-cache-size",
        type=_count("--prompt-cache-size", 0, "prompt caches kept; 0 keeps none", 10),
        default=DEFAULT_PROMPT_CACHE_SIZE,
        metavar="N",
        help="most prompt caches kept for reuse; 0 keeps none "
        f"(default: {DEFAULT_PROMPT_CACHE_SIZE})",
    )
    group.add_argument(
        "--prompt-cache-bytes",
        type=parse_size,
        default=None,
        metavar="SIZE",
        help="most bytes of prompt caches kept, e.g. 2GB (default: no byte bound)",
    )
    group.add_argument(
        "--queue-size",
        type=_count("--queue-size", 0, "requests that may wait for a row", 64),
        default=DEFAULT_MAX_QUEUED,
        metavar="N",
        help="requests that may wait for a free row; more are answered 503 with Retry-After "
        f"(default: {DEFAULT_MAX_QUEUED})",
    )


def engine_settings(args: argparse.Namespace) -> EngineSettings:
    return server_engine_settings(
        decode_concurrency=args.decode_concurrency,
        prompt_concurrency=args.prompt_concurrency,
        prefill_step_size=args.prefill_step_size,
        prompt_cache_size=args.prompt_cache_size,
        prompt_cache_bytes=args.prompt_cache_bytes,
        max_queued=args.queue_size,
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=logging.INFO if args.log_requests else logging.WARNING,
        format="%(asctime)s %(name)s: %(message)s",
    )
    model, tokenizer = load_from_args(args)
    server = make_server(
        model,
        tokenizer,
        host=args.host,
        port=args.port,
        model_id=args.model or BUNDLED_MODEL_NAME,
        max_tokens_limit=args.max_tokens_limit,
        engine=engine_settings(args),
        speculation=speculation_from_args(args),
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
