"""The CPU compute path: which dtype activations run in, and which kernel set does the products.

Two registered, named choices, resolved with the rest of a model (``loom
explain`` prints them) and applied by the core after the family's factory
has built the graph — family code is never touched:

**Compute dtype** (``compute_dtype=`` / ``--compute-dtype``): ``checkpoint``
runs in the dtype the weights are stored in, as mlx-lm does; ``float32``,
``bfloat16`` and ``float16`` convert every floating-point parameter to that
dtype at load (activations, norms, quantization scales, the KV cache
follow), except the matrices the native kernels read as stored.

The default on the CPU backend is ``float32``. MLX's CPU backend has no
half-precision arithmetic: bf16 work is emulated element by element, and a
quantized product with bf16 activations and scales is ~10x slower than with
fp32 (measured: 4-bit, 896x4864, one row: 23.8 ms vs 2.8 ms); whole-model
decode and prefill of a 4-bit checkpoint with bf16 scales are 8x and 10x
faster in fp32 with MLX's own operations. fp32 is also never less accurate
than the checkpoint's half precision. With the native kernels the weights
stay as stored, so fp32 activations cost no weight memory; with ``cpu-ops``
dense bf16/fp16 weights are converted too (twice their memory), which
``compute_dtype="checkpoint"`` avoids. On Metal and CUDA the default is
``checkpoint``.

**CPU kernel set** (``cpu_kernels=`` / ``--cpu-kernels``), CPU backend only:
``cpu-ops`` runs every product as MLX operations (the oracle's own
arithmetic: with the same compute dtype, logits equal mlx-lm's bit for bit);
``cpu-native`` runs ``Linear``/``QuantizedLinear``/``Embedding`` products on
the compiled AVX2 kernels (multithreaded; fp32 accumulation; bounded, not
bit-equal, difference from MLX's sums; 4-bit matrix-vector products on
AVX-512 where the CPU has it, bit-identical to AVX2's); ``cpu-native-int8-act`` is
``cpu-native`` except that 4-bit products (decode, batched decode,
verification windows and prefill chunks) quantize their activations to
int8 per 32 columns and multiply in integers, as llama.cpp pairs Q4 weights
with Q8 activations (on AVX-512 VNNI where the CPU has it, detected at run
time, else AVX2; ``MLX_LOOM_CPU_ISA=avx2`` forces the baseline and both give
bit-identical results): ~2x the products' speed for an error stated and tested
(at most ``sum_k |w_k| step_k / 2`` per output over the dequantized weights
``w``; docs/cpu.md). The default is ``cpu-native`` where it can run and
``cpu-ops`` where it cannot — ``loom explain`` says which and why; the int8
set is never a default, since it changes the numbers. Asking for a native
set where it cannot run is a refusal naming the reason, never a quiet
switch to ``cpu-ops``.

A host pins either choice with :meth:`mlx_loom.Registry.with_`; a run may
then only ask for the pinned value.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal, get_args

import mlx.core as mx
import mlx.nn as nn
from pydantic import BaseModel, ConfigDict

from ..artifacts.quantization import MicroscalingEmbedding
from ..errors import KernelUnavailable, RequestError
from . import layers, native
from .native import NATIVE_KERNEL_SETS

ComputeDtype = Literal["checkpoint", "float32", "bfloat16", "float16"]
KernelSetName = Literal["cpu-ops", "cpu-native", "cpu-native-int8-act"]
COMPUTE_DTYPES: tuple[str, ...] = get_args(ComputeDtype)
KERNEL_SETS: tuple[str, ...] = get_args(KernelSetName)
DEFAULT_CPU_COMPUTE_DTYPE: ComputeDtype = "float32"

_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def _native_kernels(matmul: str, experts: str) -> dict[str, str]:
    """The kernels of a kernel set on the native extension, by name, with what each
    runs; ``matmul`` and ``experts`` describe its products (the one thing the native
    sets differ in)."""
    return {
        "matmul": matmul,
        "rms_norm": "mlx_loom.cpu._native rms_norm: nn.RMSNorm as one node",
        "rope": "mlx_loom.cpu._native rope: nn.RoPE and the core's RoPE kinds",
        "attention": "mlx_loom.cpu._native attention over plain KV views "
        "(no sinks; quantized views keep their own products)",
        "swiglu": "mlx_loom.cpu._native silu_mul: mlx_loom.nn.swiglu in float32, "
        "bit-equal to MLX's; with GatedMLP's gate and up projections, one product node",
        "geglu": "mlx_loom.cpu._native gelu_mul: mlx_loom.nn.geglu in float32, within "
        "2^-21 |gate * up| of MLX's; with GatedMLP's gate and up projections, one product node",
        "softcap": "mlx_loom.cpu._native softcap: mlx_loom.nn.softcap (a logit soft cap) in "
        "float32, within 2^-21 * cap of MLX's",
        "log_softmax": "mlx_loom.cpu._native log_softmax: the engine's float32 "
        "log-probabilities, bit-equal to MLX's logsumexp",
        "experts": experts,
        "expert_mix": "mlx_loom.cpu._native expert_mix: mlx_loom.nn.mix_experts, the routed "
        "experts' weighted sum in float32, bit-equal to MLX's",
        "family": "modules that define use_native_cpu_kernels take the extension's "
        "kernels for their own ops (Qwen3-Next/3.5: gated_delta, the recurrence over a "
        "prompt as one node, and conv_silu, the causal convolution)",
    }


#: What the native sets run for routed experts (mlx_loom.cpu.experts).
_EXPERTS = (
    "mlx_loom.cpu._native gather_dense_matmul / gather_affine_matmul: the routed experts "
    "(SwitchGLU) of fp32/bf16/fp16 and affine 2-8 bit stacks, one node per layer with "
    "SwiGLU in float32 (gate, up, gate and down), else gate+up and down nodes; mxfp4, "
    "mxfp8 and nvfp4 experts stay on MLX's gather_qmm"
)


@dataclass(frozen=True)
class KernelSet:
    """A named set of CPU kernels for the model's matrix products.

    ``kernels`` names the kernels the set consists of, each with what it runs
    (``loom explain`` lists them; the layers of :mod:`mlx_loom.cpu.layers` and
    :mod:`mlx_loom.cpu.ops` are what calls them); ``unavailable`` says why the
    set cannot run here, or ``None``.
    """

    name: KernelSetName
    description: str
    kernels: Mapping[str, str]
    unavailable: Callable[[], str | None]


@functools.cache
def cpu_kernel_sets() -> dict[str, KernelSet]:
    """The kernel sets the core registers for the CPU backend, by name."""
    return {
        "cpu-ops": KernelSet(
            "cpu-ops",
            "MLX operations (matmul, quantized_matmul): the reference arithmetic",
            {"matmul": "x @ W.T and mx.quantized_matmul as the family's MLX layers run them"},
            lambda: None,
        ),
        "cpu-native": KernelSet(
            "cpu-native",
            "compiled AVX2/FMA kernels: multithreaded matrix-vector and blocked GEMM products "
            "for fp32/bf16/fp16 and affine 2-8 bit weights, RMS norm, RoPE and attention as "
            "one node each; fp32 accumulation",
            _native_kernels(
                "mlx_loom.cpu._native dense_matmul / affine_matmul (projections of one "
                "activation through mlx_loom.nn.project: one multi-output node)",
                _EXPERTS,
            ),
            lambda: native.unavailable_reason(),
        ),
        "cpu-native-int8-act": KernelSet(
            "cpu-native-int8-act",
            "cpu-native, with 4-bit products (decode and prefill) against activations "
            "quantized to int8 per 32 columns: integer multiply-adds (AVX-512 VNNI where the "
            "CPU has it, else AVX2; bit-identical), bounded error",
            _native_kernels(
                "mlx_loom.cpu._native affine_matmul(int8_activations=True) for 4-bit weights, "
                "dense_matmul / affine_matmul otherwise (projections of one activation through "
                "mlx_loom.nn.project: one multi-output node)",
                _EXPERTS + "; 4-bit experts with int8 activations at every row count",
            ),
            lambda: native.unavailable_reason(),
        ),
    }


class CpuPath(BaseModel):
    """The resolved compute dtype and kernel set, with the reason for each."""

    model_config = ConfigDict(frozen=True)

    backend: str
    compute_dtype: ComputeDtype
    compute_dtype_reason: str
    kernel_set: KernelSetName | None
    kernel_set_reason: str
    kernel_sets: tuple[str, ...] = KERNEL_SETS
    threads: int | None = None
    #: The instruction set of the 4-bit kernels (native sets only): the
    #: fp32-activation matrix-vector product and the int8-activation one.
    isa: str | None = None
    #: Whether one int8 activation row runs on ``isa`` too (else on AVX2).
    one_row_on_isa: bool = True

    @property
    def rows_switch(self) -> int | None:
        """The product row count past which a row's arithmetic changes (``None``: never).

        On the native sets the fp32-activation products (4-bit and dense
        weights) run the matrix-vector kernel up to ``SMALL_ROWS`` rows and the
        blocked GEMM above. Each computes a row alike at any row count on its
        side, but the two sum in different orders, so a row computed with
        others across that line is not the row computed alone. The engine
        keeps a padded prefill on the side each row's own chunk is on
        (batched = solo). MLX's products (``cpu-ops``) compute a row alike at
        every row count.
        """
        if self.kernel_set not in NATIVE_KERNEL_SETS:
            return None
        return int(native.module().SMALL_ROWS)

    @property
    def dtype(self) -> mx.Dtype | None:
        """The MLX dtype parameters are converted to (``None``: as stored)."""
        return _DTYPES.get(self.compute_dtype)

    def describe_kernels(self) -> str:
        if self.kernel_set is None:
            return f"n/a ({self.kernel_set_reason})"
        extra = ""
        if self.kernel_set in NATIVE_KERNEL_SETS:
            extra = f", {self.threads} threads"
            # The same bits on either instruction set; docs/cpu.md gives the
            # measurements behind the routing.
            if self.kernel_set == "cpu-native-int8-act" and self.isa is not None:
                extra += f", int8 products on {self.isa}"
                if self.isa != "avx2" and not self.one_row_on_isa:
                    extra += " (one row on avx2)"
            elif self.isa is not None:
                extra += f", 4-bit products on {self.isa}"
        kernels = ", ".join(cpu_kernel_sets()[self.kernel_set].kernels)
        return f"{self.kernel_set}{extra}: {kernels}  ({self.kernel_set_reason})"


def describe_quantized_products(path: CpuPath, modes: Iterable[str]) -> str | None:
    """Where a checkpoint's quantized products run, per layer kind and packing mode.

    ``modes`` are the checkpoint's (``WeightsSummary.quantization_modes``);
    ``None`` when it has no quantized matrix. The native kernels implement
    affine packing only: a linear, embedding or routed-expert stack packed in
    a microscaling mode (mxfp4, nvfp4, mxfp8) is left on MLX's own
    ``quantized_matmul`` / ``dequantize`` / ``gather_qmm`` — never swapped,
    never approximated; affine routed experts run the native gathered
    products (:mod:`mlx_loom.cpu.experts`).
    """
    modes = sorted(set(modes))
    if not modes:
        return None
    if path.kernel_set is None:
        return f"MLX's quantized kernels on {path.backend} ({', '.join(modes)})"
    lookups = "embedding lookups: MLX dequantize"
    if path.kernel_set not in NATIVE_KERNEL_SETS:
        ops = f"linear and tied head: MLX quantized_matmul ({', '.join(modes)})"
        return "; ".join([ops, lookups, "any routed experts: MLX gather_qmm"])
    parts = []
    experts = []
    if "affine" in modes:
        parts.append("affine linear and tied head: mlx_loom.cpu._native affine_matmul")
        experts.append("any affine routed experts: mlx_loom.cpu._native gather_affine_matmul")
    micro = [m for m in modes if m != "affine"]
    if micro:
        parts.append(
            f"{'/'.join(micro)} linear and tied head: MLX quantized_matmul "
            "(the native kernels run affine packing only)"
        )
        experts.append(f"any {'/'.join(micro)} routed experts: MLX gather_qmm")
    return "; ".join([*parts, lookups, *experts])


def check_compute_dtype(value: str | None, *, asked: str = "compute_dtype") -> None:
    if value is not None and value not in COMPUTE_DTYPES:
        raise RequestError(
            f"{asked}={value!r} is not a compute dtype (choose from {', '.join(COMPUTE_DTYPES)}).",
            fix=f"Pass one of: {', '.join(COMPUTE_DTYPES)}.",
        )


def check_kernel_set(value: str | None, *, asked: str = "cpu_kernels") -> None:
    if value is not None and value not in KERNEL_SETS:
        raise RequestError(
            f"{asked}={value!r} is not a CPU kernel set (registered: {', '.join(KERNEL_SETS)}).",
            fix=f"Pass one of: {', '.join(KERNEL_SETS)}.",
        )


def _pick(
    what: str, asked: str | None, pinned: str | None, default: str, default_reason: str
) -> tuple[str, str]:
    if pinned is not None:
        if asked is not None and asked != pinned:
            raise KernelUnavailable(
                f"The run asks for {what} {asked!r}, but the host pins {pinned!r}.",
                fix=f"Drop the {what} from the run, or ask for {pinned!r}.",
            )
        return pinned, "pinned by the host"
    if asked is not None:
        return asked, "asked for by this run"
    return default, default_reason


def resolve_cpu_path(
    backend: str,
    *,
    compute_dtype: str | None = None,
    cpu_kernels: str | None = None,
    host_compute_dtype: str | None = None,
    host_cpu_kernels: str | None = None,
) -> CpuPath:
    """The CPU path for a model on ``backend``, or a refusal.

    ``compute_dtype``/``cpu_kernels`` are this run's requests, ``host_*`` the
    host's pins (a run may only repeat a pin).
    """
    check_compute_dtype(compute_dtype)
    check_compute_dtype(host_compute_dtype, asked="the host's compute_dtype")
    check_kernel_set(cpu_kernels)
    check_kernel_set(host_cpu_kernels, asked="the host's cpu_kernels")
    on_cpu = backend == "cpu"
    dtype, dtype_reason = _pick(
        "compute dtype",
        compute_dtype,
        host_compute_dtype,
        DEFAULT_CPU_COMPUTE_DTYPE if on_cpu else "checkpoint",
        "the CPU default: MLX's CPU backend has no fast half-precision arithmetic"
        if on_cpu
        else f"the {backend} default: run in the checkpoint's own dtype",
    )
    if not on_cpu:
        if cpu_kernels is not None or host_cpu_kernels is not None:
            raise KernelUnavailable(
                f"CPU kernel set {cpu_kernels or host_cpu_kernels!r} was asked for, but this "
                f"model runs on the {backend!r} backend.",
                fix="Drop the CPU kernel set, or pin the cpu kernel backend "
                "(kernel_backend='cpu').",
            )
        return CpuPath(
            backend=backend,
            compute_dtype=dtype,  # type: ignore[arg-type]
            compute_dtype_reason=dtype_reason,
            kernel_set=None,
            kernel_set_reason=f"the {backend} backend runs the family's own kernels",
        )
    sets = cpu_kernel_sets()
    native_missing = sets["cpu-native"].unavailable()
    default_set, default_reason = (
        ("cpu-native", "the CPU default: the native kernels run here")
        if native_missing is None
        else ("cpu-ops", f"the CPU default where the native kernels cannot run: {native_missing}")
    )
    kernel_set, kernel_reason = _pick(
        "CPU kernel set", cpu_kernels, host_cpu_kernels, default_set, default_reason
    )
    missing = sets[kernel_set].unavailable()
    if missing is not None:
        raise KernelUnavailable(
            f"CPU kernel set {kernel_set!r} ({kernel_reason}) cannot run here: {missing}.",
            fix="Use the 'cpu-ops' kernel set (--cpu-kernels cpu-ops, cpu_kernels='cpu-ops'), "
            "which runs the same model with MLX operations.",
        )
    isa = _native_isa() if kernel_set in NATIVE_KERNEL_SETS else None
    return CpuPath(
        backend=backend,
        compute_dtype=dtype,  # type: ignore[arg-type]
        compute_dtype_reason=dtype_reason,
        kernel_set=kernel_set,  # type: ignore[arg-type]
        kernel_set_reason=kernel_reason,
        threads=native.threads() if kernel_set in NATIVE_KERNEL_SETS else None,
        isa=isa,
        one_row_on_isa=isa is None or native.one_row_avx512(),
    )


def _native_isa() -> str | None:
    """The int8 kernels' instruction set, or a refusal for a bad ``MLX_LOOM_CPU_ISA``."""
    try:
        return native.cpu_isa()
    except ValueError as err:
        raise KernelUnavailable(
            f"The native CPU kernels cannot use the instruction set asked for: {err}",
            fix=f"Unset MLX_LOOM_CPU_ISA, or set it to one of {', '.join(native.CPU_ISA_CHOICES)} "
            "(avx512 only where the CPU has AVX-512 VNNI).",
        ) from err


