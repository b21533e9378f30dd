"""``mlx_loom.load``: a model reference in, a built model and its tokenizer out.

Model building, the layer above the host: the host resolves a reference to
a binding (:func:`mlx_loom.host.resolve_model`, with the default plugin
snapshot, :func:`mlx_loom.host.default_host`, unless a ``host`` or
``registry`` is passed); this module runs the factory, splits the model
across ranks, applies the CPU path and the adapter, and wraps the result.

The core owns evaluation: a factory returns its graph with the checkpoint's
arrays loaded but *lazy*; :func:`build_model` evaluates every parameter once
(unless ``lazy=True``) and then checks that no floating parameter holds NaN
or Inf, naming the tensor — a corrupt or badly converted checkpoint is a
:class:`~mlx_loom.errors.WeightsError` at load, not garbage at the first
token.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .adapters import load_adapter
from .artifacts.fingerprint import weights_identity
from .artifacts.finite import named_list, non_finite
from .artifacts.weights import recording_sources
from .backends import Backend
from .cache.codecs import resolve_kv_dtype
from .causal_lm import CausalLM
from .cpu.path import apply_cpu_path
from .errors import ImplementationFailed, LoomError, ParallelRefused, WeightsError
from .host import (
    BuildContext,
    PluginHost,
    PluginPolicy,
    Registry,
    Resolved,
    resolve_model,
)
from .model import Model
from .parallel.build import Parallel, prepare, split_model, wrap
from .parallel.lockstep import Lockstep, share_seed
from .text import Tokenizer


def build_model(
    resolved: Resolved,
    *,
    lazy: bool = False,
    parallel: str | None = None,
    group: Any = None,
) -> Model:
    """Run the selected implementation's factory and wrap the result.

    ``lazy=False`` (the default) evaluates every parameter now and refuses
    NaN/Inf weights; ``lazy=True`` leaves the arrays lazy (read on first
    use), so neither the load cost nor the finiteness check is paid here.
    ``parallel`` (``"tensor"`` or ``"pipeline"``) keeps this rank's part of
    the model across ``group`` (default: ``mx.distributed.init()``); the
    slices of split tensors are read as the plan is applied, so ``lazy=True``
    defers only the tensors every rank holds whole.
    """
    binding = resolved.binding
    info: Parallel | None = None
    # Which weights, taken before they are read: a prompt cache names them.
    weights = weights_identity(resolved.model_dir)
    if parallel is None:
        module = _run_factory(resolved)
        apply_cpu_path(module, resolved.summary.cpu)
        if not lazy:
            _evaluate_all(module)
    else:
        group = prepare(parallel, group, implementation=binding.implementation)
        lockstep = Lockstep(group)
        try:
            module, info = _build_split(resolved, parallel, group)
            if not lazy:
                _evaluate_all(module)
        except Exception:
            lockstep.agree(False)
            raise
        loaded = lockstep.agree(True)
        if not all(loaded):
            failed = [rank for rank, ok in enumerate(loaded) if not ok]
            raise ParallelRefused(
                f"Rank(s) {', '.join(map(str, failed))} of {group.size()} failed to load "
                f"{str(resolved.model_dir)!r}, so this rank cannot run its part alone.",
                fix="See the failing rank's own error (each rank reports why it failed).",
            )
        share_seed(lockstep)
    module.eval()
    return Model(
        module,
        binding=binding,
        config=resolved.config,
        model_dir=resolved.model_dir,
        profile_reason=resolved.summary.profile_reason,
        cpu_path=resolved.summary.cpu,
        parallel=info,
        artifact_fingerprint=resolved.summary.artifact_fingerprint,
        weights_identity=weights,
    )


def _run_factory(resolved: Resolved) -> nn.Module:
    binding = resolved.binding
    impl = binding.implementation
    context = BuildContext(
        model_dir=resolved.model_dir,
        config=resolved.config,
        family_config=resolved.family_config,
        profile=binding.profile,
        backend=binding.backend,
        kernels={name: kernel.fn for name, kernel in binding.kernels.items()},
    )
    try:
        module = impl.factory(context)
    except LoomError:
        raise  # already typed: a bad config or checkpoint the plugin reported
    except (Exception, SystemExit, GeneratorExit) as err:  # noqa: BLE001 - not Ctrl-C
        raise ImplementationFailed(
            f"{_who(impl)} failed to build the model for {str(resolved.model_dir)!r}: "
            f"{type(err).__name__}: {err}",
            fix="This is a fault in the plugin: report it to its authors (the chained "
            "traceback shows where), or disallow the plugin.",
        ) from err
    if not isinstance(module, nn.Module) or not isinstance(module, CausalLM):
        raise ImplementationFailed(
            f"{_who(impl)} built a {type(module).__name__}, not an mlx.nn.Module with "
            "__call__(inputs, cache) and make_cache().",
            fix="This is a fault in the plugin: its factory must return the model graph.",
        )
    return module


def _who(impl: Any) -> str:
    return f"Implementation {impl.id!r} ({impl.provider or 'registered by the host'})"


def _build_split(resolved: Resolved, mode: str, group: Any) -> tuple[nn.Module, Parallel]:
    """The factory's lazy model, cut to this rank's part by the family's plan.

    Order: split first (so slices come straight from the files, before any
    dtype conversion makes new arrays of them), then the CPU path, then the
    split's class changes (so they wrap the CPU path's kernels).
    """
    impl = resolved.binding.implementation
    plan_of = impl.parallel
    if plan_of is None:  # prepare() refuses such an implementation before this is called
        raise ParallelRefused(
            f"Implementation {impl.id!r} declares no parallel plan.",
            fix="Run it in one process, or ask its plugin's authors for a parallel plan.",
        )
    with recording_sources() as sources:
        module = _run_factory(resolved)
    try:
        plan = plan_of(resolved.family_config)
    except LoomError:
        raise
    except Exception as err:  # noqa: BLE001 - plugin code
        raise ImplementationFailed(
            f"{_who(impl)}'s parallel plan failed for {str(resolved.model_dir)!r}: "
            f"{type(err).__name__}: {err}",
            fix="This is a fault in the plugin: report it to its authors.",
        ) from err
    what = f"{resolved.model_dir.name!r} (implementation {impl.id!r})"
    info, wraps = split_model(module, plan, mode, group, sources, what=what)  # type: ignore[arg-type]
    del sources
    apply_cpu_path(module, resolved.summary.cpu)
    wrap(module, wraps)
    weights = sum(v.nbytes for _, v in _leaves(module.parameters()))
    return module, dataclasses.replace(info, weight_bytes=weights)


def _evaluate_all(module: nn.Module) -> None:
    _evaluate(module)
    # Buffers (arrays a module keeps beside its parameters, such as RoPE
    # frequency tables) too: MLX ties an unevaluated array to the stream of
    # the thread that built it, so a model built on one thread and run on
    # another (the server's generation thread) would fail with "There is
    # no Stream(cpu, 0) in current thread".
    mx.eval(_buffers(module))


def _evaluate(module: nn.Module) -> None:
    """Evaluate every parameter once, then refuse any floating one holding NaN or Inf.

    The screen (:func:`mlx_loom.artifacts.finite.non_finite`) is one
    reduction per tensor, evaluated in the same pass as the weights.
    """
    bad = non_finite(_leaves(module.parameters()))
    if bad:
        raise WeightsError(
            f"The checkpoint's weights hold NaN or Inf values in {named_list(bad)}.",
            fix="The checkpoint is corrupt or was converted badly; re-download or re-convert it.",
        )


def _leaves(tree: Any) -> list[tuple[str, Any]]:
    """``tree``'s leaves with their dotted names (``tree_flatten``'s list form)."""
    return cast(list[tuple[str, Any]], tree_flatten(tree))


def _buffers(module: nn.Module) -> list[mx.array]:
    """Arrays the module tree holds under ``_``-prefixed keys (not parameters)."""
    return [
        leaf
        for m in module.modules()
        for key, value in m.items()
        if key.startswith("_")
        for _, leaf in _leaves(value)
        if isinstance(leaf, mx.array)
    ]


def load(
    model_ref: str | Path,
    *,
    policy: PluginPolicy | None = None,
    host: PluginHost | None = None,
    registry: Registry | None = None,
    kernel_backend: Backend | None = None,
    compute_dtype: str | None = None,
    cpu_kernels: str | None = None,
    kv_dtype: str | None = None,
    lazy: bool = False,
    adapter_path: str | os.PathLike[str] | None = None,
    parallel: str | None = None,
    group: Any = None,
) -> tuple[Model, Tokenizer]:
    """Load a model and its tokenizer, shaped like ``mlx_lm.load``.

    ``policy`` restricts which plugins may serve it; ``host``/``registry`` let
    an embedding application supply its own composition; ``kernel_backend``
    pins the backend kernels resolve on (a refusal, never a substitute, if it
    cannot run here). ``compute_dtype`` (``"checkpoint"``, ``"float32"``,
    ``"bfloat16"``, ``"float16"``) and ``cpu_kernels`` (``"cpu-native"``,
    ``"cpu-ops"``) choose the CPU compute path; the defaults and their
    reasons are in :mod:`mlx_loom.cpu`. ``kv_dtype`` (``"float16"``,
    ``"bfloat16"``) stores every attention cache's keys and values in that
    dtype — half the bytes of the CPU's float32 — instead of the compute
    dtype (recurrent state is left alone; see ``docs/cpu.md``). ``parallel="tensor"`` or
    ``"pipeline"`` splits the model across ``group`` (default
    ``mx.distributed.init()``: the processes ``mlx.launch`` started); every
    rank calls ``load`` alike (:mod:`mlx_loom.parallel`).
    ``adapter_path`` applies an mlx-lm LoRA/DoRA adapter
    directory on top of the built graph (:mod:`mlx_loom.adapters`).
    """
    storage = resolve_kv_dtype(kv_dtype)  # refused before anything loads
    resolved = resolve_model(
        model_ref,
        policy=policy,
        host=host,
        registry=registry,
        kernel_backend=kernel_backend,
        compute_dtype=compute_dtype,
        cpu_kernels=cpu_kernels,
    )
    model = build_model(resolved, lazy=lazy, parallel=parallel, group=group)
    model.kv_dtype = storage
    if adapter_path is not None:
        load_adapter(model, adapter_path)
    tokenizer = Tokenizer.from_dir(resolved.model_dir, config_eos=resolved.config.eos_token_id)
    return model, tokenizer
