"""``loom explain MODEL``: the whole resolution, without loading weights."""

from __future__ import annotations

import argparse
import json

from ..host import PluginHost, resolve_model


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "explain",
        help="show how a model would be resolved, without loading weights",
        description="Print the model type, the chosen profile and why, the implementation, "
        "and the kernel backend of each needed kernel on this device — or the refusal and its "
        "fix.",
    )
    parser.add_argument("model", help="model directory or Hugging Face repo id")
    parser.add_argument(
        "--kernel-backend", choices=["metal", "cuda", "cpu"], help="pin the kernel backend"
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(handler=run, _parser=parser)


def run(args: argparse.Namespace) -> int:
    resolved = resolve_model(args.model, host=PluginHost(), kernel_backend=args.kernel_backend)
    summary = resolved.summary
    if args.json:
        print(json.dumps(summary.model_dump(mode="json"), indent=2))
        return 0
    rows = [
        ("model", summary.model_dir),
        ("model type", summary.model_type),
        ("plugin", summary.plugin or "-"),
        ("profile", f"{summary.profile}  ({summary.profile_reason})"),
        ("implementation", summary.implementation),
        ("graph / loader / loop", f"{summary.graph} / {summary.loader} / {summary.loop}"),
        ("kernel backend", summary.backend),
        ("capabilities", ", ".join(summary.capabilities) or "-"),
        ("config fingerprint", summary.config_fingerprint),
        ("artifact fingerprint", summary.artifact_fingerprint),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    if summary.kernels:
        print("kernels:")
        for k in summary.kernels:
            print(f"  {k.name}: {k.backend}  (registered: {', '.join(k.registered_backends)})")
    else:
        print("kernels: none needed")
    return 0
