"""The CPU compute path: the compute dtype and the CPU kernel set a model runs with.

See :mod:`mlx_loom.cpu.path` for the two choices, their defaults and why;
:mod:`mlx_loom.cpu.layers` for how the native kernels reach every family's
matrix products; :mod:`mlx_loom.cpu.native` for the compiled extension.
"""

from .path import (
    COMPUTE_DTYPES,
    DEFAULT_CPU_COMPUTE_DTYPE,
    KERNEL_SETS,
    ComputeDtype,
    CpuPath,
    KernelSet,
    KernelSetName,
    apply_cpu_path,
    cpu_kernel_sets,
    resolve_cpu_path,
)

__all__ = [
    "COMPUTE_DTYPES",
    "DEFAULT_CPU_COMPUTE_DTYPE",
    "KERNEL_SETS",
    "ComputeDtype",
    "CpuPath",
    "KernelSet",
    "KernelSetName",
    "apply_cpu_path",
    "cpu_kernel_sets",
    "resolve_cpu_path",
]
