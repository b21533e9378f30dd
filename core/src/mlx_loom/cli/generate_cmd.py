"""``loom generate``: stream one completion to the terminal."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..assets import default_model_path
from ..generate import stream_generate
from ..host import load


def add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        help="model directory or Hugging Face repo id (default: the bundled tiny MiniCPM5 model)",
    )
    parser.add_argument(
        "--kernel-backend", choices=["metal", "cuda", "cpu"], help="pin the kernel backend"
    )
    parser.add_argument(
        "--adapter-path",
        help="a LoRA/DoRA adapter directory (mlx-lm's adapter_config.json + adapters.safetensors)",
    )


def add_sampling_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", "-m", type=int, default=256, help="default: 256")
    group.add_argument("--temp", type=float, default=0.0, help="0 = greedy (default)")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0, help="0 = off")
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--repetition-penalty", type=float)
    group.add_argument("--presence-penalty", type=float)
    group.add_argument("--frequency-penalty", type=float)
    group.add_argument("--seed", type=int)
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    cache = parser.add_argument_group("KV cache")
    cache.add_argument("--kv-bits", type=int, help="quantize the KV cache to 4 or 8 bits")
    cache.add_argument("--kv-group-size", type=int, default=64)
    cache.add_argument("--quantized-kv-start", type=int, default=0)
    cache.add_argument("--prefill-step-size", type=int, default=2048)


def sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = dict(
        max_tokens=args.max_tokens,
        temperature=args.temp,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        stop=args.stop,
        kv_bits=args.kv_bits,
        kv_group_size=args.kv_group_size,
        quantized_kv_start=args.quantized_kv_start,
        prefill_step_size=args.prefill_step_size,
    )
    for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    return options


def load_from_args(args: argparse.Namespace):
    model_ref = args.model or default_model_path()
    return load(model_ref, kernel_backend=args.kernel_backend, adapter_path=args.adapter_path)


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
        "speed and peak memory.",
    )
    add_model_options(parser)
    parser.add_argument("--prompt", "-p", default="Once upon a time", help="'-' reads stdin")
    parser.add_argument("--system", help="system message for the chat template")
    parser.add_argument(
        "--no-chat-template", action="store_true", help="feed the prompt as raw text"
    )
    parser.add_argument("--verbose", action="store_true", help="also show what was resolved")
    parser.add_argument(
        "--draft-model", help="a smaller model with the same tokenizer, for speculative decoding"
    )
    parser.add_argument("--num-draft-tokens", type=int, default=3)
    add_sampling_options(parser)
    parser.set_defaults(handler=run, _parser=parser)


def run(args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    model, tokenizer = load_from_args(args)
    if args.verbose:
        print(
            f"model: {model.model_dir}\nprofile: {model.profile.id} ({model.profile_reason})\n"
            f"implementation: {model.implementation.id}  backend: {model.backend}",
            file=sys.stderr,
        )
    if not args.no_chat_template and tokenizer.has_chat_template:
        messages = []
        if args.system:
            messages.append({"role": "system", "content": args.system})
        messages.append({"role": "user", "content": prompt})
        ids = tokenizer.encode_chat(messages)
    else:
        ids = prompt
    options = sampling_kwargs(args)
    if args.draft_model:
        options["draft_model"], _ = load(args.draft_model, kernel_backend=args.kernel_backend)
        options["num_draft_tokens"] = args.num_draft_tokens
    last = None
    for last in stream_generate(model, tokenizer, ids, **options):
        print(last.text, end="", flush=True)
    print()
    print_stats(last)
    return 0
