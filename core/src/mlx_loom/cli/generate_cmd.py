"""``loom generate``: stream one completion to the terminal.

Also home to the model, sampling and KV-cache options ``loom chat`` and
``loom serve`` share, so a flag means the same thing in every command.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..assets import BUNDLED_MODEL_ALIAS
from ..cache import resolve_kv_codec
from ..engine.constraints import MAX_SOURCE_BYTES
from ..engine.defaults import generation_defaults
from ..engine.kv_groups import kv_group_size_for
from ..errors import RequestError, UsageError
from ..generation import stream_generate
from ..loader import load
from ..model import Model
from ..text.template_budget import ENV_MAX_OUTPUT, ENV_TIMEOUT, TemplateBudget
from . import doors, flags
from .flags import usage_error
from .speculation import add_speculation_options, speculation_kwargs

DEFAULT_PROMPT = "Once upon a time"
TEMPLATE_TIMEOUT = flags.finite(
    "--template-timeout",
    check=lambda v: 0 < v <= 3600,
    valid="a number of seconds in (0, 3600]",
    fix="pass a time such as {flag} 5",
)
TEMPLATE_MAX_OUTPUT = flags.integer(
    "--template-max-output",
    low=1,
    high=1 << 31,
    valid="a number of characters >= 1",
    fix="pass a size such as {flag} 4194304",
)


def add_model_options(parser: argparse.ArgumentParser, *, several: str | None = None) -> None:
    """The model flags; ``several`` (help text) makes ``--model`` repeatable (``loom serve``)."""
    parser.add_argument(
        "--model",
        metavar="MODEL",
        action="append" if several else "store",
        help="model directory, Hugging Face repo id (org/name[@revision]) or short name "
        f"(default: {BUNDLED_MODEL_ALIAS!r}, the bundled tiny MiniCPM5 model; "
        "`loom models` lists what is here)" + (f"; {several}" if several else ""),
    )
    parser.add_argument(
        "--kernel-backend", choices=["metal", "cuda", "cpu"], help="pin the kernel backend"
    )
    parser.add_argument(
        "--adapter-path",
        metavar="DIR",
        help="a LoRA/DoRA adapter directory (mlx-lm's adapter_config.json + adapters.safetensors)",
    )
    add_cpu_path_options(parser)
    doors.add_parallel_option(parser)
    group = parser.add_argument_group("chat template budget")
    group.add_argument(
        "--template-timeout",
        type=TEMPLATE_TIMEOUT,
        metavar="SECONDS",
        help=f"time one chat-template render may take (default: {ENV_TIMEOUT} or 1)",
    )
    group.add_argument(
        "--template-max-output",
        type=TEMPLATE_MAX_OUTPUT,
        metavar="CHARS",
        help=f"longest prompt text a chat template may render (default: {ENV_MAX_OUTPUT} or 2Mi)",
    )


def template_budget_from_args(args: argparse.Namespace) -> TemplateBudget:
    """The chat-template budget: the flags, else the environment, else the defaults."""
    return TemplateBudget.from_env().replaced(
        {"timeout_s": args.template_timeout, "max_output_chars": args.template_max_output},
        names={"timeout_s": "--template-timeout", "max_output_chars": "--template-max-output"},
    )


def add_kv_cache_options(group: Any, *, whose: str) -> None:
    """The KV cache flags ``loom generate``, ``chat`` and ``serve`` share; ``whose``
    names the cache they store (``"the KV cache"``, ``"every request's KV cache"``)."""
    group.add_argument(
        "--kv-bits",
        type=flags.KV_BITS_FLAG,
        metavar="{2,3,4,5,6,8}",
        help=f"quantize {whose} to this many bits (4 and 8 are the usual choices; "
        "default: not quantized)",
    )
    group.add_argument(
        "--kv-codec",
        type=flags.KV_CODEC,
        metavar="NAME",
        help=f"how {whose} is stored: 'affine' (the default with --kv-bits) or "
        "'turboquant' (int8 keys, 3- or 4-bit rotated values; --kv-bits 3|4, default 4), "
        "or a codec a plugin registers",
    )
    group.add_argument(
        "--kv-dtype",
        choices=["float16", "bfloat16"],
        help=f"store {whose} in this dtype: half the bytes of the CPU's float32 "
        "(default: the compute dtype; not with --kv-bits / --kv-codec; see docs/cpu.md)",
    )
    group.add_argument(
        "--kv-group-size",
        type=flags.KV_GROUP_SIZE,
        metavar="{32,64,128}",
        help="elements per quantization group; must divide the head dimension "
        "(default: 64, or 32 when 64 does not divide it)",
    )
    group.add_argument(
        "--quantized-kv-start",
        type=flags.QUANTIZED_KV_START,
        default=0,
        metavar="N",
        help="quantize once the cache holds this many tokens (default: 0)",
    )


def add_cpu_path_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--compute-dtype",
        choices=["checkpoint", "float32", "bfloat16", "float16"],
        help="dtype activations run in (default on the CPU: float32; elsewhere: checkpoint)",
    )
    parser.add_argument(
        "--cpu-kernels",
        choices=["cpu-native", "cpu-native-int8-act", "cpu-ops"],
        help="kernel set for the matrix products on the CPU (default: cpu-native where it "
        "runs; cpu-native-int8-act: 4-bit products on int8 activations, bounded error)",
    )


def add_sampling_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument(
        "--max-tokens", "-m", type=flags.MAX_TOKENS, default=256, metavar="N", help="default: 256"
    )
    # Left out (None): the built-in default, or the checkpoint's with --generation-config.
    group.add_argument("--temp", type=flags.TEMP, metavar="T", help="0 = greedy (default)")
    group.add_argument(
        "--top-p", type=flags.TOP_P, metavar="P", help="in (0, 1]; default: 1 (off)"
    )
    group.add_argument("--top-k", type=flags.TOP_K, metavar="K", help="default: 0 (off)")
    group.add_argument(
        "--min-p", type=flags.MIN_P, metavar="P", help="in [0, 1]; default: 0 (off)"
    )
    group.add_argument(
        "--generation-config",
        action="store_true",
        help="apply the checkpoint's generation_config.json sampling values (temperature, "
        "top_p, top_k, min_p, repetition_penalty) where no flag sets them, as loom serve does "
        "(default: off, as in mlx-lm)",
    )
    group.add_argument(
        "--repetition-penalty",
        type=flags.REPETITION_PENALTY,
        metavar="R",
        help="> 0; 1.0 is neutral",
    )
    group.add_argument(
        "--presence-penalty", type=flags.PRESENCE_PENALTY, metavar="X", help="0 = off"
    )
    group.add_argument(
        "--frequency-penalty", type=flags.FREQUENCY_PENALTY, metavar="X", help="0 = off"
    )
    group.add_argument(
        "--xtc-probability",
        type=flags.XTC_PROBABILITY,
        metavar="P",
        help="in [0, 1]: the chance per token that XTC cuts the top choices; default: 0 (off)",
    )
    group.add_argument(
        "--xtc-threshold",
        type=flags.XTC_THRESHOLD,
        metavar="T",
        help="in [0, 0.5]: XTC cuts tokens at least this likely (default: 0.1)",
    )
    group.add_argument("--seed", type=flags.SEED, metavar="S", help="default: a fresh random seed")
    group.add_argument(
        "--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)"
    )
    cache = parser.add_argument_group("KV cache")
    add_kv_cache_options(cache, whose="the KV cache")
    cache.add_argument(
        "--prefill-step-size",
        type=flags.PREFILL_STEP_SIZE,
        default=None,
        metavar="N",
        help="prompt tokens per prefill forward (default: 512 on the native CPU kernels, "
        "else 2048)",
    )


def kv_group_size(args: argparse.Namespace, model: Model) -> int:
    """The KV quantization group size: the engine's one rule (:mod:`mlx_loom.engine.kv_groups`),
    applied once the model is known, its refusal spoken in flags (exit 2)."""
    try:
        return kv_group_size_for(
            model, args.kv_group_size, kv_bits=args.kv_bits, kv_codec=args.kv_codec
        )
    except RequestError as err:
        fix = flags.speak_flags(err.fix) if err.fix else None
        raise UsageError(flags.speak_flags(err.message), fix=fix) from None


def sampling_kwargs(args: argparse.Namespace, model: Model) -> dict[str, Any]:
    """The ``stream_generate`` options the shared flags ask for."""
    options: dict[str, Any] = dict(
        max_tokens=args.max_tokens,
        seed=args.seed,
        stop=args.stop,
        kv_bits=args.kv_bits,
        kv_group_size=kv_group_size(args, model),
        quantized_kv_start=args.quantized_kv_start,
        kv_codec=args.kv_codec,
        prefill_step_size=args.prefill_step_size,
    )
    if args.generation_config:
        options.update(generation_defaults(model.model_dir))
    given = {
        "temperature": args.temp,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "repetition_penalty": args.repetition_penalty,
        "presence_penalty": args.presence_penalty,
        "frequency_penalty": args.frequency_penalty,
        "xtc_probability": args.xtc_probability,
        "xtc_threshold": args.xtc_threshold,
    }
    options.update((name, value) for name, value in given.items() if value is not None)
    return options


def load_from_args(args: argparse.Namespace):
    model, tokenizer = load(
        args.model or BUNDLED_MODEL_ALIAS,
        kernel_backend=args.kernel_backend,
        adapter_path=args.adapter_path,
        compute_dtype=args.compute_dtype,
        cpu_kernels=args.cpu_kernels,
        kv_dtype=getattr(args, "kv_dtype", None),
        parallel=args.parallel,
    )
    doors.silence_followers(model)
    return model, tokenizer


def print_stats(last, out=None) -> None:
    if last is None:
        return
    out = out or sys.stderr
    print("=" * 10, file=out)
    cached = f" ({last.cached_tokens} reused from cache)" if last.cached_tokens else ""
    print(
        f"Prompt: {last.prompt_tokens} tokens{cached}, {last.prompt_tps:.3f} tokens-per-sec",
        file=out,
    )
    print(
        f"Generation: {last.generation_tokens} tokens, {last.generation_tps:.3f} tokens-per-sec",
        file=out,
    )
    print(f"Peak memory: {last.peak_memory:.3f} GB", file=out)


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "generate",
        help="generate text from a prompt",
        description="Stream a completion for one prompt, then print prompt and generation "
        "speed and peak memory (on stderr).",
    )
    parser.add_argument(
        "prompt_text",
        nargs="?",
        metavar="PROMPT",
        help=f"the prompt ('-' reads stdin; default: {DEFAULT_PROMPT!r})",
    )
    add_model_options(parser)
    parser.add_argument(
        "--prompt", "-p", metavar="PROMPT", help="the prompt, as a flag (as in mlx-lm)"
    )
    parser.add_argument(
        "--system",
        "--system-prompt",
        dest="system",
        metavar="TEXT",
        help="system message for the chat template",
    )
    parser.add_argument(
        "--no-chat-template",
        "--ignore-chat-template",
        dest="no_chat_template",
        action="store_true",
        help="feed the prompt as raw text, without the model's chat template",
    )
    parser.add_argument(
        "--max-kv-size",
        type=flags.KV_WINDOW,
        metavar="N",
        help="keep at most N tokens in each attention layer's cache, a sliding window "
        "(mlx-lm's flag; refused for models whose caches cannot be bounded; "
        "default: the whole context)",
    )
    parser.add_argument("--verbose", action="store_true", help="also show what was resolved")
    add_structured_options(parser)
    add_speculation_options(parser)
    add_sampling_options(parser)
    parser.set_defaults(handler=run, _parser=parser)


def add_structured_options(parser: argparse.ArgumentParser) -> None:
    """--json-schema / --grammar, shared by ``loom generate`` and ``loom chat``."""
    structured = parser.add_argument_group("structured output")
    structured.add_argument(
        "--json-schema",
        metavar="FILE",
        help="hold the output (in chat: every reply) to the JSON schema in FILE, enforced "
        "while decoding",
    )
    structured.add_argument(
        "--grammar",
        metavar="FILE",
        help="hold the output (in chat: every reply) to the grammar in FILE: Lark, or "
        "llama.cpp's GBNF",
    )


def constraint_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``response_format=`` / ``grammar=`` from --json-schema / --grammar (one of them)."""
    if args.json_schema is not None and args.grammar is not None:
        raise usage_error(
            "--grammar",
            "both --json-schema and --grammar were given; the output follows one",
            "pass one of them",
        )
    flag, path = ("--grammar", args.grammar)
    if args.json_schema is not None:
        flag, path = "--json-schema", args.json_schema
    if path is None:
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(MAX_SOURCE_BYTES + 1)
    except (OSError, UnicodeDecodeError) as err:
        raise usage_error(
            flag, f"{path} could not be read ({err})", "pass a readable text file"
        ) from None
    if flag == "--grammar":
        return {"grammar": text}
    return {"response_format": {"type": "json_schema", "json_schema": {"schema": text}}}


