"""``loom explain MODEL``: the whole resolution, without loading weights."""

from __future__ import annotations

import argparse
import json

from ..artifacts.summary import summarize_artifact
from ..cpu import native
from ..cpu.compiled_step import describe as describe_step
from ..cpu.path import describe_quantized_products
from ..device import DeviceReport, report
from ..engine.defaults import generation_defaults
from ..engine.settings import DEFAULT_PREFILL_STEP, prefill_step_for
from ..host import PluginHost, resolve_model
from .generate_cmd import add_cpu_path_options
from .models_cmd import human_bytes, human_count


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "explain",
        help="show how a model would be resolved, without loading weights",
        description="Print the model type, parameter count, dtype, quantization and context "
        "length, the sampling defaults from generation_config.json, the chosen profile and why, the implementation, and the kernel backend of each "
        "needed kernel on this device — or the refusal and its fix. Only config.json and the "
        "safetensors headers are read.",
    )
    parser.add_argument(
        "model", help="model directory, Hugging Face repo id (org/name[@revision]) or short name"
    )
    parser.add_argument(
        "--kernel-backend", choices=["metal", "cuda", "cpu"], help="pin the kernel backend"
    )
    add_cpu_path_options(parser)
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(handler=run, _parser=parser)


def run(args: argparse.Namespace) -> int:
    resolved = resolve_model(
        args.model,
        host=PluginHost(),
        kernel_backend=args.kernel_backend,
        compute_dtype=args.compute_dtype,
        cpu_kernels=args.cpu_kernels,
    )
    summary = resolved.summary
    weights = summarize_artifact(resolved.model_dir, resolved.config)
    # What `loom serve` applies to a request that omits them (without its flags).
    sampling = generation_defaults(resolved.model_dir)
    device = report()
    native_why = native.unavailable_reason()
    if args.json:
        payload = {
            **summary.model_dump(mode="json"),
            "weights": weights.model_dump(mode="json"),
            "quantized_products": describe_quantized_products(
                summary.cpu, weights.quantization_modes
            ),
            "sampling_defaults": sampling,
            "prefill_step_size": prefill_step_for(summary.cpu.kernel_set),
            "mlx": {
                "backend": device.backend,
                "packages": list(device.packages),
                "device": device.device,
                "memory_bytes": device.memory_bytes,
                "working_set_bytes": device.working_set_bytes,
                "problem": device.problem,
                "native_cpu_kernels": native_why or "available",
            },
        }
        print(json.dumps(payload, indent=2))
        return 0
    rows = [
        ("model", summary.model_dir),
        ("model type", summary.model_type),
        ("parameters", f"{human_count(weights.parameters)} ({weights.parameters:,})"),
        ("dtype", weights.dtype or "-"),
        ("quantization", weights.quantization or "none"),
        ("context length", str(weights.context_length or "not declared")),
        ("weights on disk", human_bytes(weights.weights_bytes)),
        ("plugin", summary.plugin or "-"),
        ("profile", f"{summary.profile}  ({summary.profile_reason})"),
        ("implementation", summary.implementation),
        ("graph / loader / loop", f"{summary.graph} / {summary.loader} / {summary.loop}"),
        ("kernel backend", summary.backend),
        ("compute dtype", f"{summary.cpu.compute_dtype}  ({summary.cpu.compute_dtype_reason})"),
        ("cpu kernels", summary.cpu.describe_kernels()),
        (
            "quantized products",
            describe_quantized_products(summary.cpu, weights.quantization_modes) or "none",
        ),
        ("decode step", describe_step(summary.cpu.kernel_set, frozenset(summary.capabilities))),
        ("prefill chunk", _prefill_chunk(summary.cpu.kernel_set)),
        ("capabilities", ", ".join(summary.capabilities) or "-"),
        (
            "sampling defaults",
            (", ".join(f"{k}={v}" for k, v in sampling.items()) or "none (greedy)")
            + "  (generation_config.json; loom serve applies them)",
        ),
        ("mlx backend", _backend(device)),
        ("device", device.device),
        ("memory", _memory(device)),
        ("native cpu kernels", native_why or native.describe_available()),
        ("config fingerprint", summary.config_fingerprint),
        ("artifact fingerprint", summary.artifact_fingerprint),
    ]
    if device.problem is not None:
        rows.append(("mlx install problem", device.problem))
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


def _prefill_chunk(kernel_set: str | None) -> str:
    step = prefill_step_for(kernel_set)
    why = (
        "the native CPU kernels: rows independent, less peak memory"
        if step != DEFAULT_PREFILL_STEP
        else "mlx-lm's default"
    )
    return f"{step} tokens  ({why}; --prefill-step-size to change)"


def _backend(device: DeviceReport) -> str:
    packages = ", ".join(device.packages) or "mlx built without a separate backend package"
    return f"{device.backend}  ({packages})"


def _memory(device: DeviceReport) -> str:
    if device.memory_bytes is None:
        return "not reported"
    text = human_bytes(device.memory_bytes)
    if device.working_set_bytes is not None:
        wired = human_bytes(device.working_set_bytes)
        text += f"  (recommended working set {wired}, wired while generating)"
    elif device.backend == "cpu":
        text += "  (system memory)"
    return text
