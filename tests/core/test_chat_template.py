"""Chat templates render and tokenize like transformers and mlx-lm, inside a sandbox."""

from __future__ import annotations

import json
import shutil
from datetime import datetime
from pathlib import Path

import pytest
from mlx_lm.tokenizer_utils import load as mlx_lm_load
from transformers import AutoTokenizer

from mlx_loom.errors import TokenizerError
from mlx_loom.text import Tokenizer

from .tokenizer_fixtures import family, fixture_dirs  # noqa: F401

CONVERSATIONS = [
    [{"role": "user", "content": "Hi café 🙂"}],
    [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "  padded  "},
        {"role": "assistant", "content": "Hello <b>there</b> & 'you'"},
        {"role": "user", "content": "中文?"},
    ],
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "a+b <sum>",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
        },
    }
]


@pytest.fixture(scope="module")
def oracles(fixture_dirs):  # noqa: F811
    return {name: AutoTokenizer.from_pretrained(path) for name, path in fixture_dirs.items()}


def _with_template(src: Path, dst: Path, template: str) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    (dst / "chat_template.jinja").unlink(missing_ok=True)
    return dst


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_rendering_matches_transformers(family, oracles, add_generation_prompt):  # noqa: F811
    name, path = family
    ours, theirs = Tokenizer.from_dir(path), oracles[name]
    for messages in CONVERSATIONS:
        expected = theirs.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert (
            ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
            == expected
        )


def test_chat_ids_match_transformers_and_mlx_lm(family, oracles):  # noqa: F811
    name, path = family
    ours, theirs, lm = Tokenizer.from_dir(path), oracles[name], mlx_lm_load(path)
    for messages in CONVERSATIONS:
        ids = ours.encode_chat(messages)
        assert ids == list(
            theirs.apply_chat_template(
                messages, tokenize=True, add_generation_prompt=True, return_dict=False
            )
        )
        assert ids == list(lm.apply_chat_template(messages, add_generation_prompt=True))


def test_template_that_writes_bos_gets_exactly_one(fixture_dirs):  # noqa: F811
    tok = Tokenizer.from_dir(fixture_dirs["spm_bpe"])
    ids = tok.encode_chat(CONVERSATIONS[0])
    assert ids[0] == tok.bos_token_id
    assert ids.count(tok.bos_token_id) == 1


def test_template_without_bos_gets_none(fixture_dirs):  # noqa: F811
    tok = Tokenizer.from_dir(fixture_dirs["byte_bpe"])
    assert tok.encode_chat(CONVERSATIONS[0])[0] == tok.token_to_id("<|im_start|>")


def test_system_argument_prepends_a_system_message(fixture_dirs):  # noqa: F811
    tok = Tokenizer.from_dir(fixture_dirs["byte_bpe"])
    user = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(user, system="be brief") == tok.apply_chat_template(
        [{"role": "system", "content": "be brief"}, *user]
    )


def test_tools_select_the_tool_use_template_like_transformers(fixture_dirs, oracles):  # noqa: F811
    tok, theirs = Tokenizer.from_dir(fixture_dirs["byte_bpe"]), oracles["byte_bpe"]
    rendered = tok.apply_chat_template(CONVERSATIONS[0], tools=TOOLS)
    assert rendered == theirs.apply_chat_template(
        CONVERSATIONS[0], tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert '"description": "a+b <sum>"' in rendered  # tojson does not HTML-escape
    assert "Tools:" not in tok.apply_chat_template(CONVERSATIONS[0])
    assert tok.chat_template_names == ("default", "tool_use")


def test_chat_template_jinja_wins_over_tokenizer_config(fixture_dirs):  # noqa: F811
    # The unigram fixture's config template would raise if it were used.
    tok = Tokenizer.from_dir(fixture_dirs["unigram"])
    assert tok.apply_chat_template(CONVERSATIONS[0]).startswith("<bos>")
    assert tok.chat_template().origin.endswith("chat_template.jinja")


def test_continue_final_message_matches_transformers(fixture_dirs, oracles):  # noqa: F811
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}]
    for name in ("byte_bpe", "spm_bpe", "unigram"):
        tok, theirs = Tokenizer.from_dir(fixture_dirs[name]), oracles[name]
        ours = tok.apply_chat_template(
            messages, add_generation_prompt=False, continue_final_message=True
        )
        assert ours == theirs.apply_chat_template(
            messages, tokenize=False, continue_final_message=True
        )
        assert ours.endswith("Once upon")


