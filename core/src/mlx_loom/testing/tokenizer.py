"""A small, real byte-level BPE tokenizer for tiny test checkpoints.

Conformance checks drive a model end to end (text in, text out, chat
template), so a tiny checkpoint needs a tokenizer the engine loads exactly as
it loads a published one. This one is trained with the ``tokenizers``
library, in a few milliseconds, on a fixed English corpus, and written in
Hugging Face layout (``tokenizer.json`` + ``tokenizer_config.json`` with a
ChatML template). Its vocabulary is trained to fit the model's
``vocab_size``: every id it can produce is a valid row of the embedding.

The byte alphabet is only the bytes the corpus uses (not all 256), so that
a 256-entry vocabulary still has room for merges; characters outside the
corpus are dropped by the encoder, which is harmless for test prompts.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

__all__ = ["CHATML_TEMPLATE", "SPECIAL_TOKENS", "write_tokenizer"]

#: ``<|endoftext|>`` pads, ``<|im_end|>`` ends a turn (and is the EOS).
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_CORPUS = (
    "the model reads a token and writes the next one",
    "while the cache keeps every key and value of the prompt",
    "so decoding stays cheap and fast on every device",
    "hello world, this is a tiny tokenizer for tests.",
    "A plugin adds a family; the core checks that it conforms!",
    "Numbers 0 1 2 3 4 5 6 7 8 9 and symbols: ( ) [ ] { } - + = ? ' \"",
    "The quick brown fox jumps over the lazy dog.",
    "Question: what comes next? Answer: the next token.",
    "user\nhi\nassistant\nhello\n",  # chat templates put newlines between turns
)

#: Fewer than this and a vocabulary cannot hold the corpus alphabet plus specials.
MIN_VOCAB = 96


def write_tokenizer(path: str | Path, vocab_size: int, *, max_vocab: int = 512) -> Path:
    """Train and write the tokenizer into ``path``; return ``path``.

    The trained vocabulary has at most ``min(vocab_size, max_vocab)`` entries
    (a small vocabulary keeps training in milliseconds). Raises
    :class:`ValueError` when ``vocab_size`` is too small for the alphabet.
    """
    if vocab_size < MIN_VOCAB:
        raise ValueError(
            f"vocab_size={vocab_size} is too small for the test tokenizer (needs >= {MIN_VOCAB}); "
            "use a tiny config with a larger vocab_size, or write tokenizer=False"
        )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=min(vocab_size, max_vocab),
        special_tokens=list(SPECIAL_TOKENS),
        show_progress=False,
    )
    tok.train_from_iterator(list(_CORPUS) * 4, trainer=trainer)
    size = tok.get_vocab_size(with_added_tokens=True)
    if size > vocab_size:  # the alphabet alone outgrew the model's vocabulary
        raise ValueError(
            f"the test tokenizer needs {size} ids but the config's vocab_size is {vocab_size}"
        )
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": CHATML_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path
