"""bf16 routed experts on the CPU: the two strategies MLX allows, timed and measured side by side.

``mx.gather_mm`` is fp32-only on the CPU (MLX 0.32), so bf16 experts need a
workaround; the evidence for the one ``mlx_loom.nn.experts`` uses comes from
here. Run by hand (not a test)::

    .venv/bin/python benchmarks/moe_bf16_cpu.py
    .venv/bin/python benchmarks/moe_bf16_cpu.py --experts 64 --hidden 1024 --width 512 --top-k 8

* **grouped** (what the core ships): read the router's choice on the host,
  sort the tokens by expert, three plain bf16 matmuls per used expert;
* **upcast**: convert the routed experts' weights (all of them once there are
  at least as many pairs as experts) and the activations to fp32, run
  ``gather_mm`` in fp32, round the product once to bf16.

For each token count it prints the best time of ``--repeats`` runs, the peak
memory (weights included) and whether the two results are bit-identical;
then a decode loop over ``--layers`` stacked MoE layers pipelined with
``mx.async_eval``, the way the generation loop runs (which is where the
grouped strategy's host sync per layer would cost).
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx

from mlx_loom.nn import SwitchLinear, gather_switch_glu, grouped_switch_glu, swiglu


class Upcast:
    """One expert projection computed as an fp32 ``gather_mm`` of upcast operands."""

    is_quantized = False

    def __init__(self, layer: SwitchLinear) -> None:
        self.weight = layer.weight

    def gather(self, x: mx.array, indices: mx.array, sorted_indices: bool) -> mx.array:
        x32 = x.astype(mx.float32)
        if indices.size < self.weight.shape[0]:  # decode: upcast only the routed experts
            y = x32 @ self.weight[indices].astype(mx.float32).swapaxes(-1, -2)
        else:
            w = self.weight.astype(mx.float32).swapaxes(-1, -2)
            y = mx.gather_mm(x32, w, rhs_indices=indices, sorted_indices=sorted_indices)
        return y.astype(x.dtype)


def upcast_switch_glu(x, indices, gate, up, down, activation):
    return gather_switch_glu(x, indices, Upcast(gate), Upcast(up), Upcast(down), activation)


STRATEGIES = {"upcast": upcast_switch_glu, "grouped": grouped_switch_glu}


def _experts(args: argparse.Namespace) -> list[SwitchLinear]:
    keys = mx.random.split(mx.random.key(0), 3)
    shapes = [(args.hidden, args.width), (args.hidden, args.width), (args.width, args.hidden)]
    layers = []
    for key, (i, o) in zip(keys, shapes, strict=True):
        layer = SwitchLinear(i, o, args.experts)
        layer.weight = (mx.random.normal(layer.weight.shape, key=key) * 0.03).astype(mx.bfloat16)
        layers.append(layer)
    mx.eval([layer.weight for layer in layers])
    return layers


def _routing(args: argparse.Namespace, tokens: int) -> tuple[mx.array, mx.array]:
    x = mx.random.normal((1, tokens, args.hidden), key=mx.random.key(1)).astype(mx.bfloat16)
    picks = [
        mx.random.permutation(args.experts, key=mx.random.key(100 + t))[: args.top_k]
        for t in range(tokens)
    ]
    idx = mx.stack(picks)[None].astype(mx.uint32)
    mx.eval(x, idx)
    return x, idx


def per_call(args: argparse.Namespace, experts: list[SwitchLinear]) -> None:
    print(f"{'tokens':>7} {'strategy':>9} {'best ms':>9} {'peak MiB':>9}  bit-identical")
    for tokens in args.tokens:
        x, idx = _routing(args, tokens)
        results = {}
        for name, fn in STRATEGIES.items():
            mx.eval(fn(x, idx, *experts, swiglu))  # warm-up
            mx.reset_peak_memory()
            best = float("inf")
            for _ in range(args.repeats):
                start = time.perf_counter()
                results[name] = fn(x, idx, *experts, swiglu)
                mx.eval(results[name])
                best = min(best, time.perf_counter() - start)
            same = mx.array_equal(results[name], results["upcast"]).item()
            print(
                f"{tokens:>7} {name:>9} {best * 1e3:>9.1f} "
                f"{mx.get_peak_memory() / 2**20:>9.1f}  {same}"
            )


def pipelined_decode(args: argparse.Namespace, experts: list[SwitchLinear]) -> None:
    router = (mx.random.normal((args.hidden, args.experts), key=mx.random.key(2)) * 0.03).astype(
        mx.bfloat16
    )

    def step(h: mx.array, fn) -> mx.array:
        for _ in range(args.layers):
            idx = mx.argpartition(h @ router, kth=-args.top_k, axis=-1)[..., -args.top_k :]
            h = h + 0.1 * fn(h, idx, *experts, swiglu).sum(-2)
        return h

    print(
        f"\n{args.layers} stacked MoE layers, decode, async-pipelined "
        f"({args.steps} steps; best of {args.repeats} rounds, strategies interleaved)"
    )
    best = dict.fromkeys(STRATEGIES, float("inf"))
    for _ in range(args.repeats):
        for name, fn in STRATEGIES.items():
            h = mx.random.normal((1, 1, args.hidden), key=mx.random.key(3)).astype(mx.bfloat16)
            mx.eval(step(h, fn))
            start = time.perf_counter()
            nxt = step(h, fn)
            mx.async_eval(nxt)
            for _ in range(args.steps):
                cur, nxt = nxt, step(nxt, fn)
                mx.async_eval(nxt)
                mx.eval(cur)
            mx.eval(nxt)
            best[name] = min(best[name], (time.perf_counter() - start) / (args.steps + 1))
    for name, seconds in best.items():
        print(f"{name:>9} {seconds * 1e3:8.1f} ms/step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    experts = _experts(args)
    per_call(args, experts)
    pipelined_decode(args, experts)


if __name__ == "__main__":
    main()
