"""The streaming detokenizer releases only final text and ends equal to ``decode``."""

from __future__ import annotations

import random

import pytest
from mlx_lm.tokenizer_utils import load as mlx_lm_load
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models

from mlx_loom.errors import TokenizerError
from mlx_loom.text import DecodePlan, StreamingDetokenizer, Tokenizer

from .tokenizer_fixtures import MULTIBYTE_SAMPLES, corpus, family, fixture_dirs  # noqa: F401

REPLACEMENT = "\ufffd"


def _stream(tok: Tokenizer, ids: list[int], *, skip: bool = False) -> list[str]:
    """Segments released after each id, then the finalize() segment."""
    detok = tok.detokenizer(skip_special_tokens=skip)
    return [detok.add_token(i) for i in ids] + [detok.finalize()]


def _ids_of_every_sample(tok: Tokenizer) -> list[list[int]]:
    return [tok.encode(text) for text in MULTIBYTE_SAMPLES] + [
        tok.encode(" ".join(MULTIBYTE_SAMPLES))
    ]


def test_every_prefix_streams_to_exactly_decode(family):  # noqa: F811
    _, path = family
    tok = Tokenizer.from_dir(path)
    for ids in _ids_of_every_sample(tok):
        for end in range(len(ids) + 1):
            prefix = ids[:end]
            assert "".join(_stream(tok, prefix)) == tok.decode(prefix), prefix


def test_every_prefix_streams_to_decode_when_skipping_special_tokens(family):  # noqa: F811
    _, path = family
    tok = Tokenizer.from_dir(path)
    ids = tok.encode_chat([{"role": "user", "content": "café 🙂 中文"}]) + tok.encode("👍🏽 done")
    for end in range(len(ids) + 1):
        prefix = ids[:end]
        streamed = "".join(_stream(tok, prefix, skip=True))
        assert streamed == tok.decode(prefix, skip_special_tokens=True)


def test_released_text_is_never_revised_and_never_a_split_character(family):  # noqa: F811
    _, path = family
    tok = Tokenizer.from_dir(path)
    for ids in _ids_of_every_sample(tok):
        final = tok.decode(ids)
        assert REPLACEMENT not in final
        detok = tok.detokenizer()
        for token in ids:
            detok.add_token(token)
            assert final.startswith(detok.text)
            assert REPLACEMENT not in detok.text
        detok.finalize()
        assert detok.text == final


def test_random_ids_including_invalid_bytes_stream_to_decode(family):  # noqa: F811
    # Arbitrary ids produce stray continuation bytes, truncated sequences and
    # broken byte-fallback runs: U+FFFD must appear exactly where decode puts it.
    _, path = family
    tok = Tokenizer.from_dir(path)
    rng = random.Random(1)
    byte_ids = [i for i in range(tok.vocab_size) if (tok.id_to_token(i) or "").startswith("<0x")]
    pool = list(range(tok.vocab_size)) + byte_ids * 4 + [tok.vocab_size + 5]  # + an unknown id
    for _ in range(150):
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 24))]
        assert "".join(_stream(tok, ids)) == tok.decode(ids), ids


def test_last_segment_returns_only_new_text_and_text_accumulates(fixture_dirs):  # noqa: F811
    tok = Tokenizer.from_dir(fixture_dirs["byte_bpe"])
    ids = tok.encode("the model reads café")
    detok = tok.detokenizer()
    pieces = []
    for token in ids:
        detok.add_token(token)
        pieces.append(detok.last_segment)
    detok.finalize()
    pieces.append(detok.last_segment)
    assert detok.last_segment == ""
    assert "".join(pieces) == detok.text == tok.decode(ids)


