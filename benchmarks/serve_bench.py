"""``loom serve`` beside ``mlx_lm.server``: throughput and time to first token under load.

Run by hand (not a test)::

    .venv/bin/python benchmarks/serve_bench.py                      # both rows
    .venv/bin/python benchmarks/serve_bench.py --rows tiny --repeats 5
    .venv/bin/python benchmarks/serve_bench.py --concurrency 1,8 --max-tokens 32

Both servers run as subprocesses on localhost, on the same random-weight
checkpoint (Hugging Face layout, written once under ``benchmarks/.checkpoints``),
each with its defaults (mlx-lm's batching defaults are the same numbers:
decode concurrency 32, prompt concurrency 8, prefill step 2048). The client
is the same for both: ``N`` concurrent streaming ``/v1/completions``
requests, each with its own prompt, greedy, EOS suppressed with
``logit_bias`` so every request generates exactly ``--max-tokens`` tokens.
Time to first token is the time to the first streamed chunk with text.

For each concurrency ``N`` a round reports the aggregate generation rate
(all generated tokens / the round's wall time) and each request's time to
first token (TTFT: from sending the request to its first streamed token).
``--long-every K`` makes every K-th request's prompt long (``--long-words``
words; the others keep 40): a mix where long prefills meet running streams,
with TTFT percentiles given for the short and the long requests apart.
``--loom-variant "ARGS"`` (repeatable) adds a ``loom serve`` with those extra
flags to the same interleaved rounds (e.g. ``--prefill-token-budget 0``, the
scheduling without a prefill budget), and ``--no-mlx-lm`` leaves mlx-lm out.
Rounds are interleaved — for every repeat, every concurrency, both servers,
the order alternating — and the table gives medians over repeats (TTFT
percentiles over every request of every repeat). ``vs serial`` is the
aggregate rate over the same server's rate at concurrency 1.

``--openblas PATH`` preloads an OpenBLAS library into both servers alike
(``LD_PRELOAD``; the ``mlx[cpu]`` wheel otherwise links reference BLAS,
whose fp32 matrix products cost time in proportion to their rows, so that
batching rows saves little). Results then differ from the bundled BLAS by
~1e-6, so the parity tests never run with it.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import Row, build, llama  # noqa: E402

#: The vocabulary is exactly the test tokenizer's (270 ids: all its corpus
#: yields), so that every generated token decodes to text and streams at once;
#: an id the tokenizer lacks decodes to nothing and would stream nothing.
VOCAB = 270
ROWS = {
    "tiny": Row("serve-llama-tiny-f32", "llama", llama(256, 4, 8, 2, 688, VOCAB), "F32"),  # 3.0M
    "100m": Row("serve-llama-100m-f32", "llama", llama(768, 16, 12, 4, 2048, VOCAB), "F32"),  # 101M
}
#: Seconds a request may wait for its next byte before it counts as failed.
REQUEST_TIMEOUT = 300.0
WORDS = (
    "the model reads a token and writes the next one while the cache keeps every key "
    "and value of the prompt so decoding stays cheap and fast on every device hello world"
).split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    name: str
    command: list[str]
    port: int
    proc: subprocess.Popen | None = None

    env: dict[str, str] = field(default_factory=dict)

    def start(self, timeout: float = 600.0) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        self.proc = subprocess.Popen(
            self.command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, text=True
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.proc.stderr.read()[-2000:]}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} did not become healthy in {timeout} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def servers(
    path: Path,
    env: dict[str, str] | None = None,
    variants: list[str] | None = None,
    mlx_lm: bool = True,
) -> list[Server]:
    loom = str(Path(sys.executable).parent / "loom")
    env = env or {}
    out = []
    for extra in ["", *(variants or [])]:
        port = free_port()
        name = f"mlx-loom {extra}".strip()
        command = [loom, "serve", "--model", str(path), "--port", str(port), *extra.split()]
        out.append(Server(name, command, port, env=env))
    if mlx_lm:
        port = free_port()
        command = [sys.executable, "-m", "mlx_lm", "server", "--model", str(path)]
        out.append(Server("mlx-lm", [*command, "--port", str(port)], port, env=env))
    return out


@dataclass
class Result:
    ttft: float
    seconds: float
    tokens: int
    long: bool = False


def one_request(
    port: int, prompt: str, max_tokens: int, eos: list[int], out: list, long: bool = False
) -> None:
    try:
        _one_request(port, prompt, max_tokens, eos, out, long)
    except OSError as err:  # a server that drops a connection under load: count it
        out.append(err)


def _one_request(
    port: int, prompt: str, max_tokens: int, eos: list[int], out: list, long: bool
) -> None:
    body = json.dumps(
        {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "logit_bias": {str(t): -100 for t in eos},
        }
    )
    start = time.perf_counter()
    # A connection a server never answers (mlx_lm.server's listen backlog of 5
    # overflows under bursts) would otherwise hang the round: it counts as failed.
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT)
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()[:500]
    first = None
    chunks = 0
    buffer = b""
    while True:
        data = resp.read1(65536)
        if not data:
            break
        buffer += data
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            if not event.startswith(b"data: ") or event == b"data: [DONE]":
                continue
            payload = json.loads(event[6:])
            choices = payload.get("choices") or [{}]
            if choices[0].get("text"):
                # The first *text*: a server may stream chunks with empty text
                # while its detokenizer holds bytes back; they show nothing.
                chunks += 1
                if first is None:
                    first = time.perf_counter()
    end = time.perf_counter()
    conn.close()
    out.append(Result((first or end) - start, end - start, chunks, long))


@dataclass
class Mix:
    """Which requests of a round get a long prompt, and how long."""

    every: int = 0  # 0: none
    words: int = 1500


@dataclass
class Round:
    tps: float
    ttfts: list[float] = field(default_factory=list)
    failed: int = 0
    long_ttfts: list[float] = field(default_factory=list)


def run_round(
    server: Server, n: int, max_tokens: int, eos: list[int], seed: int, mix: Mix | None = None
) -> Round:
    mix = mix or Mix()

    def is_long(i: int) -> bool:
        return bool(mix.every) and i % mix.every == mix.every - 1

    def prompt(i: int) -> str:
        count = mix.words if is_long(i) else 40
        return " ".join(WORDS[(seed + 7 * i + j) % len(WORDS)] for j in range(count))

    prompts = [prompt(i) for i in range(n)]
    results: list[Result] = []
    threads = [
        threading.Thread(
            target=one_request, args=(server.port, p, max_tokens, eos, results, is_long(i))
        )
        for i, p in enumerate(prompts)
    ]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    assert len(results) == n
    done = [r for r in results if isinstance(r, Result)]
    return Round(
        len(done) * max_tokens / wall,
        [r.ttft for r in done if not r.long],
        n - len(done),
        [r.ttft for r in done if r.long],
    )


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    k = max(0, min(len(values) - 1, round(q * (len(values) - 1))))
    return values[k]


def bench_row(
    row: Row,
    levels: list[int],
    repeats: int,
    max_tokens: int,
    env: dict[str, str],
    mix: Mix,
    variants: list[str],
    mlx_lm: bool,
) -> dict:
    from mlx_loom.text import Tokenizer

    path = build(row)
    tokenizer = Tokenizer.from_dir(path)
    assert tokenizer.vocab_size == row.config["vocab_size"], "every id must decode to text"
    eos = sorted(tokenizer.eos_token_ids)
    pair = servers(path, env, variants, mlx_lm)
    for s in pair:
        s.start()
    rounds: dict[tuple[str, int], list[Round]] = {}
    try:
        for s in pair:  # warm-up: compile paths, page in the weights
            run_round(s, 2, 8, eos, seed=99)
        for r in range(repeats):
            for n in levels:
                order = pair if (r + n) % 2 == 0 else pair[::-1]
                for s in order:
                    rounds.setdefault((s.name, n), []).append(
                        run_round(s, n, max_tokens, eos, seed=r, mix=mix)
                    )
                    last = rounds[(s.name, n)][-1]
                    failed = f" ({last.failed} requests failed)" if last.failed else ""
                    print(
                        f"  {row.name} {s.name:8s} N={n:2d} repeat {r}: "
                        f"{last.tps:7.1f} tok/s{failed}",
                        flush=True,
                    )
    finally:
        for s in pair:
            s.stop()
    table = {}
    for (name, n), rs in rounds.items():
        tps = [x.tps for x in rs]
        ttfts = [t for x in rs for t in x.ttfts]
        longs = [t for x in rs for t in x.long_ttfts]
        table[f"{name}/{n}"] = {
            "tps_median": statistics.median(tps),
            "tps_min": min(tps),
            "tps_max": max(tps),
            "ttft_p50": percentile(ttfts, 0.5) if ttfts else None,
            "ttft_p95": percentile(ttfts, 0.95) if ttfts else None,
            "long_ttft_p50": percentile(longs, 0.5) if longs else None,
            "long_ttft_p95": percentile(longs, 0.95) if longs else None,
            "failed_requests": sum(x.failed for x in rs),
        }
    return table


def _pair(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None else f"{a:.3f} / {b:.3f}"


def print_table(row: Row, table: dict, levels: list[int]) -> None:
    print(f"\n### {row.name}\n")
    print(
        "| server | N | tok/s (median, min-max) | vs its N=1 | TTFT p50 / p95 (s) | "
        "long-prompt TTFT p50 / p95 (s) |"
    )
    print("|---|---|---|---|---|---|")
    names = sorted({key.split("/")[0] for key in table})
    for name in names:
        serial = table.get(f"{name}/1", {}).get("tps_median")
        for n in levels:
            a = table[f"{name}/{n}"]
            vs = f"{a['tps_median'] / serial:.2f}" if serial else "-"
            print(
                f"| {name} | {n} | {a['tps_median']:.1f} ({a['tps_min']:.1f}-{a['tps_max']:.1f}) "
                f"| {vs} | {_pair(a['ttft_p50'], a['ttft_p95'])} | "
                f"{_pair(a['long_ttft_p50'], a['long_ttft_p95'])} |"
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="tiny,100m", help=f"of {', '.join(ROWS)}")
    parser.add_argument("--concurrency", default="1,4,8,16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--openblas", help="preload this OpenBLAS library into both servers")
    parser.add_argument("--long-every", type=int, default=0, help="every K-th prompt is long")
    parser.add_argument("--long-words", type=int, default=1500, help="words of a long prompt")
    parser.add_argument(
        "--loom-variant", action="append", default=[], help="another loom serve with these flags"
    )
    parser.add_argument("--no-mlx-lm", action="store_true", help="run loom serve only")
    args = parser.parse_args()
    mix = Mix(args.long_every, args.long_words)
    levels = [int(x) for x in args.concurrency.split(",")]
    env = {}
    if args.openblas:
        env = {"LD_PRELOAD": args.openblas, "OPENBLAS_NUM_THREADS": "1"}
    results = {}
    for key in args.rows.split(","):
        row = ROWS[key]
        print(f"{row.name}: {levels} concurrent streams x {args.max_tokens} tokens", flush=True)
        results[row.name] = bench_row(
            row,
            levels,
            args.repeats,
            args.max_tokens,
            env,
            mix,
            args.loom_variant,
            not args.no_mlx_lm,
        )
        print_table(row, results[row.name], levels)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
