"""Where a backend's attention arithmetic changes with shape: verify-window policy.

Speculative decoding verifies ``k`` draft tokens in one forward and keeps
what one-token decoding would have produced. That is exact only if every
query of the verify window is computed with the arithmetic a one-token step
at the same length would use. Attention kernels switch code paths (vector
vs. matrix kernels, one vs. two passes, how keys are split into blocks) by
key/value length *and* by query length times the GQA factor; across such a
point a window would mix two arithmetics. A :class:`VerifyPolicy` says, per
backend, which windows are safe, and the engine shrinks a verify window
until it is (a window of one token is plain decoding and always safe).

Two kinds of knowledge go into a policy:

* ``boundaries`` — *inclusive KV lengths*, the last length of one regime,
  for any geometry. A window whose queries attend over ``lo .. hi`` keys
  straddles ``b`` when ``lo <= b < hi``.
* ``kernel`` — a rule naming the kernel one attention call runs, given the
  query length, the KV length and the layer's :class:`AttentionGeometry`.
  A window of ``w`` tokens after ``L`` cached ones is one call of query
  length ``w`` over ``L + w`` keys; it is allowed only if, for every layer
  geometry, that call runs the kernel each decode step ``L+1 .. L+w`` runs,
  and that kernel is one the rule knows sums in key order.

Per backend:

* ``cpu`` — no boundary, no rule. MLX 0.32.4's CPU backend runs attention as
  plain ops (matmul, masked softmax, matmul) whose per-query sums are
  sequential: a verify window of 2..5 queries over any KV length 0..2047
  gives each query its one-token step's output bit for bit (fp32; bf16 over
  0..1099; 8 query / 2 KV heads of 64; ``benchmarks/verify_boundaries.py``
  re-measures it), and the families' verify logits equal their decode logits
  bit for bit (tested).
* ``metal`` — the rule :func:`~mlx_loom.host._metal_attention.metal_attention_kernel`,
  MLX's Metal dispatch as data with its source and pinned version; a sliding
  window layer allows a window only while it has not wrapped (past that the
  verify call lays the window's keys out with masked entries between them,
  which moves keys between SIMD-groups on Metal). Speculation on a model
  with no window of 2 over a short context is refused, naming the layer.
* ``cuda`` — not measured, so not registered: speculation on CUDA is refused
  until someone measures it (the same shape of rule, from a CUDA machine),
  rather than assumed exact.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import mlx.core as mx

from ..backends import Backend, active_backend
from ..errors import CapabilityRefused
from ..nn.attention_geometry import AttentionGeometry
from ._metal_attention import MLX_VERSION, SOURCE, metal_attention_kernel

#: ``kernel(query_length, kv_length, geometry) -> name``; calls with equal
#: names sum each query's keys in the same order.
KernelRule = Callable[[int, int, AttentionGeometry], str]

#: Kernel names whose per-query arithmetic does not depend on the query length.
KEY_ORDER_KERNELS = ("vector",)

#: The context at which "is a window of 2 ever allowed" is asked: the shortest
#: one a window of 2 can follow (a window needs as many keys as queries).
SHORT_CONTEXT = 1


@dataclass(frozen=True)
class VerifyPolicy:
    """Which verify windows keep ``backend``'s attention arithmetic that of decoding."""

    backend: Backend
    boundaries: tuple[int, ...] = ()
    evidence: str = ""
    #: The backend's kernel rule (``None``: its kernels never change with the query).
    kernel: KernelRule | None = None

    def window(
        self, kv_length: int, width: int, geometries: Sequence[AttentionGeometry] = ()
    ) -> int:
        """The widest window ``<= width`` that may start after ``kv_length`` cached tokens.

        Query ``j`` of the window attends over ``kv_length + j + 1`` keys; the
        window is cut before the first boundary it would cross and before
        the first width at which a layer's kernel would differ from decoding's.
        """
        lo = kv_length + 1
        for b in self.boundaries:
            if lo <= b < kv_length + width:
                width = max(1, b - kv_length)
                break
        allowed = 1
        while allowed < width and not self._changes(kv_length, allowed + 1, geometries):
            allowed += 1
        return allowed

    def _changes(self, kv_length: int, w: int, geometries: Sequence[AttentionGeometry]) -> str:
        """Why a window of ``w`` after ``kv_length`` tokens is not decoding (``""``: it is)."""
        if self.kernel is None:
            return ""
        for g in geometries:
            verify = self.kernel(w, kv_length + w, g)
            for j in range(w):
                decode = self.kernel(1, kv_length + j + 1, g)
                if not decode.startswith(KEY_ORDER_KERNELS):
                    return f"decoding runs MLX's {decode} attention for {g}"
                if verify != decode:
                    return (
                        f"a window of {w} runs MLX's {verify} attention for {g} where "
                        f"decoding runs {decode}"
                    )
            if g.window is not None and kv_length + w > g.window:
                return f"the sliding window of {g.window} ({g}) would wrap inside the window"
        return ""

    def refusal(self, geometries: Sequence[AttentionGeometry]) -> str:
        """Why no window of 2 is allowed for these layers even after one token (``""``: one is).

        A model allowed there speculates; at longer contexts the rules may
        still cut a window to one token (a plain decode step), never refuse.
        """
        if self.kernel is not None and not geometries:
            return (
                "the model declares no attention geometry (each attention module's "
                "`geometry`, an mlx_loom.nn.AttentionGeometry), so its kernels cannot be known"
            )
        return self._changes(SHORT_CONTEXT, 2, geometries)

    def check(self, geometries: Sequence[AttentionGeometry]) -> None:
        """Refuse speculation for a model whose layers never allow a window of 2."""
        why = self.refusal(geometries)
        if why:
            raise CapabilityRefused(
                f"Speculative decoding on the {self.backend} backend: no verify window of "
                f"2 tokens computes what decoding computes for this model: {why}, so "
                "verified draft tokens could differ from plain decoding "
                f"({self.evidence}).",
                fix="Generate without a draft for this model on this backend.",
            )


