"""The speculative-decoding flags every generating command shares.

``--draft-model MODEL`` drafts with a second, smaller model (mlx-lm's flag);
``--draft ngram`` drafts by prompt lookup, with no second model (vLLM's
``ngram`` method); ``--draft mtp`` drafts with the model's own
multi-token-prediction head (checkpoints that ship ``mtp.*`` weights);
``--num-draft-tokens N`` sets how many tokens a draft
proposes per step. ``loom generate``, ``loom chat`` and ``loom serve`` read
them the same way.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..engine.request import DRAFT_MODES, Speculation
from ..loader import load
from . import flags


def add_speculation_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("speculative decoding")
    group.add_argument(
        "--draft-model",
        metavar="MODEL",
        help="a smaller model with the same tokenizer, for speculative decoding",
    )
    group.add_argument(
        "--draft",
        choices=DRAFT_MODES,
        help="draft without a second model: 'ngram' proposes the tokens that followed the "
        "latest earlier occurrence of the text's last few tokens (prompt lookup); 'mtp' "
        "drafts with the model's own multi-token-prediction head (checkpoints that ship "
        "mtp.* weights)",
    )
    group.add_argument(
        "--num-draft-tokens",
        type=flags.NUM_DRAFT_TOKENS,
        default=3,
        metavar="N",
        help="tokens the draft proposes per step (default: 3)",
    )


def speculation_from_args(args: argparse.Namespace) -> Speculation | None:
    """The speculation the flags ask for, the draft model loaded (``None``: none)."""
    if args.draft_model and args.draft:
        raise flags.usage_error(
            "--draft",
            "--draft and --draft-model were both given; a generation has one drafter",
            "pass --draft-model MODEL to draft with a model, or --draft ngram|mtp, not both",
        )
    if args.draft_model:
        # The draft runs on the same backend, compute dtype, CPU kernels and KV
        # storage dtype as the model.
        draft, _ = load(
            args.draft_model,
            kernel_backend=args.kernel_backend,
            compute_dtype=args.compute_dtype,
            cpu_kernels=args.cpu_kernels,
            kv_dtype=getattr(args, "kv_dtype", None),
        )
        return Speculation(draft, args.num_draft_tokens)
    if args.draft:
        return Speculation(None, args.num_draft_tokens, mtp=args.draft == "mtp")
    return None


def speculation_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``stream_generate`` keyword options for the speculation flags."""
    spec = speculation_from_args(args)
    if spec is None:
        return {}
    drafter: Any = spec.draft if spec.draft is not None else spec.mode
    return {"draft_model": drafter, "num_draft_tokens": spec.num_draft}