def _is_float(a: mx.array) -> bool:
    return mx.issubdtype(a.dtype, mx.floating)


def apply_cpu_path(model: nn.Module, path: CpuPath) -> None:
    """Convert ``model``'s parameters to the compute dtype and swap in the kernel set.

    Called on the freshly built (still lazy) graph, before its weights are
    evaluated, so converted weights never coexist with their originals for
    the whole model.
    """
    dtype = path.dtype
    if dtype is not None:
        for _, mod in model.named_modules():
            if isinstance(mod, MicroscalingEmbedding):
                mod.lookup_dtype = dtype  # its rows, not only its (uint8) scales
    if path.kernel_set not in NATIVE_KERNEL_SETS:
        if dtype is not None:
            model.set_dtype(dtype, predicate=lambda d: mx.issubdtype(d, mx.floating))
        return
    int8 = path.kernel_set == "cpu-native-int8-act"
    for _, mod in model.named_modules():
        if layers.swappable(mod):
            layers.swap_in(mod, dtype, int8_activations=int8)
    # A family's own module with a native counterpart on the extension (the
    # Qwen3-Next recurrence) takes it here: the hook is the family's, the
    # extension the core's.
    for _, mod in model.named_modules():
        hook = getattr(mod, "use_native_cpu_kernels", None)
        if callable(hook):
            hook(native.module())
    if dtype is None:
        return
    for _, mod in model.named_modules():
        kept = layers.kept_as_stored(mod)
        for name, value in list(mod.items()):
            if name in kept:
                continue
            if isinstance(value, mx.array) and _is_float(value) and value.dtype != dtype:
                mod[name] = value.astype(dtype)
            elif isinstance(value, list | tuple) and any(isinstance(v, mx.array) for v in value):
                mod[name] = type(value)(
                    v.astype(dtype) if isinstance(v, mx.array) and _is_float(v) else v
                    for v in value
                )
