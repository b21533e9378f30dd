"""Tiny, real tokenizers trained locally, written in Hugging Face layout.

Every test of the text stack runs against tokenizers built here rather than
downloaded ones: each is trained in milliseconds with the ``tokenizers``
library on a few hundred generated lines (English, accented Latin, CJK, emoji,
code), and written with a ``tokenizer_config.json`` and a chat template, so
both our loader and the oracles (transformers' ``AutoTokenizer`` and mlx-lm's
``load``) read exactly the same files.

Three families cover the decoders real checkpoints ship:

* ``byte_bpe``  — GPT-2/Qwen style: ByteLevel pre-tokenizer and decoder, no BOS,
  ChatML template with ``<|im_start|>``/``<|im_end|>`` special tokens.
* ``spm_bpe``   — Llama-2/Mistral style: ``▁`` normalizer, BPE with byte
  fallback (``<0xE2>`` tokens), decoder Replace+ByteFallback+Fuse+Strip, a
  post-processor that prepends ``<s>``, and an ``[INST]`` template that also
  emits ``{{ bos_token }}`` (the double-BOS trap).
* ``unigram``   — SentencePiece Unigram with the Metaspace pre-tokenizer and
  decoder, a Gemma-like turn template, ``chat_template.jinja`` on disk.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

_WORDS = (
    "the model reads a token and writes the next one while the cache keeps "
    "every key and value of the prompt so decoding stays cheap and fast"
).split()
_ACCENTED = "café naïve über señor façade jalapeño crème brûlée garçon Zürich ångström".split()
_CJK = "中文 日本語 한국어 漢字 東京 北京 你好 世界 こんにちは 안녕하세요".split()
_EMOJI = ["🙂", "👍🏽", "🚀", "🇯🇵", "👩‍💻", "✨", "🎉"]
_CODE = [
    "def f(x): return x * 2",
    "for i in range(10): print(i)",
    '{"role": "user", "content": "hi"}',
    "if (a && b) { return c; }",
]


def corpus(lines: int = 300, seed: int = 0) -> list[str]:
    """Deterministic mixed-script training text; rare scripts stay rare on purpose.

    Emoji and most CJK appear only a few times, so with a small vocabulary they
    are *not* merged into single tokens: decoding them exercises multi-byte
    characters split across tokens (byte-level) and byte-fallback runs (SPM).
    """
    rng = random.Random(seed)
    out = []
    for i in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 12))]
        if i % 3 == 0:
            words.insert(rng.randrange(len(words)), rng.choice(_ACCENTED))
        if i % 7 == 0:
            words.insert(rng.randrange(len(words)), rng.choice(_CJK))
        if i % 11 == 0:
            words.append(rng.choice(_EMOJI))
        line = " ".join(words)
        if i % 5 == 0:
            line = line.capitalize() + "."
        if i % 13 == 0:
            line = rng.choice(_CODE)
        out.append(line)
    return out


# --- templates ---------------------------------------------------------------

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

CHATML_TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Llama-2 style: the template itself writes the BOS token.
INST_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}<<SYS>>{{ message['content'] }}<</SYS>>\n"
    "{% elif message['role'] == 'user' %}[INST] {{ message['content'] | trim }} [/INST]"
    "{% elif message['role'] == 'assistant' %} {{ message['content'] | trim }}{{ eos_token }}"
    "{% else %}{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
)

# Gemma-like, written with block tags on their own lines so trim_blocks and
# lstrip_blocks decide the whitespace of the result.
TURN_TEMPLATE = """{{ bos_token }}
{% for message in messages %}
    {% if message['role'] == 'assistant' %}
        {% set role = 'model' %}
    {% else %}
        {% set role = message['role'] %}
    {% endif %}
