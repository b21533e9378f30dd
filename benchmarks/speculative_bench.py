"""Speculative decoding: tokens/s with and without it, acceptance, beside mlx-lm's.

Run by hand (not a test)::

    .venv/bin/python benchmarks/speculative_bench.py
    .venv/bin/python benchmarks/speculative_bench.py --families llama --gen-tokens 48

For each family (random-weight checkpoints from the plugins' manifests, as in
``bench.py``), greedy decoding of one prompt longer than every sliding window:

* ``plain`` — no speculation;
* ``self`` — the model as its own draft: every draft is accepted (the best
  case; the draft costs as much as the target);
* ``other`` — a draft of the same shape with other weights: drafts are
  almost never accepted (the worst case);
* ``ngram`` — prompt lookup on a prompt whose continuation repeats it;
* ``mtp`` — the checkpoint's own multi-token-prediction head (Qwen3-Next's
  checkpoint here ships one): random weights, so its drafts are almost never
  accepted — this row is the head's cost, the worst case;
* ``mtp-agree`` beside ``plain-bias`` — the best case: a head whose final
  gain is zero drafts token 0 every step, and a logit bias makes the target
  emit token 0 too, so every draft is accepted (both rows carry the bias).

mlx-loom runs through ``stream_generate`` (the engine); mlx-lm through its
``speculative_generate_step`` / ``generate_step``. Each speculative run's
tokens are compared with the same engine's plain greedy tokens: ``exact``
says whether they are equal (mlx-lm's are not for Gemma 4 past its window;
it refuses Qwen3-Next). Decode tokens/s is timed from the first token to the
last, the best of ``--repeats`` runs (the machine is shared: the best run is
the least disturbed); acceptance is accepted drafts / proposed drafts.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import cast

import mlx.core as mx

import mlx_loom
from mlx_loom.testing.checkpoints import write_checkpoint

CACHE_DIR = Path(__file__).resolve().parent / ".checkpoints"


def llama_config() -> dict:
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 768,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "intermediate_size": 2048,
        "vocab_size": 8192,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }


def family_config(family: str) -> dict:
    if family == "llama":
        return llama_config()
    claim = mlx_loom.default_host().registry.model_types[family]
    config = dict(claim.tiny_config)
    if family == "qwen3_next":
        config.update(hidden_size=512, num_hidden_layers=8, vocab_size=8192)
    else:
        config.update(vocab_size=8192)
    return config


#: Families whose benchmark checkpoint ships a multi-token-prediction head.
MTP_FAMILIES = {"qwen3_next": "num_nextn_predict_layers"}


def build(family: str, seed: int, *, agree: bool = False) -> Path:
    """The family's random checkpoint; ``agree``: its MTP head always drafts token 0."""
    mtp = family in MTP_FAMILIES
    path = CACHE_DIR / f"spec-{family}{'-mtp' if mtp else ''}{'-agree' if agree else ''}-{seed}"
    if (path / "config.json").exists():
        return path
    claim = mlx_loom.default_host().registry.model_types[family]
    config = family_config(family)
    if mtp:
        config[MTP_FAMILIES[family]] = 1
    tensors = {
        name: (shape, "F32" if dtype in ("F32", "BF16", "F16") else dtype)
        for name, (shape, dtype) in claim.checkpoint_tensors(config).items()
    }
    write_checkpoint(path, config, tensors, seed=seed)
    if agree:  # the head's final gain is stored zero-centred: -1 makes it 0
        weights = path / "model.safetensors"
        stored = cast("dict[str, mx.array]", mx.load(str(weights)))
        stored["mtp.norm.weight"] = mx.full(stored["mtp.norm.weight"].shape, -1.0)
        mx.save_safetensors(str(weights), stored, metadata={"format": "mlx"})
    return path


def timed(tokens) -> tuple[list[int], float]:
    out, first = [], None
    for t in tokens:
        out.append(int(t))
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    return out, (len(out) - 1) / max(end - (first or end), 1e-9)


def loom_run(model, prompt, gen, drafter, k, **extra):
    options = dict(extra) if drafter is None else {"num_draft_tokens": k, **extra}
    if isinstance(drafter, str):
        options["draft"] = drafter
    elif drafter is not None:
        options["draft_model"] = drafter
    before = model.engine.stats().engine
    stream = mlx_loom.stream_generate(model, None, prompt, max_tokens=gen, **options)
    tokens, tps = timed(r.token for r in stream)
    after = model.engine.stats().engine
    proposed = after.draft_tokens - before.draft_tokens
    accepted = after.accepted_drafts - before.accepted_drafts
    return tokens, tps, (accepted / proposed if proposed else None)