def test_a_character_split_across_tokens_is_held_until_complete(fixture_dirs):  # noqa: F811
    tok = Tokenizer.from_dir(fixture_dirs["byte_bpe"])
    ids = tok.encode("🚀")
    assert len(ids) > 1  # the fixture's tiny vocabulary splits the emoji's 4 bytes
    detok = tok.detokenizer()
    assert [detok.add_token(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add_token(ids[-1]) == "🚀"


def test_byte_fallback_run_is_held_until_no_later_byte_can_change_it(fixture_dirs):  # noqa: F811
    # ByteFallback decodes a whole run of <0x..> tokens at once: "€" followed by
    # a lone 0xE2 byte becomes four U+FFFD, so "€" must not be released early.
    tok = Tokenizer.from_dir(fixture_dirs["spm_bpe"])
    euro = [tok.token_to_id(f"<0x{b:02X}>") for b in "€".encode()]
    word = tok.encode("the", add_special_tokens=False)
    detok = tok.detokenizer()
    released = detok.add_tokens(word + euro)
    assert "€" not in released
    detok.add_token(euro[0])
    rest = detok.add_tokens(word) + detok.finalize()
    assert detok.text == tok.decode(word + euro + euro[:1] + word)
    assert REPLACEMENT * 4 in rest


def test_finalize_flushes_an_incomplete_character_as_decode_does(fixture_dirs):  # noqa: F811
    tok = Tokenizer.from_dir(fixture_dirs["byte_bpe"])
    ids = tok.encode("🚀")[:-1]
    detok = tok.detokenizer()
    assert detok.add_tokens(ids) == ""
    assert detok.finalize() == tok.decode(ids)
    assert REPLACEMENT in detok.text


def test_adding_after_finalize_is_refused_until_reset(fixture_dirs):  # noqa: F811
    tok = Tokenizer.from_dir(fixture_dirs["byte_bpe"])
    detok = tok.detokenizer()
    detok.add_tokens(tok.encode("hello"))
    detok.finalize()
    with pytest.raises(TokenizerError, match="finalized"):
        detok.add_token(5)
    detok.reset()
    assert detok.add_tokens(tok.encode("x")) + detok.finalize() == "x"
    assert detok.tokens == tok.encode("x")


@pytest.mark.parametrize("name", ["byte_bpe", "spm_bpe"])
def test_final_text_matches_mlx_lm_streaming_detokenizer(fixture_dirs, name):  # noqa: F811
    # mlx-lm picks its BPE / SPM detokenizer for these decoders. Its BPE one
    # drops a leading space of the first token, which decode() keeps, so texts
    # starting with a space are left out; elsewhere the two must agree.
    path = fixture_dirs[name]
    ours, theirs = Tokenizer.from_dir(path), mlx_lm_load(path)
    texts = [t for t in MULTIBYTE_SAMPLES + corpus(20, seed=3) if not t.startswith(" ")]
    for text in texts:
        ids = ours.encode(text, add_special_tokens=False)
        detok = theirs.detokenizer
        for token in ids:
            detok.add_token(token)
        detok.finalize()
        assert "".join(_stream(ours, ids)) == detok.text, text


class _CountingBackend:
    """Wraps a tokenizers.Tokenizer and records the length of every decode call."""

    def __init__(self, backend: RawTokenizer) -> None:
        self._backend = backend
        self.decode_lengths: list[int] = []

    def decode(self, ids, skip_special_tokens=False):
        self.decode_lengths.append(len(ids))
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def __getattr__(self, name):
        return getattr(self._backend, name)


def test_interpreted_decoders_never_re_decode(family):  # noqa: F811
    _, path = family
    backend = _CountingBackend(RawTokenizer.from_file(str(path / "tokenizer.json")))
    plan = DecodePlan.for_backend(backend)
    assert plan.stage_factory is not None, plan.reason_unsupported
    tok = Tokenizer.from_dir(path)
    ids = tok.encode(" ".join(corpus(60)))
    detok = StreamingDetokenizer(plan)
    text = detok.add_tokens(ids) + detok.finalize()
    assert text == tok.decode(ids)
    assert backend.decode_lengths == []


def _wordpiece_tokenizer() -> RawTokenizer:
    vocab = {"[UNK]": 0, "the": 1, "mod": 2, "##el": 3, "caf": 4, "##é": 5, "!": 6}
    raw = RawTokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    raw.decoder = decoders.WordPiece()
    return raw


def test_unknown_decoder_uses_bounded_windows_and_matches_decode():
    backend = _CountingBackend(_wordpiece_tokenizer())
    plan = DecodePlan.for_backend(backend)
    assert plan.stage_factory is None  # WordPiece is not interpreted
    rng = random.Random(0)
    ids = [rng.randrange(7) for _ in range(400)]
    for end in (0, 1, 2, 57, 400):
        detok = StreamingDetokenizer(plan)
        assert detok.add_tokens(ids[:end]) + detok.finalize() == backend.decode(ids[:end])
    # Amortised O(1): every decode during streaming covers a window of a few
    # tokens, never the whole growing sequence (finalize decodes once).
    backend.decode_lengths.clear()
    detok = StreamingDetokenizer(plan)
    detok.add_tokens(ids)
    assert max(backend.decode_lengths) <= 3


def test_metaspace_first_token_drops_every_replacement_char_like_tokenizers():
    # The quirk the Metaspace stage reproduces, checked on the library itself.
    decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    assert decoder.decode(["▁he▁llo", "▁world"]) == "hello world"
    vocab = [("<unk>", 0.0), ("▁he▁llo", -1.0), ("▁world", -1.0), ("x▁", -1.0)]
    raw = RawTokenizer(models.Unigram(vocab, unk_id=0))
    raw.decoder = decoder
    detok = StreamingDetokenizer(DecodePlan.for_backend(raw))
    assert detok.add_tokens([1, 2, 3, 1]) + detok.finalize() == raw.decode([1, 2, 3, 1])


def test_text_split_at_every_character_streams_back_to_itself(fixture_dirs):  # noqa: F811
    # Encoding the two halves separately gives token boundaries a single encode
    # never produces (inside words, between a character and its combining mark).
    tok = Tokenizer.from_dir(fixture_dirs["byte_bpe"])
    for text in ["café 🙂", "中文 👍🏽", "e\u0301!", "👩‍💻🇯🇵"]:
        for cut in range(len(text) + 1):
            ids = tok.encode(text[:cut]) + tok.encode(text[cut:])
            segments = _stream(tok, ids)
            assert "".join(segments) == text
            assert all(REPLACEMENT not in s for s in segments)
