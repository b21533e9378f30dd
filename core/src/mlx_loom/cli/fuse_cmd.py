"""``loom fuse``: fold a LoRA/DoRA adapter into its base model and write the result.

The flags are ``mlx_lm.fuse``'s (``--de-quantize`` is accepted as an older
spelling of ``--dequantize``); GGUF export is refused with the way to get one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..artifacts import INDEX_FILE
from ..convert import fuse
from ..errors import Refusal


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "fuse",
        help="fuse a LoRA/DoRA adapter into its base model",
        description="Apply an mlx-lm adapter to its base model, fold it into the weights "
        "and write an ordinary checkpoint (loadable without the adapter, by mlx-loom and "
        "mlx-lm).",
    )
    parser.add_argument("--model", default="mlx_model", help="base model directory or repo id")
    parser.add_argument("--save-path", default="fused_model", help="output directory")
    parser.add_argument("--adapter-path", default="adapters", help="the adapter directory")
    parser.add_argument("--upload-repo", help="a Hugging Face repo to upload the result to")
    parser.add_argument(
        "--dequantize",
        "--de-quantize",
        dest="dequantize",
        action="store_true",
        help="write a quantized base (and the fused layers) dense",
    )
    parser.add_argument(
        "--export-gguf", action="store_true", help="refused: mlx-loom does not write GGUF"
    )
    parser.add_argument("--gguf-path", help="(only with --export-gguf)")
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="accepted for mlx-lm compatibility and refused: mlx-loom runs no checkpoint code",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(handler=run, _parser=parser)


def describe_output(path: Path) -> str:
    index = json.loads((path / INDEX_FILE).read_text())
    shards = len(set(index["weight_map"].values()))
    size = index["metadata"]["total_size"]
    shown = f"{size / 1e9:.2f} GB" if size >= 1e9 else f"{size / 1e6:.2f} MB"
    return (
        f"loom: wrote {path} ({len(index['weight_map'])} tensors, {shown} "
        f"in {shards} shard{'s' if shards != 1 else ''})"
    )


def run(args: argparse.Namespace) -> int:
    from .convert_cmd import refuse_remote_code  # convert_cmd imports this module

    refuse_remote_code(args)
    if args.export_gguf or args.gguf_path:
        raise Refusal(
            "--export-gguf: mlx-loom writes MLX safetensors only",
            fix="fuse with --dequantize, then convert the fused directory with llama.cpp's "
            "convert_hf_to_gguf.py",
        )
    path = fuse(
        args.model,
        args.adapter_path,
        args.save_path,
        dequantize=args.dequantize,
        upload_repo=args.upload_repo,
        progress=not args.no_progress,
    )
    print(describe_output(path), file=sys.stderr)
    return 0
