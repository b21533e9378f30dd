"""Stop strings and stop token sequences: hold back what may start a stop, never emit one."""

from __future__ import annotations

import random

import pytest

from mlx_loom.errors import RequestError
from mlx_loom.text import StopStrings, StopTokenSequences, Tokenizer

from .tokenizer_fixtures import fixture_dirs  # noqa: F401


def _run(stops: list[str], chunks: list[str]) -> tuple[str, str | None]:
    """Everything emitted for ``chunks`` (flushing at the end) and the stop hit."""
    matcher = StopStrings(stops)
    out = []
    for chunk in chunks:
        emit, stop = matcher.feed(chunk)
        out.append(emit)
        if stop is not None:
            return "".join(out), stop
    return "".join(out) + matcher.flush(), None


def test_text_without_stop_prefix_is_released_at_once():
    assert StopStrings(["</s>"]).feed("hello world").emit == "hello world"


def test_partial_prefix_at_the_end_is_held_back():
    matcher = StopStrings(["</s>"])
    check = matcher.feed("hello </")
    assert (check.emit, check.stop, matcher.held) == ("hello ", None, "</")


def test_held_text_is_released_when_the_stop_does_not_follow():
    matcher = StopStrings(["</s>"])
    matcher.feed("a </")
    assert matcher.feed("b>").emit == "</b>"


def test_completed_stop_reports_the_text_before_it_and_not_the_stop():
    matcher = StopStrings(["</s>"])
    assert matcher.feed("Hi </").emit == "Hi "
    check = matcher.feed("s> ignored")
    assert (check.emit, check.stop, check.stopped) == ("", "</s>", True)


def test_no_input_is_accepted_after_a_stop():
    matcher = StopStrings(["x"])
    matcher.feed("ax")
    assert matcher.feed("more").emit == ""
    assert matcher.flush() == ""


def test_flush_releases_the_held_tail_as_real_text():
    matcher = StopStrings(["STOP"])
    assert matcher.feed("the ST").emit == "the "
    assert matcher.flush() == "ST"


def test_flush_with_final_text_still_honours_a_stop():
    matcher = StopStrings(["STOP"])
    matcher.feed("a S")
    assert matcher.flush("TOP tail") == ""


def test_overlapping_stops_the_one_completing_first_wins():
    # "bc" completes at the 3rd character, "abcd" only at the 4th.
    assert _run(["abcd", "bc"], ["abcd"]) == ("a", "bc")


def test_overlapping_stops_ending_together_the_longer_wins():
    assert _run(["bc", "abc"], ["xabc"]) == ("x", "abc")


def test_a_stop_that_is_a_prefix_of_another_stops_as_soon_as_it_completes():
    assert _run(["ab", "abc"], ["a", "b", "c"]) == ("", "ab")


def test_hold_back_covers_a_stop_starting_inside_another_stops_prefix():
    # "aab" is held as a possible "aabx"; its tail "ab" also starts "abz".
    assert _run(["aabx", "abz"], ["aa", "b", "z!"]) == ("a", "abz")


def test_result_does_not_depend_on_chunking():
    rng = random.Random(0)
    stops = ["</s>", "\nUser:", "ss>", "abab", "ba"]
    alphabet = "ab</s>\nUser: xyz"
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        by_char = _run(stops, list(text))
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(3, len(text) + 1)))
        chunks = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert _run(stops, chunks) == by_char == _run(stops, [text]), (text, chunks)


def test_stop_never_appears_in_emitted_text():
    rng = random.Random(1)
    stops = ["<|end|>", "END"]
    for _ in range(200):
        text = "".join(rng.choice(["<|", "end", "|>", "E", "ND", " x"]) for _ in range(12))
        emitted, stop = _run(stops, [text[i : i + 2] for i in range(0, len(text), 2)])
        assert all(s not in emitted for s in stops)
        assert text.startswith(emitted)
        if stop is None:
            assert emitted == text


def test_no_stops_release_everything():
    assert _run([], ["a", "b"]) == ("ab", None)


def test_empty_stop_string_is_refused():
    with pytest.raises(RequestError, match="empty stop string"):
        StopStrings(["ok", ""])


def test_token_sequence_prefix_is_held_then_released():
    matcher = StopTokenSequences([[7, 8, 9]])
    assert matcher.feed(1).emit == (1,)
    assert matcher.feed(7).emit == ()
    assert matcher.feed(8).emit == ()
    assert matcher.feed(3).emit == (7, 8, 3)


def test_token_sequence_match_drops_the_sequence_and_stops():
    matcher = StopTokenSequences([[7, 8], [5]])
    assert matcher.feed(7) == ((), None)
    assert matcher.feed(8) == ((), (7, 8))
    assert matcher.stopped


def test_token_sequence_overlap_restarts_inside_held_ids():
    matcher = StopTokenSequences([[7, 7, 8]])
    released = [matcher.feed(t).emit for t in (7, 7, 7)]
    assert released == [(), (), (7,)]
    assert matcher.feed(8).stop == (7, 7, 8)


def test_token_sequence_flush_releases_held_ids():
    matcher = StopTokenSequences([[7, 8]])
    matcher.feed(7)
    assert matcher.flush() == (7,)


def test_empty_token_sequence_is_refused():
    with pytest.raises(RequestError, match="empty stop token sequence"):
        StopTokenSequences([[]])


def test_token_stop_before_the_detokenizer_never_produces_its_text(fixture_dirs):  # noqa: F811
    tok = Tokenizer.from_dir(fixture_dirs["byte_bpe"])
    stop_ids = tok.encode(" reads a", add_special_tokens=False)
    ids = tok.encode("the model reads a token", add_special_tokens=False)
    assert len(stop_ids) > 1
    matcher, detok = StopTokenSequences([stop_ids]), tok.detokenizer()
    text = ""
    for token in ids:
        check = matcher.feed(token)
        text += detok.add_tokens(check.emit)
        if check.stopped:
            break
    text += detok.finalize()
    assert text == "the model"
