"""The Gemma 4 expert (MoE) kernel, per backend: the core's routed-expert GLU.

Kernel ``gemma4.switch_glu`` computes, for every token and each of its top-k
experts, ``down_e(gelu_tanh(gate_e(x)) * up_e(x))`` and returns
``[..., k, hidden]`` (the router weights are applied by the caller). Its
registrations are :func:`mlx_loom.nn.expert_kernels`: on ``cpu`` and
``cuda`` the MLX-ops expert GLU (mlx-lm's gather graph for fp32 and quantized
experts, bit-equal to it; bf16/fp16 experts grouped per expert on the host,
because ``gather_mm`` is fp32-only on the CPU — the measured choice is in
:mod:`mlx_loom.nn.experts`), on ``metal`` mlx-lm's gather graph on MLX's
native Metal gather kernels.
"""

from __future__ import annotations

from mlx_loom.nn import expert_kernels
from mlx_loom.plugin import Kernel

SWITCH_GLU = "gemma4.switch_glu"


def kernels() -> list[Kernel]:
    """The ``gemma4.switch_glu`` registrations, one per backend."""
    return expert_kernels(SWITCH_GLU)
