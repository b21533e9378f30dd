"""Which attention kernel the forward being built uses: a context variable, set per model call.

:meth:`mlx_loom.Model.__call__` sets it for the duration of the call when the
model's CPU kernel set runs on the native extension (``cpu-native``,
``cpu-native-int8-act``; :mod:`mlx_loom.cpu.ops`), and the core's plain KV
view reads it. A context variable, not a global: two models in one process,
or two threads building graphs, never see each other's choice. Imports
nothing heavy, so that the cache and model modules can read it without
pulling in the kernel sets.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

from .native import NATIVE_KERNEL_SETS

AttentionKernel = Callable[..., Any]

_ATTENTION: contextvars.ContextVar[AttentionKernel | None] = contextvars.ContextVar(
    "mlx_loom_cpu_attention", default=None
)


def current_attention() -> AttentionKernel | None:
    """The attention kernel of the forward being built on this thread, if any."""
    return _ATTENTION.get()


@contextlib.contextmanager
def forward_kernels(kernel_set: str | None) -> Iterator[None]:
    """Build the enclosed forward with the native attention if ``kernel_set`` runs natively."""
    kernel = None
    if kernel_set in NATIVE_KERNEL_SETS:
        from .ops import attention as kernel
    token = _ATTENTION.set(kernel)
    try:
        yield
    finally:
        _ATTENTION.reset(token)
