"""Prefix reuse in an agent-like session: ``loom serve`` beside ``mlx_lm.server``.

Run by hand (not a test)::

    .venv/bin/python benchmarks/prefix_vs_mlx_lm.py                     # tiny, 3 repeats
    .venv/bin/python benchmarks/prefix_vs_mlx_lm.py --repeats 5 --system 2000
    .venv/bin/python benchmarks/prefix_vs_mlx_lm.py --size medium        # 270-370M parameters

The session of ``prefix_checkpoints.py`` (a long system prompt, 8 turns,
turn 4 regenerates turn 3, turn 6 edits its user message, a restart before
turn 5), sent over HTTP to both servers, on the same random-weight
checkpoints (Llama-, Qwen3-Next- and Gemma-4-shaped, float32, Hugging Face
layout, which both load): each family's tiny test config by default, or with
``--size medium`` a shape of a few hundred million parameters (``MEDIUM``;
the vocabulary stays the test tokenizer's). Both servers run as subprocesses on localhost at
once, each with its default prompt cache; ``loom serve`` also gets
``--prompt-cache-dir`` (mlx-lm's server has no disk tier, so after the
restart it starts empty). Requests are interleaved: every turn goes to both
servers, the order alternating by turn and repeat.

The client plays the agent: the assistant's replies in the conversation are
fixed text (a tool call per turn), not what either server generated, so
both servers see byte-identical prompts. Each request asks for one token,
greedy, non-streaming, so its wall time is the time to first token
(tokenising, template, prefill, one sample, HTTP). Each repeat starts both
servers afresh, and after every (re)start each server answers a short
warm-up request that shares no prefix with the session. Printed per turn:
prompt tokens, the tokens each server says it reused
(``usage.prompt_tokens_details.cached_tokens``, which both report), each
server's median time to first token, and the ratio mlx-lm / mlx-loom as a
median with its range over repeats (above 1: mlx-loom is faster). Wall-clock figures on a busy machine vary; the reused tokens do not.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import mlx_loom

sys.path.insert(0, str(Path(__file__).resolve().parent))

from prefix_checkpoints import FAMILIES, build, session  # noqa: E402
from serve_bench import Server, free_port  # noqa: E402

_S, _F = "sliding_attention", "full_attention"
#: ``--size medium``: per model type, the keys replaced in its tiny config
#: (Llama 271M, Qwen3-Next 368M with 8 experts, 2 active, Gemma 4 342M with a
#: 512-token window; parameter counts as both engines build them).
MEDIUM: dict[str, dict[str, Any]] = {
    "llama": dict(
        hidden_size=1024,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=4,
        intermediate_size=2816,
    ),
    "qwen3_next": dict(
        hidden_size=1024,
        num_hidden_layers=16,
        full_attention_interval=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        linear_num_value_heads=16,
        linear_num_key_heads=8,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=1024,
        intermediate_size=2816,
        mlp_only_layers=[],
    ),
    "gemma4_text": dict(
        hidden_size=1024,
        num_hidden_layers=20,
        layer_types=([_S] * 4 + [_F]) * 4,
        num_kv_shared_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        global_head_dim=256,
        intermediate_size=2048,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=512,
        sliding_window=512,
        hidden_size_per_layer_input=64,
    ),
}

#: Labels of turns 1..8 (the session's script, as in ``prefix_checkpoints.py``).
LABELS = [
    "first",
    "follow-up",
    "follow-up",
    "regenerate",
    "after restart",
    "edit",
    "follow-up",
    "follow-up",
]


def conversation(system_words: int) -> list[list[dict[str, str]]]:
    """The messages of each of the 8 turns, with fixed assistant replies."""
    script = session(system_words)
    messages = list(script[0][1])
    turns = []
    for turn in range(1, 9):
        if turn == 4:  # regenerate turn 3: the same messages again
            messages = messages[:-1]
        elif turn == 6:  # edit the last user message
            messages = messages[:-1]
            messages[-1] = {"role": "user", "content": messages[-1]["content"] + " (edited)"}
        else:
            messages.append(script[turn][1][0])
        turns.append(list(messages))
        reply = f"calling the tool with argument {turn * 7}, then the next step"
        messages.append({"role": "assistant", "content": reply})
    return turns


def chat(port: int, messages: list[dict[str, str]]) -> tuple[float, int, int]:
    """(seconds, prompt tokens, reused tokens) of a one-token greedy request."""
    return one_token(port, "/v1/chat/completions", {"messages": messages})


def one_token(port: int, route: str, body: dict[str, Any]) -> tuple[float, int, int]:
    payload = json.dumps({**body, "max_tokens": 1, "temperature": 0})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    start = time.perf_counter()
    conn.request("POST", route, payload, {"Content-Type": "application/json"})
    response = conn.getresponse()
    data = json.loads(response.read())
    seconds = time.perf_counter() - start
    conn.close()
    if response.status != 200:
        raise RuntimeError(f"port {port} answered {response.status}: {data}")
    usage = data["usage"]
    cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", -1)
    return seconds, usage["prompt_tokens"], cached


def health(port: int) -> dict[str, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/health")
    data = json.loads(conn.getresponse().read())
    conn.close()
    return data


def start_all(servers: list[Server]) -> None:
    """Start the servers at once (loading overlaps), wait for all, warm each up.

    The warm-up is one token for a short plain prompt that shares no prefix
    with the session, so each server's one-time costs of a first request do
    not count in the turn after a (re)start.
    """
    errors: list[BaseException] = []

    def start(server: Server) -> None:
        try:
            server.start()
        except BaseException as exc:  # reported below, on the main thread
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(s,)) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for s in servers:
            s.stop()
        raise errors[0]
    for s in servers:
        one_token(s.port, "/v1/completions", {"prompt": "hello world"})


def make_servers(path: Path, cache_dir: Path) -> list[Server]:
    a, b = free_port(), free_port()
    loom = [sys.executable, "-m", "mlx_loom.cli.main", "serve", "--model", str(path)]
    loom += ["--port", str(a), "--prompt-cache-dir", str(cache_dir)]
    mlx_lm = [sys.executable, "-m", "mlx_lm", "server", "--model", str(path), "--port", str(b)]
    return [Server("mlx-loom", loom, a), Server("mlx-lm", mlx_lm, b)]


def run_repeat(path: Path, turns: list[list[dict[str, str]]], repeat: int, tmp: Path) -> dict:
    """One session on fresh servers: ``{server: [(seconds, prompt, cached), ...]}``."""
    servers = make_servers(path, tmp / f"cache-{repeat}")
    out: dict[str, Any] = {s.name: [] for s in servers}
    start_all(servers)
    try:
        for turn, messages in enumerate(turns, start=1):
            if turn == 5:  # a restart: memory emptied (mlx-loom keeps its disk tier)
                for s in servers:
                    s.stop()
                start_all(servers)
            order = servers if (turn + repeat) % 2 == 0 else servers[::-1]
            for s in order:
                out[s.name].append(chat(s.port, messages))
        out["health"] = health(servers[0].port).get("prompt_cache", {})
    finally:
        for s in servers:
            s.stop()
    return out


def parameters(path: Path) -> int:
    config = json.loads((path / "config.json").read_text())
    claim = mlx_loom.default_host().registry.model_types[config["model_type"]]
    return sum(math.prod(shape) for shape, _ in claim.checkpoint_tensors(config).values())


def report(name: str, params: int, runs: list[dict]) -> None:
    print(
        f"\n{name} ({params / 1e6:.1f}M parameters): {len(runs)} repeats; "
        "TTFT medians, ratio = mlx-lm / mlx-loom (range)"
    )
    print(
        f"{'turn':>4} {'':13} {'prompt':>6} {'reused loom':>11} {'reused mlx-lm':>13} "
        f"{'TTFT loom':>10} {'TTFT mlx-lm':>11} {'ratio':>17}"
    )
    for i, label in enumerate(LABELS):
        loom = [r["mlx-loom"][i] for r in runs]
        ref = [r["mlx-lm"][i] for r in runs]
        prompts = {p for _, p, _ in loom} | {p for _, p, _ in ref}
        prompt = "/".join(str(p) for p in sorted(prompts))  # one number unless they differ
        reused_loom = "/".join(str(c) for c in sorted({c for _, _, c in loom}))
        reused_ref = "/".join(str(c) for c in sorted({c for _, _, c in ref}))
        ratios = [b[0] / a[0] for a, b in zip(loom, ref, strict=True)]
        t_loom = statistics.median(s for s, _, _ in loom) * 1e3
        t_ref = statistics.median(s for s, _, _ in ref) * 1e3
        spread = f"{statistics.median(ratios):.1f} ({min(ratios):.1f}-{max(ratios):.1f})"
        print(
            f"{i + 1:>4} {label:13} {prompt:>6} {reused_loom:>11} {reused_ref:>13} "
            f"{t_loom:>8.0f}ms {t_ref:>9.0f}ms {spread:>17}"
        )
    info = runs[-1]["health"]
    print(
        f"mlx-loom's prompt cache at the end: {info.get('checkpoints')} checkpoints "
        f"({info.get('checkpoint_bytes', 0):,} bytes), {info.get('bytes', 0):,} bytes in all; "
        f"disk tier {info.get('disk_bytes', 0):,} bytes in {info.get('disk_files')} files"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--system", type=int, default=500, help="system prompt words")
    parser.add_argument("--repeats", type=int, default=3, help="sessions per family")
    parser.add_argument("--size", choices=["tiny", "medium"], default="tiny")
    parser.add_argument("--hidden", type=int, default=None, help="hidden size, over --size's")
    parser.add_argument("--layers", type=int, default=None, help="layers, over --size's")
    parser.add_argument("--families", nargs="*", default=list(FAMILIES), choices=list(FAMILIES))
    args = parser.parse_args()
    turns = conversation(args.system)
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        for family in args.families:
            model_type = FAMILIES[family]
            shape = MEDIUM[model_type] if args.size == "medium" else None
            path = build(tmp, model_type, args.hidden, args.layers, shape)
            runs = [run_repeat(path, turns, r, tmp / family) for r in range(args.repeats)]
            report(family, parameters(path), runs)


if __name__ == "__main__":
    main()
