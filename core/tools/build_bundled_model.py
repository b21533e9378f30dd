"""Build the tiny MiniCPM5-architecture model bundled with mlx-loom.

One command rebuilds everything, end to end, from a fixed seed:

    pip install mlx-lm==0.32.2          # dev-only; the engine never imports it
    python core/tools/build_bundled_model.py

Steps: generate a procedural story corpus (`corpus.py`, written for this
project, MIT), train a byte-level BPE tokenizer on it with `tokenizers`,
train a Llama-layout transformer (MiniCPM5 is published as a
`LlamaForCausalLM` checkpoint) with mlx-lm's llama graph and
`mlx.optimizers`, then export a Hugging Face style directory:
config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
generation_config.json and a model card (README.md).

Why mlx-lm here: it is the project's numerical oracle for this
architecture, so a checkpoint trained with its graph is by construction one
that the oracle reads; this is a dev-time tool, never part of the engine.

Speed: the Linux `mlx[cpu]` wheel links reference BLAS. Preloading OpenBLAS
makes fp32 GEMM many times faster, which is what makes CPU training in a few
minutes possible:

    apt-get install -y libopenblas0-pthread
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 python core/tools/build_bundled_model.py
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import jinja2
import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

sys.path.insert(0, str(Path(__file__).resolve().parent))
import corpus  # noqa: E402  (sibling module, not an installed package)

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO_ROOT / "core" / "src" / "mlx_loom" / "assets" / "tiny-minicpm5"

BOS, EOS, UNK = "<s>", "</s>", "<unk>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [UNK, BOS, EOS, IM_START, IM_END]  # ids 0..4, in this order

# ChatML turns, BOS first. The template emits BOS itself because chat
# templates are tokenized without adding special tokens.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# --------------------------------------------------------------------------- corpus
def build_samples(n_stories: int, n_chats: int, seed: int) -> tuple[list[str], list[list[dict]]]:
    """Plain stories and chat conversations, deterministic for `seed`."""
    return corpus.generate_stories(n_stories, seed=seed), corpus.generate_chats(
        n_chats, seed=seed + 1
    )


def render_chat(messages: list[dict], add_generation_prompt: bool) -> str:
    """Render messages with the same template the exported tokenizer_config carries."""
    template = jinja2.Environment().from_string(CHAT_TEMPLATE)
    return template.render(
        messages=messages, bos_token=BOS, add_generation_prompt=add_generation_prompt
    )


# --------------------------------------------------------------------------- tokenizer
def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE (GPT-2 style): any UTF-8 text round-trips, no unknown bytes."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # Plain `encode(text)` prepends BOS, like a Llama tokenizer with add_bos_token.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def token_stream(
    tok: Tokenizer, stories: list[str], chats: list[list[dict]], seed: int
) -> np.ndarray:
    """One shuffled stream of samples, each `<s> ... </s>`.

    Every sample ends with EOS so generation stops by itself at the end of a
    story; chat samples end the assistant turn with `<|im_end|>` and then EOS,
    so an engine stopping on either id ends cleanly.
    """
    bos, eos, im_end = (tok.token_to_id(t) for t in (BOS, EOS, IM_END))
    samples: list[list[int]] = []
    for enc in tok.encode_batch(stories, add_special_tokens=False):
        samples.append([bos, *enc.ids, eos])
    prompts = [render_chat(c[:-1], add_generation_prompt=True) for c in chats]
    answers = [c[-1]["content"] for c in chats]
    for p, a in zip(
        tok.encode_batch(prompts, add_special_tokens=False),
        tok.encode_batch(answers, add_special_tokens=False),
        strict=True,
    ):
        samples.append([*p.ids, *a.ids, im_end, eos])  # prompt already starts with BOS
    random.Random(seed).shuffle(samples)
    return np.fromiter((t for s in samples for t in s), dtype=np.int32)


# --------------------------------------------------------------------------- model
def model_config(args: argparse.Namespace, vocab_size: int, tok: Tokenizer) -> dict:
    """The Hugging Face config.json of a MiniCPM5 (Llama-architecture) checkpoint."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.hidden // args.heads,
        "hidden_act": "silu",
        "max_position_embeddings": args.context,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": vocab_size,
        "bos_token_id": tok.token_to_id(BOS),
        "eos_token_id": tok.token_to_id(EOS),
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "float32",
    }


