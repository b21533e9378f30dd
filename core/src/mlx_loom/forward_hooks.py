"""The hook through which a forward picks up native kernels: a context variable, set per call.

The cache's plain KV view, :func:`mlx_loom.nn.swiglu` and the engine's
log-probabilities sit below the CPU kernel sets (:mod:`mlx_loom.cpu`) in the
layers, so they never import them: they read this hook, and the layer above
fills it (:func:`mlx_loom.cpu.ops.forward_kernels`).

:meth:`mlx_loom.Model.__call__` sets it for the duration of the call when the
model's CPU kernel set runs on the native extension (``cpu-native``,
``cpu-native-int8-act``; :mod:`mlx_loom.cpu.ops`), and the engine sets it
(:meth:`mlx_loom.Model.native_kernels`) around the log-probabilities it
computes from a model's logits. Graph code that is a function rather than a
module reads it instead of being swapped: the core's plain KV view (its
attention), the core's :func:`~mlx_loom.nn.swiglu` and
:func:`~mlx_loom.nn.geglu` (used by every family's gated MLP and expert
layers), :func:`~mlx_loom.nn.softcap` (a family's logit soft cap),
:func:`~mlx_loom.nn.mix_experts` (the routed experts' weighted sum) and
:func:`~mlx_loom.engine.sampling.logprobs_from_logits`. A context variable, not a
global: two models in one process, or two threads building graphs, never see
each other's choice. Imports nothing, so that the cache, the model and
``mlx_loom.nn`` can read it without pulling in the kernel sets.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

AttentionKernel = Callable[..., Any]
SiluMulKernel = Callable[[Any, Any], Any]
LogSoftmaxKernel = Callable[[Any], Any]
GeluMulKernel = Callable[[Any, Any], Any]
RmsNormKernel = Callable[[Any, Any, float], Any]
SoftcapKernel = Callable[[Any, float], Any]
ExpertMixKernel = Callable[..., Any]


@dataclass(frozen=True)
class NativeForward:
    """The native kernels a forward on a native kernel set builds with."""

    attention: AttentionKernel
    #: ``silu(gate) * up`` for float32 operands (bit-equal to MLX's own).
    silu_mul: SiluMulKernel
    #: ``x - logsumexp(x, -1)`` for float32 x (bit-equal to MLX's own).
    log_softmax: LogSoftmaxKernel
    #: ``gelu_approx(gate) * up`` for float32 operands (within a stated bound of MLX's).
    gelu_mul: GeluMulKernel
    #: ``mx.fast.rms_norm(x, weight, eps)`` as one node (the swapped norm modules'
    #: kernel, within its stated bound), for graphs that call the function.
    rms_norm: RmsNormKernel
    #: ``tanh(x / cap) * cap`` for float32 x (within a stated bound of MLX's).
    softcap: SoftcapKernel
    #: ``(y * w[..., None]).sum(axis=-2)`` for float32 y and w (bit-equal to MLX's own),
    #: plus ``shared_weight * shared`` when given ``(y, w, shared, shared_weight)``.
    expert_mix: ExpertMixKernel


_NATIVE: contextvars.ContextVar[NativeForward | None] = contextvars.ContextVar(
    "mlx_loom_cpu_native_forward", default=None
)


def current_attention() -> AttentionKernel | None:
    """The attention kernel of the forward being built on this thread, if any."""
    native = _NATIVE.get()
    return native.attention if native is not None else None


def current_silu_mul() -> SiluMulKernel | None:
    """The SwiGLU gate kernel of the forward being built on this thread, if any."""
    native = _NATIVE.get()
    return native.silu_mul if native is not None else None


def current_gelu_mul() -> GeluMulKernel | None:
    """The GeGLU gate kernel of the forward being built on this thread, if any."""
    native = _NATIVE.get()
    return native.gelu_mul if native is not None else None


def current_rms_norm() -> RmsNormKernel | None:
    """The RMS norm kernel of the forward being built on this thread, if any."""
    native = _NATIVE.get()
    return native.rms_norm if native is not None else None


def current_softcap() -> SoftcapKernel | None:
    """The logit soft-cap kernel of the forward being built on this thread, if any."""
    native = _NATIVE.get()
    return native.softcap if native is not None else None


def current_expert_mix() -> ExpertMixKernel | None:
    """The routed experts' weighted-sum kernel of the forward being built, if any."""
    native = _NATIVE.get()
    return native.expert_mix if native is not None else None


def current_log_softmax() -> LogSoftmaxKernel | None:
    """The log-softmax kernel of the graph being built on this thread, if any."""
    native = _NATIVE.get()
    return native.log_softmax if native is not None else None


@contextlib.contextmanager
def using(native: NativeForward | None) -> Iterator[None]:
    """Build the enclosed forward with ``native``'s kernels (``None``: MLX's own)."""
    token = _NATIVE.set(native)
    try:
        yield
    finally:
        _NATIVE.reset(token)


_KV_DTYPE: contextvars.ContextVar[Any | None] = contextvars.ContextVar(
    "mlx_loom_kv_storage_dtype", default=None
)


def current_kv_dtype() -> Any | None:
    """The dtype the forward being built stores new keys/values in (``None``: as computed).

    Set by :meth:`mlx_loom.Model.forward` for a model loaded with
    ``kv_dtype=`` and read by :func:`mlx_loom.cache.append_kv`, which every
    family's attention calls: one cast there stores every attention cache
    kind (full, windows, KV-shared donors, batches) in that dtype without
    family code.
    """
    return _KV_DTYPE.get()


@contextlib.contextmanager
def storing_kv(dtype: Any | None) -> Iterator[None]:
    """Store the enclosed forward's new keys/values in ``dtype`` (``None``: as computed)."""
    token = _KV_DTYPE.set(dtype)
    try:
        yield
    finally:
        _KV_DTYPE.reset(token)
