"""``loom serve``: serve models over OpenAI- and Anthropic-compatible HTTP APIs.

One ``--model``, or several: each is served under its id, loaded on its
first request (the first at start), and kept resident under
``--max-loaded-models``, ``--max-memory`` and ``--keep-alive``
(:mod:`mlx_loom.serve.models`, :mod:`mlx_loom.engine.pool`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from ..adapters import AdapterSet
from ..assets import BUNDLED_MODEL_ALIAS, BUNDLED_MODEL_NAME
from ..bounded_json import REQUEST_JSON, parse_json
from ..cache import resolve_kv_codec
from ..cache.codecs import kv_dtype_name
from ..engine import EngineSettings
from ..engine.settings import (
    DEFAULT_DECODE_CONCURRENCY,
    DEFAULT_PREFILL_STEP,
    DEFAULT_PREFILL_TOKEN_BUDGET,
    DEFAULT_PROMPT_CACHE_SIZE,
    DEFAULT_PROMPT_CONCURRENCY,
    NATIVE_CPU_PREFILL_STEP,
)
from ..engine.pool import checkpoint_bytes
from ..errors import AdapterError, RequestError
from ..serve import DEFAULT_MAX_TOKENS_LIMIT, make_server
from ..serve.server import DEFAULT_SHUTDOWN_GRACE
from ..serve.adapters import parse_adapter_specs
from ..serve.app import (
    DEFAULT_MAX_PROMPT_CHARS,
    DEFAULT_MAX_QUEUED,
    DEFAULT_MAX_RESPONSE_ENTRIES,
    ServeApp,
    server_engine_settings,
)
from ..serve.connection import (
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_HEADER_TIMEOUT,
    DEFAULT_IDLE_TIMEOUT,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_CONNECTIONS_PER_CLIENT,
    DEFAULT_WRITE_TIMEOUT,
)
from ..serve.models import ServedModel, split_model_spec
from ..serve.prepare import DEFAULT_THREADS
from ..serve.ranks import follow_jobs
from . import doors, flags
from .generate_cmd import (
    add_kv_cache_options,
    add_model_options,
    kv_group_size,
    load_from_args,
    template_budget_from_args,
)
from .speculation import add_speculation_options, speculation_from_args

#: Read when ``--api-key`` is not given, so the key need not appear in the process list.
API_KEY_ENV = "MLX_LOOM_API_KEY"


def _json_object(text: str) -> dict[str, Any]:
    fix = """fix: pass a JSON object, e.g. --chat-template-args '{"enable_thinking": false}'"""
    try:
        value = parse_json(
            text, source="--chat-template-args", error=RequestError, fix=fix, limits=REQUEST_JSON
        )
    except RequestError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc.message}\n{fix}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f"must be a JSON object, not a {type(value).__name__}\n{fix}"
        )
    return value


class _Origins(argparse.Action):
    """One or more origins, separated by spaces or commas (mlx_lm.server's spelling)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        found = list(getattr(namespace, self.dest) or [])
        found += [o.strip() for value in values for o in value.split(",") if o.strip()]
        setattr(namespace, self.dest, found)


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "serve",
        help="serve models over OpenAI- and Anthropic-compatible HTTP APIs",
        description="Load a model once and serve /v1/chat/completions, /v1/completions, "
        "/v1/responses, /v1/messages, /v1/models, /health and a chat page at /. Concurrent "
        "requests are batched together (continuous batching); prompt caches are kept across "
        "requests in a shared prefix store. With several --model, a request's 'model' picks "
        "one; each loads on its first request and has its own engine.",
    )
    add_model_options(
        parser,
        several="repeat to serve several models, each as its reference, or NAME=REF to "
        "name it; a request's 'model' picks one (the first is the default)",
    )
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
    parser.add_argument(
        "--adapter",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="register a LoRA/DoRA adapter a request may pick (model '<model>:NAME' or "
        "'adapter': NAME); repeatable, rows with different adapters share one batch; "
        "with several --model, MODEL:NAME=PATH registers it on that model (default: the first)",
    )
    add_pool_options(parser)
    chat = parser.add_argument_group("chat")
    chat.add_argument(
        "--tool-call-parser",
        metavar="NAME",
        help="the model's tool-call format (default: tokenizer_config.json's "
        "tool_parser_type, else the chat template's markers, else the family's default); "
        "an unknown name is refused, listing the registered ones",
    )
    chat.add_argument(
        "--chat-template-args",
        type=_json_object,
        metavar="JSON",
        help="template variables for every request, under each request's "
        """chat_template_kwargs, e.g. '{"enable_thinking": false}'""",
    )
    defaults = parser.add_argument_group(
        "sampling defaults (a request's own value wins; unset: the checkpoint's "
        "generation_config.json, else greedy)"
    )
    defaults.add_argument("--temp", type=flags.TEMP, metavar="T", help="default temperature")
    defaults.add_argument("--top-p", type=flags.TOP_P, metavar="P", help="default top_p")
    defaults.add_argument("--top-k", type=flags.TOP_K, metavar="K", help="default top_k")
    defaults.add_argument("--min-p", type=flags.MIN_P, metavar="P", help="default min_p")
    defaults.add_argument(
        "--max-tokens",
        type=flags.MAX_TOKENS,
        metavar="N",
        help="max_tokens of a request that gives none (default: 256, at most --max-tokens-limit)",
    )
    defaults.add_argument(
        "--no-generation-config",
        action="store_true",
        help="do not apply the checkpoint's generation_config.json sampling values",
    )
    add_kv_cache_options(parser.add_argument_group("KV cache"), whose="every request's KV cache")
    access = parser.add_argument_group("access")
    access.add_argument(
        "--allowed-origins",
        nargs="+",
        action=_Origins,
        default=[],
        metavar="ORIGIN",
        help="web origins whose pages may call the API (CORS), e.g. http://localhost:3000, "
        "or '*' for any (default: none; the chat page at / needs none)",
    )
    access.add_argument(
        "--api-key",
        help=f"require 'Authorization: Bearer KEY' (or x-api-key) on the API "
        f"(default: ${API_KEY_ENV}, else no key)",
    )
    add_engine_options(parser)
    add_limit_options(parser)
    add_speculation_options(parser)
    parser.set_defaults(handler=run, _parser=parser)


