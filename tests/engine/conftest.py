"""Tiny checkpoints of every family and cache kind, and a scripted driver for the engine.

Tests drive :class:`~mlx_loom.engine.Engine` directly, on the test thread, so
each step is under the test's control: requests join and leave at chosen
steps, and every row's tokens and log-probability vectors are recorded, to be
compared with the same request run alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

import mlx_loom
from mlx_loom.engine import Done, Engine, EngineSettings, TokenEvent, make_request
from mlx_loom.testing.checkpoints import write_checkpoint

#: name -> (model type, config overrides).
CHECKPOINTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama-sliding": (
        "llama",
        {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 6},
    ),
    "llama-hd32": ("llama", {"num_attention_heads": 2, "num_key_value_heads": 1}),
    "qwen3_next": ("qwen3_next", {}),
    "qwen3_5": ("qwen3_5", {}),
    "gemma4_text": ("gemma4_text", {}),
    "gemma4": ("gemma4", {}),
}


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> Callable[[str], Path]:
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            model_type, overrides = CHECKPOINTS[name]
            claim = mlx_loom.default_host().registry.model_types[model_type]
            cfg = {**claim.tiny_config, **overrides}
            path = tmp_path_factory.mktemp(name) / "ckpt"
            made[name] = write_checkpoint(path, cfg, claim.checkpoint_tensors(cfg))
        return made[name]

    return get


@pytest.fixture(scope="session")
def loaded(checkpoints) -> Callable[[str], tuple[Any, Any]]:
    models: dict[str, tuple[Any, Any]] = {}

    def get(name: str) -> tuple[Any, Any]:
        if name not in models:
            models[name] = mlx_loom.load(checkpoints(name))
        return models[name]

    return get


def ids(n: int, seed: int, vocab: int = 256) -> list[int]:
    """A deterministic prompt of ``n`` token ids (avoiding the test tokenizer's specials)."""
    return mx.random.randint(4, vocab, (n,), key=mx.random.key(seed)).tolist()


@dataclass
class Run:
    """What one request produced."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[mx.array] = field(default_factory=list)
    events: list[TokenEvent] = field(default_factory=list)
    done: Done | None = None

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events)


def request(model, tokenizer=None, prompt=None, **options):
    """A request that records its log-probability vectors (for exact comparisons)."""
    options.setdefault("logprobs_vector", True)
    return make_request(model, tokenizer, prompt, **options)


def drive(
    engine: Engine,
    schedule: dict[int, list[Any]],
    *,
    on_step: Callable[[int, list[Any]], None] | None = None,
    max_steps: int = 2000,
) -> dict[str, Run]:
    """Step ``engine``; at step ``k`` apply ``schedule[k]``: ``(name, request)`` inserts,
    ``("remove", name)`` removes. Returns each name's :class:`Run`."""
    uid_of: dict[str, int] = {}
    runs: dict[int, Run] = {}
    step = 0
    while step in schedule or engine.has_work or any(k > step for k in schedule):
        for action in schedule.get(step, []):
            if action[0] == "remove":
                for done in engine.remove([uid_of[action[1]]]):
                    runs[done.uid].done = done
            else:
                name, req = action
                (uid,) = engine.insert([req])
                uid_of[name] = uid
                runs[uid] = Run()
        events = engine.step() if engine.has_work else []
        for event in events:
            run = runs[event.uid]
            if isinstance(event, Done):
                run.done = event
            else:
                run.tokens.append(event.token)
                run.logprobs.append(event.logprobs)
                run.events.append(event)
        if on_step is not None:
            on_step(step, events)
        step += 1
        assert step < max_steps, "the engine did not finish"
    return {name: runs[uid] for name, uid in uid_of.items()}


def alone(model, req, settings: EngineSettings | None = None) -> Run:
    """``req`` run by itself on a fresh engine."""
    return drive(Engine(model, settings), {0: [("solo", req)]})["solo"]


def assert_same_run(batched: Run, solo: Run, label: str = "") -> None:
    assert batched.tokens == solo.tokens, label
    assert len(batched.logprobs) == len(solo.logprobs)
    for step, (a, b) in enumerate(zip(batched.logprobs, solo.logprobs, strict=True)):
        assert mx.array_equal(a, b).item(), f"{label}: log-probabilities differ at token {step}"