<start_of_turn>{{ role }}
{{ message['content'] | trim }}<end_of_turn>
{% endfor %}
{% if add_generation_prompt %}
<start_of_turn>model
{% endif %}
"""


# --- builders ----------------------------------------------------------------


def _byte_tokens() -> list[str]:
    return [f"<0x{b:02X}>" for b in range(256)]


def build_byte_bpe(directory: Path, *, vocab_size: int = 420) -> Path:
    """GPT-2/Qwen-style byte-level BPE with ChatML special tokens."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    # A non-special added token, as chat models add for tool or think markers.
    tok.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    _write_json(
        directory / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "unk_token": None,
            "add_bos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 4096,
            "chat_template": [
                {"name": "default", "template": CHATML_TEMPLATE},
                {"name": "tool_use", "template": CHATML_TOOLS_TEMPLATE},
            ],
        },
    )
    _write_json(directory / "generation_config.json", {"eos_token_id": [2, 0]})
    return directory


def build_spm_bpe(directory: Path, *, vocab_size: int = 520, strip_decoder: bool = True) -> Path:
    """Llama-2-style SentencePiece BPE with byte fallback and a BOS post-processor."""
    specials = ["<unk>", "<s>", "</s>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = None
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if strip_decoder:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials + _byte_tokens(),
        limit_alphabet=60,  # leave CJK and emoji out: they must go through <0x..> tokens
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tokenizer.json"
    tok.save(str(path))
    # Byte tokens are ordinary vocabulary entries in Llama checkpoints, not added tokens.
    data = json.loads(path.read_text(encoding="utf-8"))
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] in specials]
    _write_json(path, data)
    _write_json(
        directory / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            # The AddedToken form older Llama checkpoints ship.
            "bos_token": _added_token("<s>"),
            "eos_token": _added_token("</s>"),
            "unk_token": "<unk>",
            "pad_token": None,
            "add_bos_token": True,
            "clean_up_tokenization_spaces": False,
            "chat_template": INST_TEMPLATE,
        },
    )
    return directory


def build_unigram(directory: Path, *, vocab_size: int = 300) -> Path:
    """SentencePiece Unigram with Metaspace, turn markers, and ``chat_template.jinja``."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.UnigramTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        unk_token="<unk>",
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A",
        pair="<bos> $A <bos> $B",
        special_tokens=[("<bos>", tok.token_to_id("<bos>"))],
    )
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    _write_json(
        directory / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<bos>",
            "eos_token": "<eos>",
            "pad_token": "<pad>",
            "unk_token": "<unk>",
            "clean_up_tokenization_spaces": False,
            # Overridden by chat_template.jinja, as transformers does.
            "chat_template": "{{ raise_exception('the config template must not win') }}",
        },
    )
    (directory / "chat_template.jinja").write_text(TURN_TEMPLATE, encoding="utf-8")
    _write_json(directory / "special_tokens_map.json", {"additional_special_tokens": []})
    return directory


def _added_token(content: str) -> dict:
    return {
        "__type": "AddedToken",
        "content": content,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
    }


def _write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, ensure_ascii=False, indent=1), encoding="utf-8")


BUILDERS = {"byte_bpe": build_byte_bpe, "spm_bpe": build_spm_bpe, "unigram": build_unigram}

# Text that must round-trip through every fixture: multi-byte characters of
# every UTF-8 length, combining sequences, ZWJ emoji, flags, CJK, and spaces.
MULTIBYTE_SAMPLES = [
    "café naïve",
    "Zürich über façade",
    "中文 日本語 한국어",
    "emoji 🙂 and 👍🏽 and 🚀!",
    "flag 🇯🇵 coder 👩‍💻 done",
    "  leading and  double  spaces ",
    "e\u0301 combining acute",
    "mixed: the model 写 code ✨🎉 ångström",
]


# --- pytest fixtures (import them into a test module to use them) -------------


@pytest.fixture(scope="module")
def fixture_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One directory per tokenizer family, built once per test module."""
    root = tmp_path_factory.mktemp("tokenizers")
    return {name: build(root / name) for name, build in BUILDERS.items()}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def family(request: pytest.FixtureRequest, fixture_dirs: dict[str, Path]) -> tuple[str, Path]:
    """Parametrizes a test over every tokenizer family: ``(name, directory)``."""
    return request.param, fixture_dirs[request.param]