@functools.cache
def _metal_device_class() -> str:
    """The last letter of the Metal GPU's architecture name (MLX's ``devc``), read once."""
    return str(mx.metal.device_info()["architecture"])[-1:]


def metal_rule(device_class: str | None = None) -> KernelRule:
    """MLX's Metal kernel rule for ``device_class`` (default: this machine's GPU)."""

    def rule(query_length: int, kv_length: int, geometry: AttentionGeometry) -> str:
        dc = device_class if device_class is not None else _metal_device_class()
        return metal_attention_kernel(query_length, kv_length, geometry, dc)

    return rule


def metal_policy(device_class: str | None = None) -> VerifyPolicy:
    return VerifyPolicy(
        "metal",
        (),
        f"MLX {MLX_VERSION}'s Metal attention dispatch, read from {SOURCE}",
        metal_rule(device_class),
    )


_BUILTIN: Mapping[Backend, VerifyPolicy] = {
    "cpu": VerifyPolicy(
        "cpu", (), "MLX 0.32.4 CPU ops and the CPU kernels: no change with KV or query length"
    ),
    "metal": metal_policy(),
}


class VerifyPolicies:
    """Verify policies by backend (the built-in ones plus any registered)."""

    def __init__(self, extra: Iterable[VerifyPolicy] = ()) -> None:
        self._by_backend = dict(_BUILTIN)
        for policy in extra:
            self._by_backend[policy.backend] = policy

    def for_backend(self, backend: Backend | None = None) -> VerifyPolicy:
        """The policy of ``backend`` (default: the one running here), or a refusal."""
        backend = backend or active_backend()
        policy = self._by_backend.get(backend)
        if policy is None:
            raise CapabilityRefused(
                f"Speculative decoding on the {backend} backend: where its attention arithmetic "
                "changes with the query and KV lengths has not been measured, so verified draft "
                "tokens could differ from plain decoding.",
                fix="Generate without a draft on this backend, or register a VerifyPolicy "
                "for it (mlx_loom.host.VerifyPolicy) after measuring it.",
            )
        return policy


#: The policies the engine uses.
VERIFY_POLICIES = VerifyPolicies()
