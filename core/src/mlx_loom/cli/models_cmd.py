"""``loom models``: what can be run here, by the name that runs it.

The bundled model and every snapshot in the local Hugging Face cache are
resolved exactly as ``loom generate --model NAME`` would resolve them —
config, plugin claim, profile, implementation, kernels — from headers only,
so the list never promises a model that would then be refused. Those that
would be refused are hidden unless ``--all`` asks for them, with the reason.
"""

from __future__ import annotations

import argparse
import json

from pydantic import BaseModel, ConfigDict

from ..artifacts import read_config
from ..artifacts.catalog import LocalModel, local_models
from ..artifacts.summary import WeightsSummary, summarize_artifact
from ..errors import LoomError
from ..host import PluginHost, resolve_model


class ModelEntry(BaseModel):
    """One row of ``loom models`` (and one object of ``--json``)."""

    model_config = ConfigDict(frozen=True)

    name: str
    path: str
    source: str
    runnable: bool
    reason: str | None = None
    model_type: str | None = None
    plugin: str | None = None
    weights: WeightsSummary | None = None


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "models",
        help="list the models on this machine that can be run",
        description="List the bundled model and the Hugging Face cache snapshots an installed "
        "plugin can run, with parameter count, dtype, quantization, context length and size on "
        "disk. NAME is what to pass to --model. Nothing is downloaded and no weights are loaded.",
    )
    parser.add_argument(
        "--all", action="store_true", help="also list models that cannot run here, and why"
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(handler=run, _parser=parser)


def describe(found: LocalModel, host: PluginHost) -> ModelEntry:
    """Resolve one model as ``--model`` would, and summarise its weights."""
    base = {"name": found.name, "path": str(found.path), "source": found.source}
    try:
        config = read_config(found.path)
    except LoomError as err:
        return ModelEntry(**base, runnable=False, reason=err.message)
    base["model_type"] = config.model_type
    try:
        resolved = resolve_model(found.path, host=host)
        weights = summarize_artifact(found.path, config)
    except LoomError as err:
        return ModelEntry(**base, runnable=False, reason=err.message)
    return ModelEntry(**base, runnable=True, plugin=resolved.summary.plugin, weights=weights)


def run(args: argparse.Namespace) -> int:
    host = PluginHost()
    entries = [describe(found, host) for found in local_models()]
    shown = entries if args.all else [e for e in entries if e.runnable]
    if args.json:
        print(json.dumps([e.model_dump(mode="json") for e in shown], indent=2))
        return 0
    hidden = len(entries) - len(shown)
    if not shown:
        print("No model here can be run by the installed plugins.")
    else:
        print_table(shown)
    if hidden:
        print(f"({hidden} more cannot run here; `loom models --all` says why.)")
    return 0


COLUMNS = ("NAME", "MODEL TYPE", "PARAMS", "DTYPE", "QUANT", "CONTEXT", "SIZE")


def print_table(entries: list[ModelEntry]) -> None:
    rows = [COLUMNS]
    for e in entries:
        w = e.weights
        rows.append(
            (
                e.name,
                e.model_type or "?",
                human_count(w.parameters) if w else "-",
                (w.dtype or "-") if w else "-",
                (w.quantization or "-") if w else "-",
                str(w.context_length) if w and w.context_length else "-",
                human_bytes(w.weights_bytes) if w else "-",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    for row in rows:
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        )
    for e in entries:
        if not e.runnable:
            print(f"{e.name}: cannot run here: {e.reason}")


def human_count(n: int) -> str:
    """``2359296`` -> ``2.4M``: parameter counts the way model cards write them."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def human_bytes(n: int) -> str:
    """Decimal units, as the Hugging Face Hub shows file sizes."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
