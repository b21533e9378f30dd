"""Where does attention arithmetic change with KV length? (the data behind a VerifyPolicy)

Run by hand on the device to measure (not a test)::

    .venv/bin/python benchmarks/verify_boundaries.py --max-kv 4096

For every KV length ``L`` up to ``--max-kv`` and window widths 2..``--width``,
attention of a window of ``N`` queries over ``L + N`` keys (the causal mask a
verify window uses) is compared with ``N`` one-query steps over ``L + 1`` ..
``L + N`` keys (what one-token decoding computes). A length where any query
differs is where the backend's arithmetic changes between the two; a
:class:`~mlx_loom.host.VerifyPolicy` lists those lengths so a verify window
never straddles one. Prints the lengths found (none: every window is exact).
"""

from __future__ import annotations

import argparse
import sys

import mlx.core as mx


def mismatches(max_kv: int, width: int, heads: int, kv_heads: int, dim: int, dtype) -> list:
    key = mx.random.key(0)
    kq, kk, kv = mx.random.split(key, 3)
    total = max_kv + width
    q_all = mx.random.normal((1, heads, total, dim), key=kq).astype(dtype)
    k_all = mx.random.normal((1, kv_heads, total, dim), key=kk).astype(dtype)
    v_all = mx.random.normal((1, kv_heads, total, dim), key=kv).astype(dtype)
    scale = dim**-0.5
    found = []
    for L in range(0, max_kv):
        for n in range(2, width + 1):
            q = q_all[:, :, L : L + n]
            keys, values = k_all[:, :, : L + n], v_all[:, :, : L + n]
            mask = mx.arange(L, L + n)[:, None] >= mx.arange(L + n)[None]
            window = mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)
            steps = [
                mx.fast.scaled_dot_product_attention(
                    q[:, :, j : j + 1],
                    keys[:, :, : L + j + 1],
                    values[:, :, : L + j + 1],
                    scale=scale,
                    mask=None,
                )
                for j in range(n)
            ]
            same = mx.array_equal(window, mx.concatenate(steps, axis=2)).item()
            if not same:
                found.append((L, n))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-kv", type=int, default=4096)
    parser.add_argument("--width", type=int, default=5, help="widest window (draft tokens + 1)")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    args = parser.parse_args(argv)
    dtype = getattr(mx, args.dtype)
    found = mismatches(args.max_kv, args.width, args.heads, args.kv_heads, args.dim, dtype)
    print(f"device: {mx.default_device()}  dtype: {args.dtype}  KV lengths 0..{args.max_kv - 1}")
    if not found:
        print("every verify window equals one-token steps: no boundary")
    else:
        lengths = sorted({L for L, _ in found})
        print(f"{len(found)} (length, width) pairs differ; first KV lengths: {lengths[:20]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
