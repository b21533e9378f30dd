"""Specification of bounded JSON parsing: every bound is a typed error that says where."""

from __future__ import annotations

import json

import pytest

from mlx_loom.bounded_json import (
    ARTIFACT_JSON,
    CONFIG_JSON,
    REQUEST_JSON,
    JsonLimits,
    parse_json,
    read_json_file,
)
from mlx_loom.errors import ConfigError, RequestError, TokenizerError

FIX = "repair the file"
REQUEST = {"source": "body", "error": RequestError, "fix": FIX, "limits": REQUEST_JSON}


def parse(text: str | bytes, **kwargs):
    return parse_json(text, source="c.json", error=ConfigError, fix=FIX, **kwargs)


def refused(text: str | bytes, **kwargs) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse(text, **kwargs)
    assert info.value.fix == FIX and info.value.message.startswith("c.json")
    return info.value


def test_ordinary_json_parses_exactly_as_the_stdlib_does():
    text = json.dumps({"a": [1, 2.5, None, True, {"b": 'x"y'}], "c": -3, "d": "é"})
    assert parse(text) == json.loads(text)


def test_bytes_are_decoded_as_utf8():
    assert parse('{"name": "é"}'.encode()) == {"name": "é"}


def test_invalid_utf8_names_the_byte():
    assert "not valid UTF-8 (byte 1)" in refused(b"{\xff}").message


def test_syntax_errors_name_line_and_column():
    err = refused('{\n  "a": [1, 2,]\n}')
    assert "not valid JSON" in err.message and "line 2, column 14" in err.message


def test_nesting_past_the_limit_is_refused_with_its_path():
    text = '{"model_type": "x", "rope": {"scaling": ' + "[" * 100 + "]" * 100 + "}}"
    err = refused(text)
    assert "deeper than the limit of 64 levels" in err.message
    assert "at rope.scaling[0][0]" in err.message and "line 1" in err.message


def test_a_hundred_thousand_levels_fail_fast_without_recursion():
    text = "[" * 100_000 + "]" * 100_000
    assert "deeper than the limit" in refused(text).message


def test_nesting_exactly_at_the_limit_parses():
    depth = ARTIFACT_JSON.max_depth
    assert parse("[" * depth + "]" * depth) is not None


def test_brackets_inside_strings_do_not_count_as_nesting():
    text = json.dumps({"template": "[" * 1000 + "{" * 1000})
    assert parse(text)["template"].startswith("[[[")


def test_an_integer_longer_than_the_limit_is_refused_naming_its_field():
    err = refused('{"layers": [1, {"n": ' + "9" * 5000 + "}]}")
    assert "integer at layers[1].n" in err.message and "5000 digits" in err.message


def test_a_negative_huge_integer_is_refused_too():
    assert "digits" in refused('{"x": -' + "1" * 100 + "}").message


def test_an_integer_of_exactly_the_digit_limit_parses_and_one_more_digit_is_refused():
    limits = JsonLimits(max_int_digits=10)
    assert parse('{"x": [' + "7" * 10 + "]}", limits=limits) == {"x": [7777777777]}
    assert "11 digits" in refused('{"x": [' + "7" * 11 + "]}", limits=limits).message


def test_many_short_integers_are_not_one_long_run():
    ids = list(range(100_000))
    assert parse(json.dumps({"prompt": ids}))["prompt"] == ids


def test_the_transformers_model_max_length_sentinel_parses():
    value = 1000000000000000019884624838656
    assert parse(json.dumps({"model_max_length": value})) == {"model_max_length": value}


def test_long_digit_strings_and_floats_are_not_integers():
    text = json.dumps({"id": "9" * 5000}) + " "
    assert parse(text)["id"] == "9" * 5000
    assert parse('{"x": 1.' + "5" * 200 + "}")["x"] == pytest.approx(1 + 5 / 9)


def test_too_many_containers_is_refused():
    text = "[" + ",".join(["{}"] * 11) + "]"
    err = refused(text, limits=JsonLimits(max_containers=10))
    assert "12 JSON arrays/objects; the limit is 10" in err.message


def test_a_document_over_the_byte_limit_is_refused_before_parsing():
    err = refused(b"[" + b"0," * 20 + b"0]", limits=JsonLimits(max_bytes=16))
    assert "limit for this JSON is 16 bytes" in err.message


def test_the_callers_error_class_is_raised():
    with pytest.raises(TokenizerError):
        parse_json("[" * 70 + "]" * 70, source="t.json", error=TokenizerError, fix=FIX)


def test_the_object_pairs_hook_sees_every_object():
    seen = []
    parse('{"a": {"b": 1}}', object_pairs_hook=lambda pairs: seen.append(pairs) or dict(pairs))
    assert seen == [[("b", 1)], [("a", {"b": 1})]]


def test_read_json_file_checks_the_size_before_reading(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"a": "' + "x" * 100 + '"}')
    with pytest.raises(ConfigError, match="limit for this file is 64 bytes"):
        read_json_file(path, error=ConfigError, fix=FIX, limits=JsonLimits(max_bytes=64))


def test_read_json_file_leaves_a_missing_file_to_the_caller(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_json_file(tmp_path / "absent.json", error=ConfigError, fix=FIX)


def test_read_json_file_names_the_path_in_errors(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("[" * 80 + "]" * 80)
    with pytest.raises(ConfigError, match=str(path)):
        read_json_file(path, error=ConfigError, fix=FIX, limits=CONFIG_JSON)


def test_a_directory_is_an_unreadable_file_not_a_crash(tmp_path):
    with pytest.raises(ConfigError, match="cannot be read"):
        read_json_file(tmp_path, error=ConfigError, fix=FIX)


def test_lone_surrogate_escapes_are_refused_where_text_must_be_unicode():
    body = '{"messages": [{"role": "user", "content": "hi \\ud800 there"}]}'
    with pytest.raises(RequestError, match=r"string at messages\[0\].content holds a lone"):
        parse_json(body, source="body", error=RequestError, fix=FIX, limits=REQUEST_JSON)


def test_surrogate_pairs_and_escaped_backslashes_are_ordinary_text():
    value = parse_json(r'{"a": "\ud83d\ude00", "b": "\\ud800"}', **REQUEST)
    assert value == {"a": "😀", "b": "\\ud800"}


def test_artifact_json_keeps_lone_surrogates_as_python_does():
    assert parse('{"t": "\\udc80"}') == {"t": "\udc80"}
