"""Prefix reuse in an agent-like session: prefill tokens and time to first token per turn.

Run by hand (not a test)::

    .venv/bin/python benchmarks/prefix_checkpoints.py                  # tiny checkpoints
    .venv/bin/python benchmarks/prefix_checkpoints.py --hidden 1024 --layers 16 --system 2000

A session of 8 turns on one conversation, rendered by the model's chat
template: a long system prompt, then a user message and the model's reply
per turn; turn 4 regenerates turn 3, turn 6 edits its user message, and the
engine restarts (memory emptied, the disk tier kept) before turn 5. Each
family (a Llama, Qwen3-Next, Gemma 4 with a window smaller than the prompt)
runs the session twice on the engine: with no prompt cache, and with the
prefix store's checkpoints and its disk tier. Printed per turn: prompt
tokens, tokens prefilled, time to first token; and whether every turn's
tokens equal the no-cache run's, and the checkpoints' bytes.
``prefix_vs_mlx_lm.py`` runs the same session through ``loom serve`` beside
``mlx_lm.server``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx_loom
from mlx_loom.engine import Engine, EngineSettings, TokenEvent, make_request
from mlx_loom.testing.checkpoints import write_checkpoint

FAMILIES = {"llama": "llama", "qwen3_next": "qwen3_next", "gemma4": "gemma4_text"}


def build(
    root: Path,
    model_type: str,
    hidden: int | None,
    layers: int | None,
    shape: dict[str, Any] | None = None,
) -> Path:
    """The family's tiny config, with ``shape``'s keys replaced, then ``hidden`` and ``layers``."""
    claim = mlx_loom.default_host().registry.model_types[model_type]
    cfg = {**claim.tiny_config, "max_position_embeddings": 32768, **(shape or {})}
    if hidden is not None:
        cfg["hidden_size"] = hidden
    if layers is not None:
        cfg["num_hidden_layers"] = layers
        if "layer_types" in cfg:
            kinds = cfg["layer_types"]
            cfg["layer_types"] = [kinds[i % len(kinds)] for i in range(layers)]
    return write_checkpoint(root / model_type, cfg, claim.checkpoint_tensors(cfg))


def session(system_words: int) -> list[tuple[str, list[dict[str, str]]]]:
    """(label, messages) per turn; replies are filled in as the session runs."""
    system = " ".join(f"rule{i % 97} applies" for i in range(system_words // 2))
    asks = [f"step {i}: call the tool with argument {i * 7}" for i in range(8)]
    turns = [("ask", [{"role": "user", "content": a}]) for a in asks]
    return [("system", [{"role": "system", "content": system}]), *turns]


def first_token(engine: Engine, request: Any) -> tuple[TokenEvent, list[int], float]:
    start = time.perf_counter()
    (uid,) = engine.insert([request])
    first: TokenEvent | None = None
    ttft = 0.0
    tokens: list[int] = []
    while engine.has_work:
        for event in engine.step():
            if isinstance(event, TokenEvent) and event.uid == uid:
                if first is None:
                    first, ttft = event, time.perf_counter() - start
                tokens.append(event.token)
    assert first is not None
    return first, tokens, ttft


def run_session(
    model: Any, tok: Any, settings: EngineSettings, system_words: int
) -> list[dict[str, Any]]:
    engine = Engine(model, settings)
    script = session(system_words)
    messages = list(script[0][1])
    rows = []
    for turn in range(1, 9):
        label = "follow-up"
        if turn == 5 and settings.prompt_cache_dir is not None:
            engine.flush()
            engine = Engine(model, settings)  # a restarted server
            label = "after restart"
        if turn == 4:  # regenerate turn 3: the same messages again
            messages = messages[:-1]
            label = "regenerate"
        elif turn == 6:  # edit the last user message
            messages = messages[:-1]
            messages[-1] = {"role": "user", "content": messages[-1]["content"] + " (edited)"}
            label = "edit"
        else:
            messages.append(script[turn][1][0])
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
        request = make_request(model, tok, prompt, max_tokens=8)
        event, tokens, ttft = first_token(engine, request)
        reply = tok.decode(tokens)
        messages.append({"role": "assistant", "content": reply})
        rows.append(
            dict(
                turn=turn,
                label=label,
                prompt=event.prompt_tokens,
                prefilled=event.prompt_tokens - event.cached_tokens,
                ttft_ms=ttft * 1e3,
                tokens=tokens,
            )
        )
    stats = engine.stats()
    rows.append(
        dict(
            checkpoint_bytes=stats.prefix_checkpoint_bytes,
            checkpoints=stats.prefix_checkpoints,
            disk_bytes=stats.prefix_disk_bytes,
        )
    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--system", type=int, default=500, help="system prompt words")
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--families", nargs="*", default=list(FAMILIES))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name in args.families:
            model, tok = mlx_loom.load(build(root, FAMILIES[name], args.hidden, args.layers))
            cold = run_session(model, tok, EngineSettings(prompt_cache_size=0), args.system)
            directory = str(root / f"{name}-cache")
            warm_settings = EngineSettings(prompt_cache_size=10, prompt_cache_dir=directory)
            warm = run_session(model, tok, warm_settings, args.system)
            print(f"\n{name}  (no cache -> checkpoints + disk tier)")
            print(f"{'turn':>4} {'':14} {'prompt':>6} {'prefilled':>17} {'TTFT ms':>17} same")
            for a, b in zip(cold[:-1], warm[:-1], strict=True):
                same = "yes" if a["tokens"] == b["tokens"] else "NO"
                print(
                    f"{a['turn']:>4} {b['label']:14} {a['prompt']:>6} "
                    f"{a['prefilled']:>7} -> {b['prefilled']:>6} "
                    f"{a['ttft_ms']:>7.1f} -> {b['ttft_ms']:>6.1f} {same}"
                )
            info = warm[-1]
            print(
                f"checkpoints in memory at the end: {info['checkpoints']} "
                f"({info['checkpoint_bytes']:,} bytes); on disk: {info['disk_bytes']:,} bytes"
            )


if __name__ == "__main__":
    main()
