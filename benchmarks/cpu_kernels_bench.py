"""One matrix product, native kernel against MLX's operation: milliseconds and GB/s.

Run by hand (not a test)::

    .venv/bin/python benchmarks/cpu_kernels_bench.py [--rows 1,4,8,64,512] [--n 4096 --k 1024]

For each number of activation rows M it times ``x[M, K] @ W[N, K].T`` with
W in bf16, fp32, 4-bit and 8-bit (group 64, bf16 scales), fp32 activations,
the two implementations interleaved, and prints medians. Weights of this
size may sit in the last-level cache; the whole-model benchmark
(``cpu_bench.py``) is the one that meets DRAM bandwidth.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx

from mlx_loom.cpu import native


def timed(fn, repeats: int) -> float:
    mx.eval(fn())
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(fn())
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def cases(nat, x, w32, w16, packed) -> dict:
    """name -> (native call, MLX call, the weight arrays read)."""
    out = {
        "bf16": (lambda: nat.dense_matmul(x, w16), lambda: x @ w16.astype(mx.float32).T, [w16]),
        "fp32": (lambda: nat.dense_matmul(x, w32), lambda: x @ w32.T, [w32]),
    }
    for bits, (wq, s, b) in packed.items():
        s32, b32 = s.astype(mx.float32), b.astype(mx.float32)
        out[f"q{bits}"] = (
            lambda wq=wq, s=s, b=b, bits=bits: nat.affine_matmul(x, wq, s, b, bits, 64),
            lambda wq=wq, s32=s32, b32=b32, bits=bits: mx.quantized_matmul(
                x, wq, s32, b32, group_size=64, bits=bits
            ),
            [wq, s, b],
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,8,64,512")
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--k", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    nat = native.module()
    N, K = args.n, args.k
    w32 = mx.random.normal((N, K), key=mx.random.key(0))
    w16 = w32.astype(mx.bfloat16)
    packed = {bits: mx.quantize(w16, group_size=64, bits=bits) for bits in (4, 8)}
    mx.eval(w32, w16, packed)
    print(f"N={N} K={K}, {native.threads()} threads; ms (median of {args.repeats})")
    print(f"{'M':>5} {'weights':>8} {'native':>9} {'mlx':>9} {'speed-up':>9} {'native GB/s':>12}")
    for M in map(int, args.rows.split(",")):
        x = mx.random.normal((M, K), key=mx.random.key(M))
        for name, (ours, theirs, weights) in cases(nat, x, w32, w16, packed).items():
            repeats = args.repeats if M <= 64 else max(3, args.repeats // 3)
            t_ours, t_theirs = timed(ours, repeats), timed(theirs, repeats)
            nbytes = sum(a.nbytes for a in weights)
            print(
                f"{M:>5} {name:>8} {t_ours:>9.3f} {t_theirs:>9.3f} {t_theirs / t_ours:>8.1f}x "
                f"{nbytes / t_ours / 1e6:>12.1f}"
            )


if __name__ == "__main__":
    main()