def make_model(cfg: dict):
    from mlx_lm.models import llama  # dev-only dependency, see module docstring

    return llama.Model(llama.ModelArgs.from_dict(cfg))


def batches(stream: np.ndarray, batch: int, context: int, seed: int):
    """Endless (inputs, targets) batches of packed `context`-token windows.

    Windows are consecutive, non-overlapping slices of the shuffled stream; a
    new epoch reshuffles their order. Packing wastes no compute on padding;
    the BOS at each sample start teaches the model where a story begins.
    """
    n = (len(stream) - 1) // context
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(n)
        for i in range(0, n - batch + 1, batch):
            starts = order[i : i + batch] * context
            x = np.stack([stream[s : s + context] for s in starts])
            y = np.stack([stream[s + 1 : s + context + 1] for s in starts])
            yield mx.array(x), mx.array(y)


def train(model, stream: np.ndarray, args: argparse.Namespace) -> dict:
    """AdamW with warmup + cosine decay and gradient clipping; returns loss history."""
    warmup = max(1, args.steps // 20)
    schedule = optim.join_schedules(
        [
            optim.linear_schedule(args.lr / 100, args.lr, warmup),
            optim.cosine_decay(args.lr, args.steps - warmup, end=args.lr / 10),
        ],
        [warmup],
    )
    opt = optim.AdamW(learning_rate=schedule, betas=[0.9, 0.95], weight_decay=0.05)

    def loss_fn(m, x, y):
        return nn.losses.cross_entropy(m(x), y, reduction="mean")

    value_and_grad = nn.value_and_grad(model, loss_fn)
    state = [model.state, opt.state]

    def step(x, y):
        loss, grads = value_and_grad(model, x, y)
        grads, _ = optim.clip_grad_norm(grads, max_norm=1.0)
        opt.update(model, grads)
        return loss

    step = mx.compile(step, inputs=state, outputs=state)

    losses: list[float] = []
    data = batches(stream, args.batch, args.context, args.seed)
    t0 = time.perf_counter()
    for i in range(1, args.steps + 1):
        x, y = next(data)
        loss = step(x, y)
        mx.eval(state, loss)
        losses.append(loss.item())
        if i % args.log_every == 0 or i == args.steps:
            dt = time.perf_counter() - t0
            tok_s = i * args.batch * args.context / dt
            recent = sum(losses[-args.log_every :]) / len(losses[-args.log_every :])
            print(
                f"step {i:4d}/{args.steps}  loss {recent:.3f}  {tok_s:.0f} tok/s  {dt:.0f} s",
                flush=True,
            )
    return {"losses": losses, "seconds": time.perf_counter() - t0}


def eval_loss(model, stream: np.ndarray, context: int, n_windows: int = 16) -> float:
    """Mean next-token loss on held-out windows (a separately seeded corpus)."""
    total = 0.0
    for k in range(n_windows):
        s = k * context
        x = mx.array(stream[None, s : s + context])
        y = mx.array(stream[None, s + 1 : s + context + 1])
        total += nn.losses.cross_entropy(model(x), y, reduction="mean").item()
    return total / n_windows


# --------------------------------------------------------------------------- export
def export(model, tok: Tokenizer, cfg: dict, out: Path, context: int) -> None:
    """Write the Hugging Face layout directory (weights, config, tokenizer files)."""
    out.mkdir(parents=True, exist_ok=True)
    # mlx-lm's llama parameter names are exactly the HF names
    # (model.layers.N.self_attn.q_proj.weight, lm_head.weight, ...), and its
    # RoPE (rope_traditional=False) is HF's rotate-half, so no permutation.
    weights = {k: v.astype(mx.float32) for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    tok.save(str(out / "tokenizer.json"))

    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "add_bos_token": True,
        "add_eos_token": False,
        "additional_special_tokens": [IM_START, IM_END],
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": context,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    gen_cfg = {
        "bos_token_id": tok.token_to_id(BOS),
        # Stop on EOS and on the end of a chat turn.
        "eos_token_id": [tok.token_to_id(EOS), tok.token_to_id(IM_END)],
        "do_sample": True,
        "temperature": 0.7,
        "top_p": 0.9,
    }
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")


def model_card(
    cfg: dict,
    n_params: int,
    stats: dict,
    args: argparse.Namespace,
    corpus_stats: dict,
    samples: list[tuple[str, str]],
) -> str:
    """The README.md written next to the weights; numbers are this run's."""
    sample_md = "\n\n".join(
        f"Prompt `{p}`:\n\n" + "\n".join(f"> {line}".rstrip() for line in t.strip().split("\n"))
        for p, t in samples
    )
    return f"""# tiny-minicpm5

A tiny model bundled with mlx-loom so that the first command of the README
generates text with nothing to download. It is a **MiniCPM5-architecture**
checkpoint: MiniCPM5 is published as a Llama-architecture checkpoint, and this
one has the same layout (`"model_type": "llama"`, `LlamaForCausalLM`).
It writes simple English children's stories; it knows nothing else.

## Architecture

| field | value |
|---|---|
| layers | {cfg["num_hidden_layers"]} |
| hidden size | {cfg["hidden_size"]} |
| attention heads / KV heads (GQA) | {cfg["num_attention_heads"]} / {cfg["num_key_value_heads"]} |
| head dim | {cfg["head_dim"]} |
| MLP | SwiGLU, intermediate {cfg["intermediate_size"]} |
| norm | RMSNorm, eps {cfg["rms_norm_eps"]} |
| positions | RoPE, theta {cfg["rope_theta"]:g}, context {cfg["max_position_embeddings"]} |
| vocab | {cfg["vocab_size"]} (byte-level BPE) |
| embeddings | untied (`tie_word_embeddings: false`) |
| parameters | {n_params:,} ({n_params / 1e6:.2f} M) |
| dtype | float32 |

Weights use Hugging Face names (`model.embed_tokens.weight`,
`model.layers.N.self_attn.{{q,k,v,o}}_proj.weight`,
`model.layers.N.mlp.{{gate,up,down}}_proj.weight`,
`model.layers.N.{{input,post_attention}}_layernorm.weight`, `model.norm.weight`,
`lm_head.weight`).

Tokenizer: `tokenizer.json` trained with the `tokenizers` library (byte-level
BPE). Special tokens: `<unk>`=0, `<s>`=1 (BOS, prepended by `encode`),
`</s>`=2 (EOS), `<|im_start|>`=3, `<|im_end|>`=4. The chat template is ChatML
(`<|im_start|>role\\n...<|im_end|>\\n`), starting with `<s>`.
Every training sample ends with `</s>` (chat samples with `<|im_end|></s>`), so
generation stops by itself at the end of a story; `generation_config.json`
lists both `</s>` and `<|im_end|>` as stop tokens.

## Training data and licence

{corpus_stats["stories"]:,} stories and {corpus_stats["chats"]:,} chat conversations
({corpus_stats["mb"]:.1f} MB, {corpus_stats["tokens"]:,} tokens,
{corpus_stats["words"]:,} distinct words),
all generated by `core/tools/corpus.py`, a procedural story generator written
for this project (ten plot shapes, dialogue, hundreds of names, animals, objects,
places, adjectives and verb phrases). No third-party text is used: the corpus,
the tokenizer and the weights are covered by the project's MIT licence.

## Training

mlx-lm 0.32.2's llama graph and `mlx.optimizers` on the CPU (2 shared cores),
fp32, OpenBLAS preloaded for fast fp32 matmul (`LD_PRELOAD` of
`libopenblas.so.0`; it only changes speed). AdamW (betas 0.9/0.95, weight decay
0.05), peak learning rate {args.lr:g} with linear warmup and cosine decay to a tenth,
gradient clipping at 1.0, {args.steps} steps of {args.batch} × {args.context} packed
tokens ({args.steps * args.batch * args.context:,} tokens seen), seed {args.seed}.

- training time: {stats["seconds"] / 60:.1f} min
- final training loss (mean of the last {min(args.log_every, args.steps)} steps): \
{stats["final_loss"]:.3f}
- held-out loss (differently seeded corpus): {stats["eval_loss"]:.3f}

## Rebuild

```bash
pip install mlx-lm==0.32.2        # dev-only; the engine never imports mlx-lm
apt-get install -y libopenblas0-pthread   # optional, Linux: much faster fp32 matmul
LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 \\
    python core/tools/build_bundled_model.py
```

The same seed gives the same corpus, tokenizer, initialisation and batch
order; weights can differ in the last bits between BLAS libraries and thread
counts.

## Samples (mlx-lm, temperature 0.7, top-p 0.9, seed 0)

{sample_md}
"""


def sample_texts(out: Path, prompts: list[str], max_tokens: int = 200) -> list[tuple[str, str]]:
    """Load the exported directory with mlx-lm and generate: the artifact check.

    The text is decoded from prompt + generated ids in one go: mlx-lm's
    streaming BPE detokenizer drops the leading space of the first generated
    token ("The little cat" + " was" would print "The little catwas").
    """
    from mlx_lm import load, stream_generate
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = load(str(out))
    results = []
    for p in prompts:
        mx.random.seed(0)
        prompt_ids = tokenizer.encode(p)
        sampler = make_sampler(temp=0.7, top_p=0.9)
        gen = stream_generate(model, tokenizer, prompt_ids, max_tokens=max_tokens, sampler=sampler)
        ids = prompt_ids + [r.token for r in gen]
        results.append((p, tokenizer.decode(ids, skip_special_tokens=True)))
    return results


# --------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stories", type=int, default=10000)
    ap.add_argument("--chats", type=int, default=4000)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=192)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=420)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--log-every", type=int, default=10)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    t_start = time.perf_counter()
    random.seed(args.seed)
    np.random.seed(args.seed)
    mx.random.seed(args.seed)

    stories, chats = build_samples(args.stories, args.chats, args.seed)
    chat_texts = [render_chat(c, add_generation_prompt=False) for c in chats]
    tok = train_tokenizer(stories + chat_texts, args.vocab)
    vocab_size = tok.get_vocab_size()
    stream = token_stream(tok, stories, chats, args.seed)
    words = {w for s in stories for w in s.replace("\n", " ").split()}
    corpus_stats = {
        "stories": len(stories),
        "chats": len(chats),
        "mb": (sum(map(len, stories)) + sum(map(len, chat_texts))) / 1e6,
        "tokens": int(len(stream)),
        "words": len({w.strip('.,!?"').lower() for w in words}),
    }
    print(f"corpus: {corpus_stats}; vocab {vocab_size}", flush=True)

    # Held-out text: a corpus from a different seed, never trained on.
    held_stories, held_chats = build_samples(200, 40, args.seed + 1000)
    held = token_stream(tok, held_stories, held_chats, args.seed + 1000)

    cfg = model_config(args, vocab_size, tok)
    model = make_model(cfg)
    mx.eval(model.parameters())
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    print(f"model: {n_params:,} parameters", flush=True)

    stats = train(model, stream, args)
    stats["final_loss"] = sum(stats["losses"][-args.log_every :]) / len(
        stats["losses"][-args.log_every :]
    )
    stats["eval_loss"] = eval_loss(
        model, held, args.context, n_windows=min(16, (len(held) - 1) // args.context)
    )

    export(model, tok, cfg, args.out, args.context)
    samples = sample_texts(args.out, ["Once upon a time", "The little cat", "One day, Tom"])
    (args.out / "README.md").write_text(
        model_card(cfg, n_params, stats, args, corpus_stats, samples)
    )

    for p, t in samples:
        print(f"\n--- {p!r}\n{t}")
    size = sum(f.stat().st_size for f in args.out.iterdir()) / 1e6
    print(f"\nwrote {args.out} ({size:.1f} MB) in {(time.perf_counter() - t_start) / 60:.1f} min")
    print(
        f"final loss {stats['final_loss']:.4f}  held-out loss {stats['eval_loss']:.4f}  "
        f"training {stats['seconds'] / 60:.1f} min"
    )


if __name__ == "__main__":
    main()
