"""What structured output costs: the grammar mask per decode step, and decode tokens/s.

Run by hand (not a test)::

    .venv/bin/python benchmarks/structured_bench.py             # bundled model + a 32k vocab
    .venv/bin/python benchmarks/structured_bench.py --vocab 0   # bundled model only

Measured, at batch 1 and 8:

* **mask cost per step**: a row's parser advanced by one token, its next-token
  mask computed (llguidance), and the masks applied to ``[B, V]`` logits
  (:func:`mlx_loom.engine.constraints.constrain_rows`, evaluated), along
  trajectories of random legal tokens through a JSON schema; for the bundled
  tokenizer (2048 tokens) and for a byte-level BPE trained here on synthetic
  text to ``--vocab`` tokens (no download: real model vocabularies are
  32k-256k);
* **decode tokens/s** of the bundled model on the engine, with and without a
  constraint (a regex that never completes, so every row runs its whole
  budget and both runs decode the same number of tokens).
"""

from __future__ import annotations

import argparse
import random
import statistics
import string
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

import mlx_loom
from mlx_loom.engine import Engine, make_request
from mlx_loom.engine import constraints
from mlx_loom.engine.constraints import (
    RowConstraint,
    compile_constraint,
    constrain_rows,
)
from mlx_loom.generation import SamplingParams
from mlx_loom.text import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "score": {"type": "number"},
        "nested": {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}, "note": {"type": "string"}},
            "required": ["ok", "note"],
        },
    },
    "required": ["id", "name", "tags", "score", "nested"],
}


def synthetic_tokenizer(vocab: int, directory: Path) -> Tokenizer:
    """A byte-level BPE of ``vocab`` tokens trained on random words (and some JSON)."""
    rng = random.Random(0)
    alphabet = string.ascii_letters + string.digits
    lines = []
    for _ in range(40000):
        words = ["".join(rng.choices(alphabet, k=rng.randint(2, 9))) for _ in range(12)]
        lines.append(" ".join(words) + ' {"a": [1, 2.5], "b": "c"}')
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(lines, trainer)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text('{"eos_token": "</s>", "bos_token": "<s>"}')
    return Tokenizer.from_dir(directory)


def mask_cost(tokenizer: Tokenizer, batch: int, steps: int, parallel: bool) -> tuple[float, float]:
    """Median and p90 milliseconds of one step's constrain_rows over ``batch`` rows
    (``parallel``: several rows' masks on llguidance's thread pool, else one by one)."""
    constraint = compile_constraint("json_schema", SCHEMA, tokenizer)
    eos = tokenizer.eos_token_ids
    rng = np.random.default_rng(0)
    V = tokenizer.vocab_size
    times = []
    rows = [RowConstraint(constraint, tokenizer, eos) for _ in range(batch)]
    fed: list[int | None] = [None] * batch
    logits = mx.zeros((batch, V))
    mx.eval(logits)
    saved = constraints._EXECUTOR
    if not parallel:
        constraints._EXECUTOR = _Serial()  # type: ignore[assignment]
    try:
        for _ in range(steps):
            failed: dict[int, BaseException] = {}
            start = time.perf_counter()
            masked = constrain_rows(rows, fed, logits, failed)
            mx.eval(masked)
            times.append(time.perf_counter() - start)
            assert not failed, failed
            allowed = np.asarray(mx.isfinite(masked))
            for j in range(batch):
                legal = np.nonzero(allowed[j])[0]
                legal = legal[[t not in eos for t in legal]] if len(legal) > 1 else legal
                fed[j] = int(rng.choice(legal))
                if fed[j] in eos:  # complete: start this row over
                    rows[j] = RowConstraint(constraint, tokenizer, eos)
                    fed[j] = None
    finally:
        constraints._EXECUTOR = saved
    times.sort()
    return statistics.median(times) * 1e3, times[int(len(times) * 0.9)] * 1e3


class _Serial:
    """Stands in for llguidance's executor: each row's mask in turn, on this thread."""

    def unsafe_compute_mask_ptr(self, pairs, ptr, one_mask_bytes, batch):  # noqa: ANN001
        for matcher, index in pairs:
            matcher.unsafe_compute_mask_ptr(ptr + index * one_mask_bytes, one_mask_bytes)


def decode_tps(model, tokenizer, batch: int, tokens: int, constrained: bool) -> float:
    """Tokens per second of ``batch`` rows decoding ``tokens`` each on one engine."""
    constraint = compile_constraint("regex", "[a-z ,.]{1000}", tokenizer) if constrained else None
    params = SamplingParams(temperature=1.0, seed=1)
    eos_ban = {t: -1e9 for t in tokenizer.eos_token_ids}  # the free rows run their budget too
    if not constrained:
        params = SamplingParams(temperature=1.0, seed=1, logit_bias=eos_ban)
    reqs = [
        make_request(model, tokenizer, f"Row {i} says", max_tokens=tokens, params=params,
                     constraint=constraint)
        for i in range(batch)
    ]
    engine = Engine(model)
    engine.insert(reqs)
    produced = 0
    start = time.perf_counter()
    while engine.has_work:
        produced += sum(1 for e in engine.step() if hasattr(e, "token"))
    return produced / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32768, help="synthetic vocab (0: skip)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    model, tok = mlx_loom.load(Path(mlx_loom.__file__).parent / "assets" / "tiny-minicpm5")
    tokenizers = {f"bundled ({tok.vocab_size})": tok}
    if args.vocab:
        with tempfile.TemporaryDirectory() as d:
            big = synthetic_tokenizer(args.vocab, Path(d))
        tokenizers[f"byte-level BPE ({big.vocab_size})"] = big
    print("mask cost per step (advance + mask + apply), ms: median / p90")
    for name, t in tokenizers.items():
        for batch in (1, 8):
            for parallel in (False, True) if batch > 1 else (False,):
                med, p90 = mask_cost(t, batch, args.steps, parallel)
                how = " parallel" if parallel else ""
                print(f"  {name:28s} batch {batch}{how:9s}: {med:6.3f} / {p90:6.3f}")
    print(f"decode tokens/s, bundled model, {args.tokens} tokens a row")
    for batch in (1, 8):
        decode_tps(model, tok, batch, 8, False)  # warm-up
        free = decode_tps(model, tok, batch, args.tokens, False)
        held = decode_tps(model, tok, batch, args.tokens, True)
        print(f"  batch {batch}: unconstrained {free:7.1f}   constrained {held:7.1f}")


if __name__ == "__main__":
    main()
