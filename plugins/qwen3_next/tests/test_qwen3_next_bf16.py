"""bf16 MoE on the CPU: mlx-lm cannot run it (gather_mm is fp32-only here); we can.

Tolerance: the fp32 reference uses the *same* bf16-valued weights stored in
fp32, so the only difference is activation precision. On this random tiny
model mlx-lm's own bf16 dense path (qwen3_5, no MoE) deviates from its fp32
path by ~5% of max|logit| at prompt positions, and the error grows over decode
steps; we allow 25% of max|logit| per step over 32 teacher-forced steps and
require the greedy token to agree on at least 28 of 32 steps.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_loom_qwen3_next.kernels import expert_matmul_cpu

PROMPT = [1, 5, 7, 9, 11, 200, 3, 4, 8, 100, 42, 17]


def test_mlx_lm_cannot_run_a_bf16_moe_checkpoint_on_the_cpu(loaders):
    ref = loaders("qwen3_next-bf16")[1]
    with pytest.raises(RuntimeError, match="only supports float32"):
        mx.eval(ref(mx.array([PROMPT])))


def test_bf16_moe_runs_on_the_cpu_and_tracks_the_fp32_reference(ckpt_dir, loaders):
    ours16 = loaders("qwen3_next-bf16")[0]
    ours32 = loaders("qwen3_next-bf16weights-fp32")[0]
    c16, c32 = ours16.make_cache(), ours32.make_cache()
    x = mx.array([PROMPT])
    l16, l32 = ours16(x, cache=c16), ours32(x, cache=c32)
    assert l16.dtype == mx.bfloat16
    agree = 0
    for _ in range(32):
        scale = mx.abs(l32).max().item()
        assert mx.abs(l32 - l16.astype(mx.float32)).max().item() <= 0.25 * scale
        t = mx.argmax(l32[:, -1], -1)[:, None]
        agree += int(t.item() == mx.argmax(l16[:, -1], -1).item())
        l16, l32 = ours16(t, cache=c16), ours32(t, cache=c32)
    assert agree >= 28


def _expert_case(n_tokens: int):
    k1, k2, k3 = mx.random.split(mx.random.key(3), 3)
    E, H, D, top_k = 8, 16, 32, 2
    x = mx.random.normal((n_tokens, 1, 1, D), key=k1).astype(mx.bfloat16)
    w = (mx.random.normal((E, H, D), key=k2) * 0.2).astype(mx.bfloat16)
    idx = mx.random.randint(0, E, (n_tokens, top_k), key=k3).astype(mx.uint32)
    exact = mx.gather_mm(
        x.astype(mx.float32), w.astype(mx.float32).swapaxes(-1, -2), rhs_indices=idx
    )
    return x, w, idx, exact


@pytest.mark.parametrize(
    "n_tokens", [1, 3, 40], ids=["decode-gather", "few-gather", "prefill-upcast"]
)
def test_bf16_expert_matmul_is_the_fp32_product_rounded_once(n_tokens):
    x, w, idx, exact = _expert_case(n_tokens)
    y = expert_matmul_cpu(x, w, idx)
    assert y.dtype == mx.bfloat16 and y.shape == exact.shape
    # One rounding of an fp32 product: within half a bf16 ulp of it (2^-9 relative),
    # plus fp32 accumulation-order noise between matmul and gather_mm.
    assert mx.allclose(y.astype(mx.float32), exact, rtol=2**-8, atol=1e-6)


def test_fp32_expert_matmul_is_mlx_lms_gather_mm_bit_for_bit():
    x, w, idx, _ = _expert_case(5)
    x, w = x.astype(mx.float32), w.astype(mx.float32)
    want = mx.gather_mm(x, w.swapaxes(-1, -2), rhs_indices=idx)
    assert mx.array_equal(expert_matmul_cpu(x, w, idx), want)