def _seconds(flag: str, example: float):
    return flags.finite(
        flag,
        check=lambda v: v > 0,
        valid="a number of seconds > 0",
        fix=f"pass a positive number of seconds, e.g. {{flag}} {example:g}",
    )


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


def parse_duration(text: str) -> float:
    """Seconds from ``300``, ``30s``, ``5m``, ``1h`` (``--keep-alive``)."""
    units = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}
    digits = text.strip()
    unit = digits.lstrip("0123456789.")
    try:
        value = float(digits[: len(digits) - len(unit)])
    except ValueError:
        value = -1.0
    factor = units.get(unit.strip().lower())
    if factor is None or not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration: it must be a positive number of seconds, or a "
            "number with s, m or h\nfix: pass a duration such as --keep-alive 5m"
        )
    return value * factor


def add_pool_options(parser: argparse.ArgumentParser) -> None:
    """Which of the served models stay loaded (docs/serve.md, "Several models")."""
    group = parser.add_argument_group("several models (residency)")
    group.add_argument(
        "--max-loaded-models",
        type=_count("--max-loaded-models", 1, "models loaded at once", 2),
        metavar="N",
        help="most models loaded at once; loading another unloads the least recently used "
        "idle one (default: no bound)",
    )
    group.add_argument(
        "--max-memory",
        type=parse_size,
        metavar="SIZE",
        help="most bytes of loaded models, e.g. 16GB: weights (from the safetensors headers) "
        "plus each engine's KV caches; loading past it unloads the least recently used idle "
        "model (default: no bound)",
    )
    group.add_argument(
        "--keep-alive",
        type=parse_duration,
        metavar="DURATION",
        help="unload a model unused this long, e.g. 300, 30s, 5m, 1h; its next request "
        "loads it again (default: keep models loaded)",
    )


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
        default=None,
        metavar="N",
        help="prompt tokens per prefill chunk; smaller chunks stall running streams less "
        f"(default: {NATIVE_CPU_PREFILL_STEP} on the native CPU kernels, else "
        f"{DEFAULT_PREFILL_STEP})",
    )
    group.add_argument(
        "--prefill-token-budget",
        type=_count("--prefill-token-budget", 0, "prompt tokens per step while decoding", 512),
        default=DEFAULT_PREFILL_TOKEN_BUDGET,
        metavar="N",
        help="while streams decode, most prompt tokens prefilled between two of their tokens "
        "(whole chunks, first come first served, at least one; 0: no bound) "
        f"(default: {DEFAULT_PREFILL_TOKEN_BUDGET})",
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
        "--prompt-cache-dir",
        default=None,
        metavar="DIR",
        help="also keep prompt caches in DIR: entries evicted from memory, and all of them at "
        "shutdown, are written there and serve later requests and restarted servers",
    )
    group.add_argument(
        "--prompt-cache-disk-bytes",
        type=parse_size,
        default=None,
        metavar="SIZE",
        help="most bytes of prompt-cache files kept in --prompt-cache-dir, e.g. 20GB "
        "(default: no byte bound)",
    )
    group.add_argument(
        "--queue-size",
        type=_count("--queue-size", 0, "requests that may wait for a row", 64),
        default=DEFAULT_MAX_QUEUED,
        metavar="N",
        help="requests that may wait for a free row; more are answered 503 with Retry-After "
        f"(default: {DEFAULT_MAX_QUEUED})",
    )
    group.add_argument(
        "--max-kv-bytes",
        type=parse_size,
        default=None,
        metavar="SIZE",
        help="most bytes the running requests' KV caches may hold, each counted at its fullest "
        "(prompt + max_tokens), e.g. 8GB; a request that does not fit waits in the queue, one "
        "that could never fit is answered 503 (default: bounded by --decode-concurrency only)",
    )


