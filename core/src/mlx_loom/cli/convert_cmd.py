"""``loom convert``: a Hugging Face checkpoint to MLX (cast, quantized or dequantized).

The flags are ``mlx_lm.convert``'s, so its commands work unchanged; see
:mod:`mlx_loom.convert` for what each does.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..artifacts import INDEX_FILE, MODE_PACKING, SUPPORTED_BITS, SUPPORTED_GROUP_SIZES
from ..convert import DTYPES, MODES, RECIPES, convert
from ..errors import Refusal
from .fuse_cmd import describe_output


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "convert",
        help="convert a Hugging Face checkpoint to MLX, optionally quantized",
        description="Read a checkpoint through its family plugin and write it as MLX "
        "safetensors (sharded, with an index), config.json and the tokenizer files. "
        "Tensors are read, transformed and written one at a time.",
    )
    parser.add_argument(
        "--hf-path",
        "--model",
        dest="hf_path",
        required=True,
        help="model directory or Hugging Face repo id",
    )
    parser.add_argument("--mlx-path", default="mlx_model", help="output directory (must not exist)")
    parser.add_argument("-q", "--quantize", action="store_true", help="quantize the weights")
    parser.add_argument(
        "--q-group-size",
        type=int,
        choices=sorted({*SUPPORTED_GROUP_SIZES, *(g for g, _ in MODE_PACKING.values())}),
        help="quantization group size (default 64 for affine; a microscaling mode fixes it)",
    )
    parser.add_argument(
        "--q-bits",
        type=int,
        choices=SUPPORTED_BITS,
        help="bits per weight (default 4 for affine; a microscaling mode fixes it)",
    )
    parser.add_argument(
        "--q-mode",
        default="affine",
        choices=MODES,
        help="quantization mode: affine (group 32/64/128, 2-8 bits, float scales and biases), "
        "or MLX's microscaling mxfp4 (group 32, 4 bits), nvfp4 (group 16, 4 bits), mxfp8 "
        "(group 32, 8 bits) with uint8 scales; every mode loads in mlx-loom and mlx-lm, and "
        "the native CPU kernels run affine only (loom explain says which products run where)",
    )
    parser.add_argument(
        "--quant-predicate", choices=list(RECIPES), help="a mixed-bit quantization recipe"
    )
    parser.add_argument(
        "--dtype",
        choices=list(DTYPES),
        help="dtype of the unquantized parameters (default: config.json's torch_dtype)",
    )
    parser.add_argument("--upload-repo", help="a Hugging Face repo to upload the result to")
    parser.add_argument(
        "-d", "--dequantize", action="store_true", help="write a quantized model dense"
    )
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="accepted for mlx-lm compatibility and refused: mlx-loom runs no checkpoint code",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(handler=run, _parser=parser)


def refuse_remote_code(args: argparse.Namespace) -> None:
    if args.trust_remote_code:
        raise Refusal(
            "--trust-remote-code asks to run code shipped with the checkpoint, which mlx-loom "
            "never does (model families are installed plugins)",
            fix="drop --trust-remote-code; if no installed plugin reads this model type, "
            "install the family plugin for it",
        )


def run(args: argparse.Namespace) -> int:
    refuse_remote_code(args)
    path = convert(
        args.hf_path,
        args.mlx_path,
        quantize_=args.quantize,
        q_group_size=args.q_group_size,
        q_bits=args.q_bits,
        q_mode=args.q_mode,
        dtype=args.dtype,
        quant_predicate=args.quant_predicate,
        dequantize=args.dequantize,
        upload_repo=args.upload_repo,
        progress=not args.no_progress,
    )
    print(describe_output(path), file=sys.stderr)
    if args.quantize:
        note = nothing_packed_note(path)
        if note:
            print(note, file=sys.stderr)
    return 0


def nothing_packed_note(path: Path) -> str | None:
    """A note when ``-q`` packed no module, or ``None``.

    Like ``mlx_lm.convert``, a module whose input width is not a multiple of
    the group size stays dense; when that is every module, the output declares
    quantization and holds only dense weights. It loads (a module is quantized
    exactly when its scales are present) but is not what ``-q`` was asked for.
    """
    names = json.loads((path / INDEX_FILE).read_text())["weight_map"]
    if any(name.endswith(".scales") for name in names):
        return None
    spec = json.loads((path / "config.json").read_text()).get("quantization") or {}
    group = spec.get("group_size")
    smallest = min(SUPPORTED_GROUP_SIZES)
    affine = spec.get("mode", "affine") == "affine"  # a microscaling mode fixes its group
    hint = f"; --q-group-size {smallest} may pack them" if affine and group != smallest else ""
    return (
        f"loom: note: no module was quantized: no weight's input width is a multiple of "
        f"group size {group}, so every weight stays dense (as mlx_lm.convert does){hint}"
    )