def mlx_lm_run(model, prompt, gen, draft, k):
    from mlx_lm.generate import generate_step, speculative_generate_step

    if draft is None:
        steps = generate_step(mx.array(prompt), model, max_tokens=gen)
        tokens, tps = timed(t for t, _ in steps)
        return tokens, tps, None
    steps = speculative_generate_step(
        mx.array(prompt), model, draft, num_draft_tokens=k, max_tokens=gen
    )
    drafted = []
    tokens, tps = timed(_note(steps, drafted))
    return tokens, tps, sum(drafted) / max(len(drafted), 1)


def _note(steps, drafted):
    for token, _, from_draft in steps:
        drafted.append(bool(from_draft))
        yield token


def best(run, args, repeats):
    """The run with the highest tokens/s of ``repeats`` (same tokens every time: greedy)."""
    results = [run(*args) for _ in range(repeats)]
    return max(results, key=lambda r: r[1])


def row(engine, family, case, tokens, tps, plain, acceptance, note=""):
    exact = "-" if case == "plain" else ("yes" if tokens == plain[: len(tokens)] else "NO")
    acc = "-" if acceptance is None else f"{acceptance:.2f}"
    return f"| {family} | {engine} | {case} | {tps:.1f} | {acc} | {exact} | {note} |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="llama,qwen3_next,gemma4_text")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--gen-tokens", type=int, default=32)
    parser.add_argument("--num-draft", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-mlx-lm", action="store_true")
    args = parser.parse_args(argv)
    k, gen, reps = args.num_draft, args.gen_tokens, args.repeats
    print("| family | engine | draft | decode tok/s | acceptance | greedy-exact | note |")
    print("|---|---|---|---|---|---|---|")
    for family in args.families.split(","):
        target_path, other_path = build(family, 0), build(family, 7)
        model, _ = mlx_loom.load(target_path)
        other, _ = mlx_loom.load(other_path)
        half = [(i * 7919 + 13) % 8000 + 5 for i in range(args.prompt_tokens // 2)]
        prompt = half * 2  # longer than every window; repeats for prompt lookup
        loom_run(model, prompt, 4, None, k)  # warm up
        plain, tps, _ = best(loom_run, (model, prompt, gen, None, k), reps)
        print(row("mlx-loom", family, "plain", plain, tps, plain, None), flush=True)
        cases = [("self", model), ("other", other), ("ngram", "ngram")]
        if model.mtp_refusal() is None:
            cases.append(("mtp", "mtp"))
        for case, drafter in cases:
            tokens, tps, acc = best(loom_run, (model, prompt, gen, drafter, k), reps)
            print(row("mlx-loom", family, case, tokens, tps, plain, acc), flush=True)
        if model.mtp_refusal() is None:
            agree, _ = mlx_loom.load(build(family, 0, agree=True))
            bias = {"logit_bias": {0: 100.0}}
            base = best(lambda *a: loom_run(*a, **bias), (agree, prompt, gen, None, k), reps)
            print(row("mlx-loom", family, "plain-bias", base[0], base[1], base[0], None))
            tokens, tps, acc = best(
                lambda *a: loom_run(*a, **bias), (agree, prompt, gen, "mtp", k), reps
            )
            print(row("mlx-loom", family, "mtp-agree", tokens, tps, base[0], acc), flush=True)
            agree.close_engine()
        if args.skip_mlx_lm:
            continue
        from mlx_lm.utils import load_model

        lm, _ = load_model(target_path)
        lm_other, _ = load_model(other_path)
        lm_plain, tps, _ = best(mlx_lm_run, (lm, prompt, gen, None, k), reps)
        print(row("mlx-lm", family, "plain", lm_plain, tps, lm_plain, None), flush=True)
        for case, draft in (("self", lm), ("other", lm_other)):
            try:
                tokens, tps, acc = best(mlx_lm_run, (lm, prompt, gen, draft, k), reps)
            except Exception as err:  # mlx-lm refuses some caches
                msg = str(err).splitlines()[0][:60]
                print(f"| {family} | mlx-lm | {case} | - | - | - | refused: {msg} |", flush=True)
                continue
            print(row("mlx-lm", family, case, tokens, tps, lm_plain, acc), flush=True)
        print(f"| {family} | mlx-lm | ngram | - | - | - | no prompt-lookup drafting |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