def engine_settings(args: argparse.Namespace) -> EngineSettings:
    return server_engine_settings(
        decode_concurrency=args.decode_concurrency,
        prompt_concurrency=args.prompt_concurrency,
        prefill_step_size=args.prefill_step_size,
        prefill_token_budget=args.prefill_token_budget,
        prompt_cache_size=args.prompt_cache_size,
        prompt_cache_bytes=args.prompt_cache_bytes,
        prompt_cache_dir=args.prompt_cache_dir,
        prompt_cache_disk_bytes=args.prompt_cache_disk_bytes,
        max_queued=args.queue_size,
        max_kv_bytes=args.max_kv_bytes,
    )


def add_limit_options(parser: argparse.ArgumentParser) -> None:
    """What one request and one connection may cost (docs/serve.md, "Limits")."""
    prompts = parser.add_argument_group("prompt limits")
    prompts.add_argument(
        "--max-prompt-chars",
        type=_count("--max-prompt-chars", 1, "characters", DEFAULT_MAX_PROMPT_CHARS),
        default=DEFAULT_MAX_PROMPT_CHARS,
        metavar="N",
        help="longest prompt text (raw, or the rendered chat) the server tokenizes "
        f"(default: {DEFAULT_MAX_PROMPT_CHARS})",
    )
    prompts.add_argument(
        "--max-prompt-tokens",
        type=_count("--max-prompt-tokens", 1, "tokens", 8192),
        metavar="N",
        help="longest prompt in tokens (default: the model's context)",
    )
    prompts.add_argument(
        "--max-response-entries",
        type=_count("--max-response-entries", 1, "entries", DEFAULT_MAX_RESPONSE_ENTRIES),
        default=DEFAULT_MAX_RESPONSE_ENTRIES,
        metavar="N",
        help="most token entries one answer may ask for: max_tokens x n x (1 + logprobs) "
        f"(default: {DEFAULT_MAX_RESPONSE_ENTRIES})",
    )
    prompts.add_argument(
        "--tokenizer-threads",
        type=_count("--tokenizer-threads", 1, "threads", DEFAULT_THREADS),
        default=DEFAULT_THREADS,
        metavar="N",
        help="threads that parse, render and tokenize requests, off the connection "
        f"threads (default: {DEFAULT_THREADS})",
    )
    conns = parser.add_argument_group("connections")
    conns.add_argument(
        "--max-connections",
        type=_count("--max-connections", 1, "connections served at once", DEFAULT_MAX_CONNECTIONS),
        default=DEFAULT_MAX_CONNECTIONS,
        metavar="N",
        help="connections served at once; more are answered 503 and closed "
        f"(default: {DEFAULT_MAX_CONNECTIONS})",
    )
    conns.add_argument(
        "--max-connections-per-client",
        type=_count(
            "--max-connections-per-client", 1, "connections from one address", 64
        ),
        default=DEFAULT_MAX_CONNECTIONS_PER_CLIENT,
        metavar="N",
        help="connections one client address may hold; behind a reverse proxy, raise it to "
        f"--max-connections (default: {DEFAULT_MAX_CONNECTIONS_PER_CLIENT})",
    )
    for flag, default, what in (
        ("--idle-timeout", DEFAULT_IDLE_TIMEOUT, "close a connection that sends no request for"),
        ("--header-timeout", DEFAULT_HEADER_TIMEOUT, "answer 408 to a request head slower than"),
        ("--body-timeout", DEFAULT_BODY_TIMEOUT, "answer 408 to a request body slower than"),
        (
            "--write-timeout",
            DEFAULT_WRITE_TIMEOUT,
            "drop a client that reads none of an answer for",
        ),
    ):
        conns.add_argument(
            flag,
            type=_seconds(flag, default),
            default=default,
            metavar="SECONDS",
            help=f"{what} this many seconds (default: {default:g})",
        )
    conns.add_argument(
        "--shutdown-grace",
        type=flags.finite(
            "--shutdown-grace",
            check=lambda v: v >= 0,
            valid="a number of seconds >= 0",
            fix=f"pass a number of seconds, e.g. {{flag}} {DEFAULT_SHUTDOWN_GRACE:g}",
        ),
        default=DEFAULT_SHUTDOWN_GRACE,
        metavar="SECONDS",
        help="on SIGTERM, stop accepting and let requests in flight run this long before "
        "their answers are ended (an error event, then [DONE]); SIGINT ends them at once "
        f"(default: {DEFAULT_SHUTDOWN_GRACE:g})",
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=logging.INFO if args.log_requests else logging.WARNING,
        format="%(asctime)s %(name)s: %(message)s",
    )
    template_budget = template_budget_from_args(args)
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    specs = [split_model_spec(m) for m in args.model or []] or [
        (BUNDLED_MODEL_NAME, BUNDLED_MODEL_ALIAS)
    ]
    adapters = _adapters_by_model(args.adapter, [i for i, _ in specs])
    served: dict[str, Any] = {}
    if args.parallel:
        if len(specs) > 1:
            raise flags.usage_error(
                "--parallel",
                "--parallel splits one model across ranks; several --model were given",
                "serve one model with --parallel, or several without it",
            )
        model, tokenizer = load_from_args(_one_model(args, specs[0][1]))
        if adapters.get(specs[0][0]):
            AdapterSet(model, adapters[specs[0][0]])
        if doors.is_follower(model):
            follow_jobs(model, tokenizer)  # rank 0 serves; this rank runs every job with it
            return 0
        kv_group_size(args, model)  # a bad --kv-* flag is refused in flags
        served = {"model": model, "tokenizer": tokenizer, "model_id": specs[0][0]}
    else:
        if len(specs) > 1:
            for flag in ("--draft-model", "--adapter-path"):
                if getattr(args, flag[2:].replace("-", "_")):
                    raise flags.usage_error(
                        flag,
                        f"{flag} applies to one model, and several --model were given",
                        "serve that model alone, or register adapters per model with "
                        "--adapter MODEL:NAME=PATH",
                    )
        served = {"models": [_served_model(args, i, ref, adapters.get(i, {})) for i, ref in specs]}
    server = make_server(
        **served,
        max_loaded_models=args.max_loaded_models,
        max_memory=args.max_memory,
        keep_alive=args.keep_alive,
        host=args.host,
        port=args.port,
        max_tokens_limit=args.max_tokens_limit,
        engine=engine_settings(args),
        template_budget=template_budget,
        allowed_origins=args.allowed_origins,
        api_key=api_key,
        tool_call_parser=args.tool_call_parser,
        chat_template_args=args.chat_template_args,
        kv_bits=args.kv_bits,
        kv_group_size=args.kv_group_size,
        quantized_kv_start=args.quantized_kv_start,
        kv_codec=args.kv_codec,
        max_prompt_chars=args.max_prompt_chars,
        max_prompt_tokens=args.max_prompt_tokens,
        max_response_entries=args.max_response_entries,
        tokenizer_threads=args.tokenizer_threads,
        max_connections=args.max_connections,
        max_connections_per_client=args.max_connections_per_client,
        idle_timeout=args.idle_timeout,
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
        write_timeout=args.write_timeout,
        speculation=speculation_from_args(args),
        sampling_defaults={
            "temperature": args.temp,
            "top_p": args.top_p,
            "top_k": args.top_k,
            "min_p": args.min_p,
        },
        default_max_tokens=args.max_tokens,
        generation_config=not args.no_generation_config,
    )
    if not server.loopback_only and server.api_key is None:
        print(
            f"loom: warning: listening on {server.host}, reachable from other machines; "
            "the server has no API key (--api-key).",
            file=sys.stderr,
        )
    print(
        f"loom: serving {', '.join(server.models.pool.ids)} at {server.url}/v1 "
        f"(chat page: {server.url}/; Ctrl-C to stop)",
        file=sys.stderr,
    )
    if len(server.models.pool.ids) > 1:
        print(
            f"loom: {server.app.model_id} is loaded; the others load on their first request",
            file=sys.stderr,
        )
    fmt = server.app.chat_format
    tools = fmt.tool_parser.name if fmt.tool_parser is not None else "none"
    reasoning = fmt.reasoning.name if fmt.reasoning is not None else "none"
    print(
        f"loom: tool calls: {tools} ({fmt.tool_parser_reason}); reasoning: {reasoning}",
        file=sys.stderr,
    )
    print(decoding_line(server.app, args.draft_model), file=sys.stderr)
    shown = ", ".join(f"{k}={v}" for k, v in server.app.sampling_defaults.items()) or "greedy"
    print(
        f"loom: sampling defaults: {shown}; max_tokens={server.app.default_max_tokens}",
        file=sys.stderr,
    )
    try:
        server.serve_until_signalled(args.shutdown_grace)
    except KeyboardInterrupt:  # a second signal while draining: do not wait
        server.stop()
        return 1
    return 0