def prompt_from_args(args: argparse.Namespace) -> str:
    if args.prompt_text is not None and args.prompt is not None:
        raise usage_error(
            "--prompt",
            "the prompt was given twice, as an argument and with --prompt",
            'pass the prompt once: `loom generate "..."` or `loom generate --prompt "..."`',
        )
    prompt = args.prompt_text if args.prompt_text is not None else args.prompt
    if prompt is None:
        return DEFAULT_PROMPT
    return sys.stdin.read() if prompt == "-" else prompt


def run(args: argparse.Namespace) -> int:
    # Split across ranks, rank 0 alone reads the prompt (stdin may be its alone).
    prompt = None if args.parallel else prompt_from_args(args)
    template_budget = template_budget_from_args(args)
    model, tokenizer = load_from_args(args)
    if prompt is None:
        prompt = doors.shared_input(model, lambda: prompt_from_args(args))
    options = sampling_kwargs(args, model)
    if args.max_kv_size is not None:
        options["max_kv_size"] = args.max_kv_size
    if args.verbose:
        codec, bits = resolve_kv_codec(args.kv_codec, args.kv_bits, kinds=model.binding.cache_kinds)
        kv = ""
        if codec is not None and codec.name == "affine":
            kv = f"  kv cache: {bits}-bit, group {options['kv_group_size']}"
        elif codec is not None:
            kv = f"  kv cache: {codec.name}, {bits}-bit"
        print(
            f"model: {model.model_dir}\nprofile: {model.profile.id} ({model.profile_reason})\n"
            f"implementation: {model.implementation.id}  backend: {model.backend}" + kv,
            file=sys.stderr,
        )
    if not args.no_chat_template and tokenizer.has_chat_template:
        messages = []
        if args.system:
            messages.append({"role": "system", "content": args.system})
        messages.append({"role": "user", "content": prompt})
        ids = tokenizer.encode_chat(messages, template_budget=template_budget)
    else:
        ids = prompt
    options.update(speculation_kwargs(args))
    options.update(constraint_kwargs(args))
    last = None
    for last in stream_generate(model, tokenizer, ids, **options):
        print(last.text, end="", flush=True)
    print(flush=True)
    print_stats(last)
    split = doors.finish(model)
    if split:
        print(split, file=sys.stderr)
    return 0