def test_none_fields_are_dropped_like_transformers(fixture_dirs, oracles, tmp_path):  # noqa: F811
    path = _with_template(
        fixture_dirs["byte_bpe"],
        tmp_path / "m",
        "{% for m in messages %}{{ m.role }}:{{ m.get('content', 'EMPTY') }};{% endfor %}",
    )
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": None}]
    expected = AutoTokenizer.from_pretrained(path).apply_chat_template(messages, tokenize=False)
    assert (
        Tokenizer.from_dir(path).apply_chat_template(messages)
        == expected
        == ("user:a;assistant:EMPTY;")
    )


def test_template_kwargs_and_strftime_now_reach_the_template(fixture_dirs, tmp_path):  # noqa: F811
    path = _with_template(
        fixture_dirs["byte_bpe"],
        tmp_path / "m",
        "{{ strftime_now('%Y') }}|{{ enable_thinking }}|{{ eos_token }}|"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}"
        "{% endfor %}{% generation %}G{% endgeneration %}",
    )
    tok = Tokenizer.from_dir(path)
    rendered = tok.apply_chat_template(CONVERSATIONS[1], enable_thinking=False)
    assert rendered == f"{datetime.now().year}|False|<|im_end|>|be briefG"


def test_template_raise_exception_becomes_tokenizer_error(fixture_dirs):  # noqa: F811
    tok = Tokenizer.from_dir(fixture_dirs["spm_bpe"])
    with pytest.raises(TokenizerError, match="Unknown role: tool") as err:
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    assert "tokenizer_config.json" in err.value.message
    assert "--no-chat-template" in err.value.fix


def test_missing_template_names_the_files_and_the_fix(fixture_dirs, tmp_path):  # noqa: F811
    path = _with_template(fixture_dirs["byte_bpe"], tmp_path / "m", None)
    tok = Tokenizer.from_dir(path)
    assert not tok.has_chat_template
    with pytest.raises(TokenizerError) as err:
        tok.encode_chat(CONVERSATIONS[0])
    assert "chat_template.jinja" in err.value.message
    assert "--no-chat-template" in err.value.fix


def test_broken_template_loads_but_fails_when_rendered(fixture_dirs, tmp_path):  # noqa: F811
    path = _with_template(fixture_dirs["byte_bpe"], tmp_path / "m", "{% for m in messages %}")
    tok = Tokenizer.from_dir(path)  # --no-chat-template users must still load the model
    assert tok.encode("hi")
    with pytest.raises(TokenizerError, match="does not compile"):
        tok.apply_chat_template(CONVERSATIONS[0])


@pytest.mark.parametrize(
    "hostile",
    [
        "{{ ''.__class__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__.__base__.__subclasses__() }}",
        "{{ raise_exception.__globals__ }}",
        "{% set ns = namespace(__init__=1) %}",
        "{{ messages.append({'role': 'x'}) }}",
        "{{ messages[0].update({'content': 'x'}) }}",
    ],
)
def test_hostile_template_is_refused_by_the_sandbox(fixture_dirs, tmp_path, hostile):  # noqa: F811
    tok = Tokenizer.from_dir(_with_template(fixture_dirs["byte_bpe"], tmp_path / "m", hostile))
    with pytest.raises(TokenizerError, match="sandbox"):
        tok.apply_chat_template(CONVERSATIONS[0])


def test_empty_conversation_is_refused(fixture_dirs):  # noqa: F811
    with pytest.raises(TokenizerError, match="empty"):
        Tokenizer.from_dir(fixture_dirs["byte_bpe"]).apply_chat_template([])
