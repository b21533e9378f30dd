"""llama.cpp's side of the CPU benchmark; runs in the venv set up by ``setup_llama_cpp.sh``.

Two commands, each printing one JSON object on stdout:

``convert HF_DIR OUT.gguf --outtype bf16|q4_0``
    The Hugging Face checkpoint to GGUF with llama.cpp's own converter, then
    (for ``q4_0``) quantized with llama.cpp's quantizer. The benchmark's
    random-weight checkpoints carry a test vocabulary whose pre-tokenizer
    llama.cpp does not know; it is written as the default pre-tokenizer,
    which changes no speed (the benchmark feeds token ids).
``run MODEL.gguf --prompt IDS --gen N --threads T --repeats R``
    Prefill the prompt ids, then greedy-decode N tokens, R times (after a
    warm-up); reports each run's prefill and decode tokens per second and
    the process's peak resident memory.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path


def convert(args: argparse.Namespace) -> dict:
    source = Path(sys.prefix, "llama_cpp_source").read_text().strip()
    sys.path.insert(0, source)
    import conversion.base as base  # llama.cpp's converter package

    known = base.TextModel.get_vocab_base_pre

    def tolerant(self, tokenizer):
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            return "default"

    base.TextModel.get_vocab_base_pre = tolerant
    _tolerate_byte_level_vocab()
    import convert_hf_to_gguf

    out = Path(args.out)
    bf16 = out if args.outtype == "bf16" else out.with_suffix(".bf16.gguf")
    with tempfile.TemporaryDirectory() as scratch:
        hf_dir = _with_full_vocabulary(Path(args.hf_dir), Path(scratch))
        sys.argv = ["convert_hf_to_gguf.py", str(hf_dir), "--outfile", str(bf16), "--outtype", "bf16"]
        if _needs_no_mtp(hf_dir, convert_hf_to_gguf):
            sys.argv.append("--no-mtp")
        convert_hf_to_gguf.main()
    if args.outtype == "q4_0":
        import llama_cpp

        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
        params.nthread = 2
        rc = llama_cpp.llama_model_quantize(str(bf16).encode(), str(out).encode(), params)
        if rc != 0:
            raise SystemExit(f"llama_model_quantize failed with {rc}")
        bf16.unlink()
    return {"gguf": str(out), "bytes": out.stat().st_size}


def _with_full_vocabulary(hf_dir: Path, scratch: Path) -> Path:
    """``hf_dir``, or a copy of it in ``scratch`` whose tokenizer names every
    embedding row. The benchmark's test vocabulary is smaller than the
    config's vocabulary size, and Gemma's converter cuts the embedding to the
    tokenizer's length; padding the vocabulary with unused names keeps the
    model's shape (the weights are linked, not copied)."""
    config = json.loads((hf_dir / "config.json").read_text())
    tokenizer = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    size = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    if not size or len(vocab) >= size:
        return hf_dir
    for item in hf_dir.iterdir():
        (scratch / item.name).symlink_to(item.resolve())
    taken = set(vocab.values()) | {t["id"] for t in tokenizer.get("added_tokens", [])}
    for i in range(size):
        if i not in taken:
            vocab[f"<unused{i}>"] = i
    (scratch / "tokenizer.json").unlink()
    (scratch / "tokenizer.json").write_text(json.dumps(tokenizer))
    return scratch


def _tolerate_byte_level_vocab() -> None:
    """Gemma 4's converter reads the vocabulary as a SentencePiece-style BPE
    (byte fallback); the benchmark's test vocabulary is byte-level BPE, which
    it refuses. Where it refuses, the tokens are written in id order with
    zero scores, which is all a benchmark fed token ids needs."""
    import gguf

    strict = gguf.LlamaHfVocab

    class Tolerant:
        def __init__(self, base_path: Path) -> None:
            self.strict = None
            try:
                self.strict = strict(base_path)
            except FileNotFoundError:
                vocab = json.loads((base_path / "tokenizer.json").read_text())["model"]["vocab"]
                self.tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
                self.vocab_size = len(self.tokens)
            else:
                self.vocab_size = self.strict.vocab_size

        def all_tokens(self):
            if self.strict is not None:
                yield from self.strict.all_tokens()
                return
            for text in self.tokens:
                yield text.encode(), 0.0, gguf.TokenType.NORMAL

    gguf.LlamaHfVocab = Tolerant


def _needs_no_mtp(hf_dir: Path, converter) -> bool:
    """Whether to tell the converter the checkpoint has no multi-token-prediction
    layers: its Qwen3-Next class otherwise assumes they are there (and fails
    on an assertion), but only classes that can export them take the flag."""
    config = json.loads((hf_dir / "config.json").read_text())
    if config.get("mtp_num_hidden_layers") or config.get("num_nextn_predict_layers"):
        return False
    names: list[str] = []
    for shard in hf_dir.glob("*.safetensors"):
        from safetensors import safe_open

        with safe_open(str(shard), "np") as f:
            names.extend(f.keys())
    if any(n.startswith("mtp.") or ".mtp." in n for n in names):
        return False
    architecture = converter.get_model_architecture(config, converter.ModelType.TEXT)
    return bool(getattr(converter.get_model_class(architecture), "supports_mtp_export", False))


def run(args: argparse.Namespace) -> dict:
    import numpy as np
    from llama_cpp import Llama

    prompt = [int(t) for t in args.prompt.split(",")]
    llm = Llama(
        model_path=args.model,
        n_ctx=len(prompt) + args.gen + 8,
        n_batch=max(len(prompt), 8),
        n_threads=args.threads,
        n_threads_batch=args.threads,
        verbose=False,
        logits_all=False,
    )

    import llama_cpp

    vocab = llm.n_vocab()

    def last_argmax() -> int:
        # The last position's logits straight from the context: the wrapper's
        # ``eval_logits`` copies every stored row into Python lists on each call
        # (tens of milliseconds a token, which this benchmark once measured as
        # llama.cpp's speed), and without logits_all it stores none.
        logits = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(logits, shape=(vocab,))))

    def once(prompt_ids, gen):
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt_ids)
        token = last_argmax()
        first = time.perf_counter()
        for _ in range(gen - 1):
            llm.eval([token])
            token = last_argmax()
        end = time.perf_counter()
        return len(prompt_ids) / (first - start), (gen - 1) / (end - first)

    once(prompt[:8], 3)  # warm-up
    runs = [once(prompt, args.gen) for _ in range(args.repeats)]
    return {"runs": runs, "peak_gb": _peak_rss_gb()}


def _peak_rss_gb() -> float:
    """This process's peak resident memory (VmHWM). Not ``ru_maxrss``: on Linux
    that keeps the high-water mark of the process that forked it, so a run
    started from a benchmark holding several models reported their memory."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("convert")
    c.add_argument("hf_dir")
    c.add_argument("out")
    c.add_argument("--outtype", choices=["bf16", "q4_0"], required=True)
    r = sub.add_parser("run")
    r.add_argument("model")
    r.add_argument("--prompt", required=True)
    r.add_argument("--gen", type=int, required=True)
    r.add_argument("--threads", type=int, default=2)
    r.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    result = convert(args) if args.command == "convert" else run(args)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
