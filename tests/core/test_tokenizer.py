"""Tokenizer loading, encode/decode and special ids, against transformers and mlx-lm."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from mlx_loom.errors import TokenizerError
from mlx_loom.text import Tokenizer

# The suite runs with --import-mode=importlib, so the helper beside this file is
# found through an explicit path entry.
from .tokenizer_fixtures import MULTIBYTE_SAMPLES, corpus, family, fixture_dirs  # noqa: F401

TEXTS = MULTIBYTE_SAMPLES + corpus(40, seed=7) + ["", " ", "\n\n", "<|im_start|>x<s>y</s>"]


@pytest.fixture(scope="module")
def oracles(fixture_dirs):  # noqa: F811
    return {name: AutoTokenizer.from_pretrained(path) for name, path in fixture_dirs.items()}


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_encode_matches_transformers_with_and_without_special_tokens(family, oracles):  # noqa: F811
    name, path = family
    ours, theirs = Tokenizer.from_dir(path), oracles[name]
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(
            text, add_special_tokens=False
        ), text


def test_decode_matches_transformers_with_and_without_special_tokens(family, oracles):  # noqa: F811
    name, path = family
    ours, theirs = Tokenizer.from_dir(path), oracles[name]
    for text in TEXTS:
        ids = theirs.encode(text)
        assert ours.decode(ids) == theirs.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(
            ids, skip_special_tokens=True
        )


def test_vocab_size_and_special_ids_match_transformers(family, oracles):  # noqa: F811
    name, path = family
    ours, theirs = Tokenizer.from_dir(path), oracles[name]
    assert ours.vocab_size == len(theirs)
    assert ours.bos_token_id == theirs.bos_token_id
    assert ours.bos_token == theirs.bos_token
    assert ours.pad_token_id == theirs.pad_token_id
    assert theirs.eos_token_id in ours.eos_token_ids
    assert ours.special_tokens == theirs.special_tokens_map


def test_encode_adds_bos_exactly_when_the_post_processor_does(fixture_dirs):  # noqa: F811
    spm = Tokenizer.from_dir(fixture_dirs["spm_bpe"])
    byte = Tokenizer.from_dir(fixture_dirs["byte_bpe"])
    assert spm.encode("hello")[0] == spm.bos_token_id
    assert spm.encode("hello", add_special_tokens=False)[0] != spm.bos_token_id
    assert byte.bos_token_id is None
    assert byte.encode("hello") == byte.encode("hello", add_special_tokens=False)


def test_encode_prompt_does_not_add_a_second_bos(fixture_dirs):  # noqa: F811
    tok = Tokenizer.from_dir(fixture_dirs["spm_bpe"])
    with_bos = tok.encode_prompt("<s>hello")
    assert with_bos.count(tok.bos_token_id) == 1
    assert tok.encode_prompt("hello") == tok.encode("hello")


def test_dict_form_special_tokens_are_read_by_content(fixture_dirs):  # noqa: F811
    tok = Tokenizer.from_dir(fixture_dirs["spm_bpe"])
    assert (tok.bos_token, tok.eos_token) == ("<s>", "</s>")
    assert tok.eos_token_ids == frozenset({tok.token_to_id("</s>")})


def test_eos_ids_union_tokenizer_generation_config_and_caller(fixture_dirs):  # noqa: F811
    # byte_bpe: eos_token <|im_end|> (2); generation_config lists [2, 0].
    assert Tokenizer.from_dir(fixture_dirs["byte_bpe"]).eos_token_ids == frozenset({0, 2})
    tok = Tokenizer.from_dir(fixture_dirs["byte_bpe"], config_eos=[1, 5])
    assert tok.eos_token_ids == frozenset({0, 1, 2, 5})
    assert Tokenizer.from_dir(fixture_dirs["unigram"], config_eos=7).eos_token_ids == frozenset(
        {1, 7}
    )


def test_special_tokens_map_fills_tokens_the_config_lacks(fixture_dirs, tmp_path):  # noqa: F811
    path = _copy(fixture_dirs["spm_bpe"], tmp_path / "m")
    config = json.loads((path / "tokenizer_config.json").read_text())
    del config["eos_token"]
    config["bos_token"] = "<s>"
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": {"content": "</s>"}, "bos_token": "<unk>"})
    )
    tok = Tokenizer.from_dir(path)
    assert tok.eos_token == "</s>"
    assert tok.bos_token == "<s>"  # the config wins where both set it


def test_missing_tokenizer_json_names_the_file(fixture_dirs, tmp_path):  # noqa: F811
    path = _copy(fixture_dirs["byte_bpe"], tmp_path / "m")
    (path / "tokenizer.json").unlink()
    with pytest.raises(TokenizerError) as err:
        Tokenizer.from_dir(path)
    assert "tokenizer.json" in err.value.message and "missing" in err.value.message
    assert err.value.fix


def test_corrupt_tokenizer_json_names_the_file(fixture_dirs, tmp_path):  # noqa: F811
    path = _copy(fixture_dirs["byte_bpe"], tmp_path / "m")
    text = (path / "tokenizer.json").read_text()
    (path / "tokenizer.json").write_text(text[: len(text) // 2])
    with pytest.raises(TokenizerError) as err:
        Tokenizer.from_dir(path)
    assert str(path / "tokenizer.json") in err.value.message
    assert err.value.fix


def test_corrupt_tokenizer_config_names_the_file(fixture_dirs, tmp_path):  # noqa: F811
    path = _copy(fixture_dirs["byte_bpe"], tmp_path / "m")
    (path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer_config.json"):
        Tokenizer.from_dir(path)


def test_invalid_generation_config_eos_is_refused(fixture_dirs, tmp_path):  # noqa: F811
    path = _copy(fixture_dirs["byte_bpe"], tmp_path / "m")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": "two"}))
    with pytest.raises(TokenizerError, match="generation_config.json"):
        Tokenizer.from_dir(path)


def test_missing_directory_is_refused(tmp_path):
    with pytest.raises(TokenizerError, match="does not exist"):
        Tokenizer.from_dir(tmp_path / "nope")


def test_invalid_special_token_field_is_refused_naming_it(fixture_dirs, tmp_path):  # noqa: F811
    path = _copy(fixture_dirs["byte_bpe"], tmp_path / "m")
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["eos_token"] = 5
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerError, match="'eos_token'"):
        Tokenizer.from_dir(path)


# --- mlx-lm compatibility -----------------------------------------------------------

CHAT = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hi"}]


def test_eos_token_id_and_ids_match_mlx_lm(family):  # noqa: F811
    from mlx_lm.tokenizer_utils import load as mlx_lm_load

    name, path = family
    ours, theirs = Tokenizer.from_dir(path), mlx_lm_load(path)
    assert ours.eos_token_id == theirs.eos_token_id
    assert ours.eos_token_id in ours.eos_token_ids
    assert set(ours.eos_token_ids) >= set(theirs.eos_token_ids)


def test_eos_token_id_falls_back_to_the_configs_first_id(tmp_path, fixture_dirs):  # noqa: F811
    path = _copy(fixture_dirs["byte_bpe"], tmp_path / "no-eos-token")
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["eos_token"] = None
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "generation_config.json").unlink(missing_ok=True)
    assert Tokenizer.from_dir(path, config_eos=[5, 1]).eos_token_id == 5
    assert Tokenizer.from_dir(path).eos_token_id is None


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_apply_chat_template_tokenize_true_returns_mlx_lms_ids(family, add_generation_prompt):  # noqa: F811
    from mlx_lm.tokenizer_utils import load as mlx_lm_load

    name, path = family
    ours, theirs = Tokenizer.from_dir(path), mlx_lm_load(path)
    ids = ours.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=add_generation_prompt)
    assert ids == list(
        theirs.apply_chat_template(CHAT, add_generation_prompt=add_generation_prompt)
    )
    text = ours.apply_chat_template(CHAT, add_generation_prompt=add_generation_prompt)
    assert isinstance(text, str) and ours.encode(text, add_special_tokens=False) == ids


def test_apply_chat_template_refuses_a_non_bool_tokenize(fixture_dirs):  # noqa: F811
    with pytest.raises(TokenizerError, match="tokenize='yes'"):
        Tokenizer.from_dir(fixture_dirs["byte_bpe"]).apply_chat_template(CHAT, tokenize="yes")


def test_text_with_a_lone_surrogate_is_a_request_error_not_a_type_error(tmp_path):
    from mlx_loom.errors import RequestError
    from mlx_loom.testing.tokenizer import write_tokenizer

    write_tokenizer(tmp_path, 256)
    tok = Tokenizer.from_dir(tmp_path)
    with pytest.raises(RequestError, match="lone UTF-16 surrogate") as info:
        tok.encode("hi \ud800 there")
    assert "character 3" in info.value.message and info.value.fix
