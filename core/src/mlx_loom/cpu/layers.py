"""Kernel-backed versions of MLX's matrix layers, swapped in after a family builds its graph.

Family graphs use ``nn.Linear``, ``nn.QuantizedLinear``, ``nn.Embedding``
and ``nn.QuantizedEmbedding`` (including ``embed_tokens.as_linear`` for tied
heads). When the resolved CPU kernel set is ``cpu-native`` the core changes
each such module, in place, into the subclass here: the parameters, their
names and every attribute stay as the family built and loaded them (so the
parameter tree, ``isinstance`` checks, ``bits``/``group_size`` and the
weight-coverage checks are unaffected); only the product runs on the native
kernel. Family code is not touched.

Exactly these four classes are swapped (``type(m) is nn.Linear``, not
subclasses: a subclass may compute something else), and only affine
quantization: a layer in one of MLX's microscaling modes (mxfp4, nvfp4,
mxfp8) keeps MLX's own ``quantized_matmul``, which ``loom explain`` states
(:func:`mlx_loom.cpu.path.describe_quantized_products`). On ``cpu-native-int8-act``
the 4-bit quantized ones are marked ``int8_activations``: their products
(decode and prefill alike) run against int8 activations (the kernel's
stated bound).
The same pass swaps the norm and RoPE modules, and the core's gated MLP, for
their one-node versions (:mod:`mlx_loom.cpu.ops`), and the routed-expert
layer and its stacked projections for theirs (:mod:`mlx_loom.cpu.experts`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn

from ..nn import projections
from ..nn.experts import SwitchGLU
from ..nn.mlp import GatedMLP
from ..nn.rope import FreqsRoPE
from . import experts, native


class NativeLinear(nn.Linear):
    """``nn.Linear`` on the native dense kernel: fp32 arithmetic, weight read as stored."""

    def __call__(self, x: mx.array) -> mx.array:
        return native.module().dense_matmul(x, self["weight"], self.get("bias"))


class NativeQuantizedLinear(nn.QuantizedLinear):
    """``nn.QuantizedLinear`` (affine) on the native kernel; scales read as stored."""

    int8_activations: bool = False

    def __call__(self, x: mx.array) -> mx.array:
        return native.module().affine_matmul(
            x,
            self["weight"],
            self["scales"],
            self["biases"],
            self.bits,
            self.group_size,
            self.get("bias"),
            self.int8_activations,
        )


class NativeEmbedding(nn.Embedding):
    """``nn.Embedding`` whose lookups come out in the compute dtype and whose
    ``as_linear`` (a tied output head) runs on the native dense kernel."""

    compute_dtype: mx.Dtype | None = None

    def __call__(self, x: mx.array) -> mx.array:
        out = self["weight"][x]
        return out if self.compute_dtype is None else out.astype(self.compute_dtype)

    def as_linear(self, x: mx.array) -> mx.array:
        return native.module().dense_matmul(x, self["weight"])


class NativeQuantizedEmbedding(nn.QuantizedEmbedding):
    """``nn.QuantizedEmbedding`` (affine) with lookups in the compute dtype and
    ``as_linear`` on the native kernel."""

    compute_dtype: mx.Dtype | None = None
    int8_activations: bool = False

    def __call__(self, x: mx.array) -> mx.array:
        # Dequantize the looked-up rows in the compute dtype (not in the
        # scales' stored dtype, then converted): the rows equal those of a
        # model whose scales were converted at load, bit for bit.
        scales, biases = self["scales"][x], self["biases"][x]
        if self.compute_dtype is not None:
            scales, biases = scales.astype(self.compute_dtype), biases.astype(self.compute_dtype)
        return mx.dequantize(
            self["weight"][x], scales, biases, group_size=self.group_size, bits=self.bits
        )

    def as_linear(self, x: mx.array) -> mx.array:
        return native.module().affine_matmul(
            x,
            self["weight"],
            self["scales"],
            self["biases"],
            self.bits,
            self.group_size,
            None,
            self.int8_activations,
        )


def project_together(x: mx.array, modules: Sequence[nn.Module]) -> list[mx.array] | None:
    """``[m(x) for m in modules]`` as one native node, or ``None`` where it does not apply.

    Applies to two or more native linears (one class, no biases) read the
    same way: dense of one dtype and row length, or affine of one width,
    group size, scale dtype, row length and activation kind. Each output
    equals the module's own call bit for bit (the same kernel on the same
    rows); the node saves the other calls' graph nodes, their pool regions
    and, on the int8 set, their quantization of x.
    """
    if len(modules) < 2:
        return None
    kind = type(modules[0])
    if kind not in (NativeLinear, NativeQuantizedLinear):
        return None  # also where the extension is absent: nothing was swapped
    if any(type(m) is not kind or "bias" in m for m in modules):
        return None
    if len(modules) > native.module().MAX_PARTS:
        return None
    if kind is NativeLinear:
        weights = [m["weight"] for m in modules]
        if len({(w.shape[1], w.dtype) for w in weights}) != 1:
            return None
        return native.module().multi_dense_matmul(x, weights)
    if kind is NativeQuantizedLinear:
        quantized = [m for m in modules if isinstance(m, NativeQuantizedLinear)]
        first = quantized[0]
        read_as = {
            (m.bits, m.group_size, m.int8_activations, m["weight"].shape[1], m["scales"].dtype)
            for m in quantized
        }
        if len(read_as) != 1:
            return None
        return native.module().multi_affine_matmul(
            x,
            [m["weight"] for m in quantized],
            [m["scales"] for m in quantized],
            [m["biases"] for m in quantized],
            first.bits,
            first.group_size,
            first.int8_activations,
        )
    return None


# A native linear exists only once this module is loaded, so setting the hook
# here is early enough: until then there is nothing to run together.
projections.set_joint_projection(project_together)


#: What each swapped class becomes.
SWAPS: dict[type[nn.Module], type[nn.Module]] = {
    nn.Linear: NativeLinear,
    nn.QuantizedLinear: NativeQuantizedLinear,
    nn.Embedding: NativeEmbedding,
    nn.QuantizedEmbedding: NativeQuantizedEmbedding,
    **experts.SWAPS,
}


@functools.cache
def op_swaps() -> dict[type[nn.Module], type[nn.Module]]:
    """The norm, RoPE and gated MLP classes and their one-node versions."""
    from . import ops  # ops subclasses the linears defined here, so it imports this module

    return {
        nn.RMSNorm: ops.NativeRMSNorm,
        nn.RoPE: ops.NativeRoPE,
        FreqsRoPE: ops.NativeFreqsRoPE,
        GatedMLP: ops.NativeGatedMLP,
        SwitchGLU: experts.NativeSwitchGLU,
    }


#: Parameters each native class reads in their stored dtype: they keep the
#: checkpoint's dtype, while every other floating parameter of the model
#: follows the compute dtype.
KEPT_AS_STORED: dict[type[nn.Module], frozenset[str]] = {
    NativeLinear: frozenset({"weight"}),
    NativeQuantizedLinear: frozenset({"weight", "scales", "biases"}),
    NativeEmbedding: frozenset({"weight"}),
    NativeQuantizedEmbedding: frozenset({"weight", "scales", "biases"}),
    **experts.KEPT_AS_STORED,
}


def kept_as_stored(module: nn.Module) -> frozenset[str]:
    """Names of ``module``'s arrays that keep their dtype under a compute dtype:
    the matrices the native kernels read as stored, and the RoPE kernels'
    float32 inverse frequencies."""
    if type(module) in op_swaps().values():
        return frozenset({"_inv_freq"})
    return KEPT_AS_STORED.get(type(module), frozenset())


def swappable(module: nn.Module) -> bool:
    if type(module) in op_swaps():
        from . import ops  # loaded by op_swaps() already; see there

        return ops.fits(module)
    # Expert stacks with a bias keep MLX's gather (the native node has none).
    if type(module) in experts.SWAPS and "bias" in module:
        return False
    return type(module) in SWAPS and getattr(module, "mode", "affine") == "affine"


def swap_in(
    module: nn.Module, compute_dtype: mx.Dtype | None, *, int8_activations: bool = False
) -> None:
    """Turn ``module`` (a class of :data:`SWAPS` or :func:`op_swaps`, affine) into its
    native subclass.

    The class changes in place, so the module keeps its identity, its place
    in the tree and everything the loader set on it. ``int8_activations``
    marks 4-bit quantized modules for the int8-activation kernel (the only
    width it has).
    """
    op_class = op_swaps().get(type(module))
    if op_class is not None:
        module.__class__ = op_class
        prepare = getattr(module, "prepare", None)
        if callable(prepare):
            prepare()
        return
    module.__class__ = SWAPS[type(module)]
    if isinstance(module, NativeEmbedding | NativeQuantizedEmbedding):
        module.compute_dtype = compute_dtype
    if isinstance(
        module,
        NativeQuantizedLinear | NativeQuantizedEmbedding | experts.NativeQuantizedSwitchLinear,
    ):
        module.int8_activations = int8_activations and module.bits == 4


def native_modules(model: nn.Module) -> dict[str, int]:
    """How many modules of each native class ``model`` holds."""
    counts: dict[str, int] = {}
    for _, mod in model.named_modules():
        if type(mod) in KEPT_AS_STORED or type(mod) in op_swaps().values():
            counts[type(mod).__name__] = counts.get(type(mod).__name__, 0) + 1
    return counts
