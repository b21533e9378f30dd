"""``mlx_loom.load``: a model reference in, a built model and its tokenizer out.

The default plugin host is the one documented piece of process-wide state: a
snapshot of the installed plugins under the policy in ``MLX_LOOM_PLUGINS``,
built on first use. Hosts that need another composition pass their own
``host`` (or a ``registry`` composed with :meth:`Registry.with_`) and never
touch the default.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import mlx.core as mx

from ..model import Model
from ..text import Tokenizer
from ._discovery import PluginHost
from ._kernels import Backend
from ._policy import POLICY_ENV, PluginPolicy
from ._registry import BuildContext, Registry
from ._resolution import Resolved, resolve


@functools.lru_cache(maxsize=4)
def _default_host(policy_env: str | None) -> PluginHost:
    del policy_env  # part of the cache key: a changed policy gets a fresh snapshot
    return PluginHost()


def default_host() -> PluginHost:
    """The process-wide plugin snapshot for the current ``MLX_LOOM_PLUGINS``."""
    return _default_host(os.environ.get(POLICY_ENV))


def make_host(policy: PluginPolicy | None) -> PluginHost:
    return default_host() if policy is None else PluginHost(policy=policy)


def resolve_model(
    model_ref: str | Path,
    *,
    policy: PluginPolicy | None = None,
    host: PluginHost | None = None,
    registry: Registry | None = None,
    kernel_backend: Backend | None = None,
) -> Resolved:
    """Resolve without loading weights (what ``loom explain`` shows)."""
    host = host if host is not None else make_host(policy)
    registry = registry if registry is not None else host.registry
    if kernel_backend is not None:
        registry = registry.with_(kernel_backend=kernel_backend)
    return resolve(model_ref, host=host, registry=registry)


def build_model(resolved: Resolved, *, lazy: bool = False) -> Model:
    """Run the selected implementation's factory and wrap the result."""
    binding = resolved.binding
    context = BuildContext(
        model_dir=resolved.model_dir,
        config=resolved.config,
        family_config=resolved.family_config,
        profile=binding.profile,
        backend=binding.backend,
        kernels={name: kernel.fn for name, kernel in binding.kernels.items()},
    )
    module = binding.implementation.factory(context)
    if not lazy:
        mx.eval(module.parameters())
    # Arrays a graph keeps outside its parameters (a RoPE's precomputed
    # frequencies) are evaluated here too, on this thread: left lazy, they
    # would be evaluated on whichever thread first generates, and MLX refuses
    # a graph built on another thread's stream ("There is no Stream(cpu, 0) in
    # current thread") — which is how every Gemma 4 request failed in a server.
    mx.eval(_private_arrays(module))
    module.eval()
    return Model(
        module,
        binding=binding,
        config=resolved.config,
        model_dir=resolved.model_dir,
        profile_reason=resolved.summary.profile_reason,
    )


def _private_arrays(module) -> list[mx.array]:
    return [
        value
        for _, sub in module.named_modules()
        for key, value in sub.items()
        if key.startswith("_") and isinstance(value, mx.array)
    ]


def load(
    model_ref: str | Path,
    *,
    policy: PluginPolicy | None = None,
    host: PluginHost | None = None,
    registry: Registry | None = None,
    kernel_backend: Backend | None = None,
    lazy: bool = False,
    adapter_path: str | os.PathLike[str] | None = None,
) -> tuple[Model, Tokenizer]:
    """Load a model and its tokenizer, shaped like ``mlx_lm.load``.

    ``policy`` restricts which plugins may serve it; ``host``/``registry`` let
    an embedding application supply its own composition; ``kernel_backend``
    pins the backend kernels resolve on (a refusal, never a substitute, if it
    cannot run here). ``adapter_path`` applies an mlx-lm LoRA/DoRA adapter
    directory on top of the built graph (:mod:`mlx_loom.adapters`).
    """
    resolved = resolve_model(
        model_ref, policy=policy, host=host, registry=registry, kernel_backend=kernel_backend
    )
    model = build_model(resolved, lazy=lazy)
    if adapter_path is not None:
        from ..adapters import load_adapter

        load_adapter(model, adapter_path)
    tokenizer = Tokenizer.from_dir(resolved.model_dir, config_eos=resolved.config.eos_token_id)
    return model, tokenizer
