"""MLX's Metal attention dispatch, as data: which kernel one attention call runs.

``mx.fast.scaled_dot_product_attention`` on Metal picks a kernel from the
call's shapes, and each kernel sums in its own order. A speculative verify
window (query length ``w``) gives each of its queries the arithmetic of a
one-token decode step (query length 1) only where both calls run the same
kernel with the same key partition; :mod:`._verify` asks this module which.
Nothing here runs on a GPU: the rules are read from MLX's source and pinned
to the MLX version the project runs, and tests check them against the
installed MLX (its version, and the Metal kernel header its wheel ships).

Source (``ml-explore/mlx``, ``mlx/backend/metal/scaled_dot_product_attention.cpp``,
read at main ``846d176``, version 0.32.2.dev between tags v0.32.1 and v0.32.4;
the vector kernels in ``mlx/backend/metal/kernels/sdpa_vector.h``, checked
against the header the mlx 0.32.4 wheel installs):

* ``eval_gpu``: query length ``qL <= 8`` takes the vector kernels, longer
  queries the "full" (steel) kernel;
* ``has_fused_kernel``: the vector kernels need ``qL * gqa_factor <= 32``,
  ``qL <= kL`` and head dims (D, V) in {64, 96, 128, 192, 256} (equal) or
  (192, 128); otherwise ``use_fallback`` runs attention *unfused* (matmul,
  softmax, matmul); (192, 192) is unfused by choice for ``qL <= 8``;
* among vector kernels, the two-pass one runs from ``kL >= 1024`` on device
  classes ``d`` and ``s`` (the last letter of the GPU architecture name), or
  from ``kL >= 4096`` with GQA; its block count (the key partition) depends on
  ``n_simds = gqa * qL`` and ``N = kL`` (:func:`two_pass_blocks`);
* decode-only variant ``sdpa_vector_2pass_1_gqa`` (contiguous key chunks
  instead of strided ones): ``qL == 1``, no array mask, no sinks, D == V,
  ``kL >= 8192``, GQA 8 with D in {64, 128}. Later main (``00703ea``) also
  sends GQA 12 and 16 with D = 128 there, and runs head dim 512 on a vector
  kernel for ``qL == 1`` only; both are folded in here, because a rule that
  sees a kernel change where 0.32.4 has none only shortens windows, while
  the converse would break exactness.

The vector kernels give key ``i`` to SIMD-group ``i % 32`` (one pass) or to
block ``i % blocks`` (two passes), skip masked keys and combine partial sums
in a fixed order, so a verify query whose causal mask hides the window's
later keys sums exactly the keys, in the order, of the decode step at its
length, as long as the kernel and block count are the same.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlx_loom.nn.attention_geometry import AttentionGeometry

#: The MLX release these rules are pinned to (tested against the installed one).
MLX_VERSION = "0.32.4"

#: Where they were read.
SOURCE = (
    "ml-explore/mlx mlx/backend/metal/scaled_dot_product_attention.cpp (main 846d176, "
    "0.32.2.dev; later main 00703ea folded in) and kernels/sdpa_vector.h (mlx 0.32.4 wheel)"
)

#: ``eval_gpu``: the vector kernels serve queries of at most this length.
VECTOR_MAX_QUERY = 8
#: ``has_fused_kernel``: and only while ``query length * gqa_factor`` is at most this.
VECTOR_MAX_QUERY_TIMES_GQA = 32
#: ``has_fused_kernel``: (D, V) head dims with a vector kernel, for any query length <= 8.
VECTOR_HEAD_DIMS: frozenset[tuple[int, int]] = frozenset(
    {(64, 64), (96, 96), (128, 128), (256, 256), (192, 128)}
)
#: ``use_fallback``: fused but run unfused anyway for ``qL <= 8``.
VECTOR_UNFUSED_BY_CHOICE: frozenset[tuple[int, int]] = frozenset({(192, 192)})
#: Head dims with a vector kernel for one-token queries only (later main; see above).
DECODE_ONLY_HEAD_DIMS: frozenset[tuple[int, int]] = frozenset({(512, 512)})
#: ``eval_gpu``: two passes from this KV length on device classes ``d`` and ``s`` ...
TWO_PASS_MIN_KV_LARGE_DEVICE = 1024
#: ... and from this KV length on any device when the call has GQA.
TWO_PASS_MIN_KV_GQA = 4096
LARGE_DEVICE_CLASSES = frozenset("ds")
#: ``sdpa_vector_2pass``: the decode-only chunked kernel, by GQA factor: head dims.
GQA_DECODE_KERNEL: dict[int, frozenset[int]] = {
    8: frozenset({64, 128}),
    12: frozenset({128}),
    16: frozenset({128}),
}
GQA_DECODE_MIN_KV = 8192


def two_pass_blocks(device_class: str, n_simds: int, kv_length: int) -> int:
    """``sdpa_vector_2pass``'s block count: how the keys are partitioned.

    ``n_simds = gqa_factor * query_length``, ``kv_length`` is MLX's ``N``.
    (``MLX_SDPA_BLOCKS`` overrides it in MLX; a run that sets it is outside
    these rules.)
    """
    N = kv_length
    if device_class == "s":
        if N > 1024 and n_simds > 4:
            if N <= 8192:
                return 128
            if N <= 32768:
                return 256
            if N <= 65536:
                return 512
            return 1024
        return 64
    if device_class == "d":
        if n_simds <= 2 and N > 8192:
            return 256
        if n_simds >= 6:
            if 16384 <= N < 65536:
                return 512
            if N >= 65536:
                return 1024
        return 128
    return 64 if n_simds >= 4 else 32


def metal_attention_kernel(
    query_length: int, kv_length: int, geometry: AttentionGeometry, device_class: str
) -> str:
    """The kernel MLX's Metal SDPA runs for one call (no array mask on one-token calls).

    ``"full"`` (steel), ``"unfused"`` (matmul-softmax-matmul), ``"vector"``
    (one pass), ``"vector-2pass/<blocks>"`` or ``"vector-2pass-gqa/<blocks>"``;
    two calls that return the same string sum each query's keys in the same
    order.
    """
    qL, kL, gqa = query_length, kv_length, geometry.gqa
    dims = (geometry.head_dim, geometry.value_dim)
    if qL > VECTOR_MAX_QUERY:
        return "full"
    if dims in DECODE_ONLY_HEAD_DIMS:
        # Later main: one-token queries at GQA 8 from 1024 keys; else unfused.
        return "vector-d512" if qL == 1 and gqa == 8 and kL >= 1024 else "unfused"
    if (
        dims not in VECTOR_HEAD_DIMS
        or dims in VECTOR_UNFUSED_BY_CHOICE
        or qL * gqa > VECTOR_MAX_QUERY_TIMES_GQA
        or qL > kL
    ):
        return "unfused"
    two_pass = (device_class in LARGE_DEVICE_CLASSES and kL >= TWO_PASS_MIN_KV_LARGE_DEVICE) or (
        gqa > 1 and kL >= TWO_PASS_MIN_KV_GQA
    )
    if not two_pass:
        return "vector"
    variant = "vector-2pass"
    if (
        qL == 1
        and dims[0] == dims[1]
        and dims[0] in GQA_DECODE_KERNEL.get(gqa, frozenset())
        and kL >= GQA_DECODE_MIN_KV
    ):
        variant = "vector-2pass-gqa"
    return f"{variant}/{two_pass_blocks(device_class, gqa * qL, kL)}"