def _one_model(args: argparse.Namespace, ref: str) -> argparse.Namespace:
    """``args`` with ``--model`` as the single reference ``load_from_args`` reads."""
    return argparse.Namespace(**{**vars(args), "model": ref})


def _served_model(
    args: argparse.Namespace, model_id: str, ref: str, adapters: dict[str, str]
) -> ServedModel:
    """One ``--model``: loaded with the CPU-path flags, its ``--kv-*`` flags checked in flags."""

    def load_it() -> Any:
        model, tokenizer = load_from_args(_one_model(args, ref))  # as every command loads
        kv_group_size(args, model)  # a bad --kv-* flag is refused in flags
        return model, tokenizer

    options: dict[str, Any] = {}
    speculation = speculation_from_args(args)
    if speculation is not None:
        options["speculation"] = speculation
    plain = ServedModel.from_ref(model_id, ref)
    return ServedModel(
        model_id,
        load_it,
        lambda: checkpoint_bytes(ref),
        options=options,
        adapters=adapters,
        aliases=plain.aliases,
    )


def _adapters_by_model(specs: list[str], ids: list[str]) -> dict[str, dict[str, str]]:
    """``--adapter [MODEL:]NAME=PATH`` per served model id (no MODEL: the first model)."""
    grouped: dict[str, list[str]] = {}
    for spec in specs:
        head, sep, path = spec.partition("=")
        model, colon, name = head.rpartition(":")
        if colon and model not in ids:
            raise AdapterError(
                f"--adapter {spec!r} names the model {model!r}, which is not one of the "
                "--model ids",
                fix="pass --adapter MODEL:NAME=PATH with MODEL one of the --model ids (or "
                "NAME=PATH for the first model)",
            )
        target = model if colon else ids[0]
        grouped.setdefault(target, []).append(f"{name if colon else head}{sep}{path}")
    # a malformed spec fails before anything loads
    return {model: parse_adapter_specs(given) for model, given in grouped.items()}


def decoding_line(app: ServeApp, draft_model: str | None) -> str:
    """The banner line naming the draft and the KV cache storage every request gets."""
    spec = app.speculation
    if spec is None:
        draft = "none"
    else:
        if spec.draft is not None:
            who = f"{draft_model} (draft model)"
        else:
            who = "mtp (the model's own head)" if spec.mtp else "ngram (prompt lookup)"
        draft = f"{who}, {spec.num_draft} tokens a step"
        if app.adapters is not None:
            draft += "; adapter requests do not draft"
    kv, kinds = app.kv, app.model.binding.cache_kinds
    codec, bits = resolve_kv_codec(kv["kv_codec"], kv["kv_bits"], kinds=kinds)
    kv_dtype = getattr(app.model, "kv_dtype", None)
    if codec is None:
        cache = "plain" if kv_dtype is None else f"plain, stored in {kv_dtype_name(kv_dtype)}"
    else:
        group = f", group {kv['kv_group_size']}" if codec.name == "affine" else ""
        cache = f"{codec.name} {bits}-bit{group}, from token {kv['quantized_kv_start']}"
    return f"loom: draft: {draft}; KV cache: {cache}"
