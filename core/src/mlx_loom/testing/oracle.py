"""The resolution options under which a model computes as mlx-lm does on this device.

Parity tests compare bit for bit with mlx-lm, so they run the checkpoint's own
dtype on MLX operations. On the CPU that means the ``cpu-ops`` kernel set
instead of the native kernels (which have their own parity tests); on Metal
and CUDA no CPU kernel set applies, and asking for one is refused — so the
same parity test runs on every backend (``benchmarks/gpu_check.sh``).
"""

from __future__ import annotations

from mlx_loom.backends import active_backend

__all__ = ["oracle_options"]


def oracle_options() -> dict[str, str | None]:
    """``resolve_model`` / ``load`` keyword arguments for mlx-lm's arithmetic here."""
    on_cpu = active_backend() == "cpu"
    return {"compute_dtype": "checkpoint", "cpu_kernels": "cpu-ops" if on_cpu else None}
