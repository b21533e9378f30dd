"""Where a backend's attention arithmetic changes with sequence length: verify-window policy.

Speculative decoding verifies ``k`` draft tokens in one forward and keeps
what one-token decoding would have produced. That is exact only if every
query of the verify window is computed with the arithmetic a one-token step
at the same length would use. Attention kernels switch code paths (tile
sizes, split-K reductions, vector vs. matrix kernels) at fixed key/value
lengths, and across such a point a window would mix two arithmetics. A
:class:`VerifyPolicy` names those points for one backend, and the engine
shrinks a verify window so that it never straddles one.

The points are *inclusive KV lengths*: the last length of one regime. A
window whose queries attend over ``lo .. hi`` keys straddles ``b`` when
``lo <= b < hi``.

Measured values:

* ``cpu`` — none. MLX 0.32.4's CPU backend runs attention as plain ops
  (matmul, masked softmax, matmul) whose per-query sums are sequential: a
  verify window of 2..5 queries over any KV length 0..2047 gives each query
  its one-token step's output bit for bit (fp32; bf16 over 0..1099; 8 query
  / 2 KV heads of 64; ``benchmarks/verify_boundaries.py`` re-measures it),
  and the families' verify logits equal their decode logits bit for bit
  (tested).
* ``metal`` — 1023, 1024, 8192, 32768, 65536: where MLX 0.32.x's Metal
  scaled-dot-product attention changes regime (measured for a Qwen geometry
  on Apple silicon; not measurable on this project's CI machines).
* ``cuda`` — not measured, so not registered: speculation on CUDA is refused
  until someone measures it, rather than assumed exact.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ..backends import Backend, active_backend
from ..errors import CapabilityRefused


@dataclass(frozen=True)
class VerifyPolicy:
    """The KV lengths after which ``backend``'s attention arithmetic changes."""

    backend: Backend
    boundaries: tuple[int, ...] = ()
    evidence: str = ""

    def window(self, kv_length: int, width: int) -> int:
        """The widest window ``<= width`` that may start after ``kv_length`` cached tokens.

        Query ``j`` of the window attends over ``kv_length + j + 1`` keys; the
        window is cut before the first boundary it would cross (a window of
        one token is always allowed: that is one-token decoding).
        """
        lo = kv_length + 1
        for b in self.boundaries:
            if lo <= b < kv_length + width:
                return max(1, b - kv_length)
        return width


_BUILTIN: Mapping[Backend, VerifyPolicy] = {
    "cpu": VerifyPolicy(
        "cpu", (), "MLX 0.32.4 CPU ops and the CPU kernels: no change with KV or query length"
    ),
    "metal": VerifyPolicy(
        "metal",
        (1023, 1024, 8192, 32768, 65536),
        "MLX 0.32.x Metal SDPA regime boundaries (measured on Apple silicon)",
    ),
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
                "changes with sequence length has not been measured, so verified draft tokens "
                "could differ from plain decoding.",
                fix="Generate without a draft on this backend, or register a VerifyPolicy "
                "for it (mlx_loom.host.VerifyPolicy) after measuring it.",
            )
        return policy


#: The policies the engine uses.
VERIFY_POLICIES = VerifyPolicies()
