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
    import convert_hf_to_gguf

    out = Path(args.out)
    bf16 = out if args.outtype == "bf16" else out.with_suffix(".bf16.gguf")
    sys.argv = ["convert_hf_to_gguf.py", args.hf_dir, "--outfile", str(bf16), "--outtype", "bf16"]
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
