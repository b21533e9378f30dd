"""``loom generate`` as people type it: positional prompts, mlx-lm's flag names, pipes, KV bits."""

from __future__ import annotations

import subprocess

import pytest

from mlx_loom.cli.main import main
from mlx_loom.text import Tokenizer

from .conftest import FAMILIES, loom_command


def test_a_positional_prompt_is_the_same_as_prompt_flag(loom, capsys):
    positional = loom("generate", "Once upon a time", "-m", "12")
    assert positional.returncode == 0, positional.stderr
    assert main(["generate", "--prompt", "Once upon a time", "--max-tokens", "12"]) == 0
    assert positional.stdout == capsys.readouterr().out and positional.stdout.strip()
    assert "Generation: 12 tokens" in positional.stderr


def test_a_dash_prompt_reads_stdin(loom, capsys):
    piped = loom("generate", "-", "-m", "6", input="Once upon a time")
    assert main(["generate", "Once upon a time", "-m", "6"]) == 0
    assert piped.returncode == 0 and piped.stdout == capsys.readouterr().out


def test_a_prompt_given_twice_is_a_usage_error(capsys):
    assert main(["generate", "Hello", "--prompt", "Bye"]) == 2
    assert "the prompt was given twice" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--ignore-chat-template", "--no-chat-template"])
def test_ignore_chat_template_feeds_raw_text_like_mlx_lm(flag, capsys):
    from mlx_loom import BUNDLED_MODEL

    raw = len(Tokenizer.from_dir(BUNDLED_MODEL).encode("hello world"))
    assert main(["generate", "hello world", "-m", "2", flag]) == 0
    assert f"Prompt: {raw} tokens" in capsys.readouterr().err


def test_system_prompt_is_mlx_lms_spelling_of_system(capsys):
    assert main(["generate", "hi", "-m", "2", "--system-prompt", "be brief"]) == 0
    with_system = capsys.readouterr().err
    assert main(["generate", "hi", "-m", "2", "--system", "be brief"]) == 0
    assert (
        with_system.split("Prompt:")[1].split(",")[0]
        == (capsys.readouterr().err.split("Prompt:")[1].split(",")[0])
    )


@pytest.mark.parametrize("command", [["generate", "-m", "500"], ["chat", "-m", "500"]])
def test_a_closed_pipe_ends_quietly_with_141(command, loom_env, tmp_path):
    """``loom generate | head -c 20``: no BrokenPipeError traceback."""
    proc = subprocess.Popen(
        [*loom_command(), *command],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=loom_env,
        cwd=tmp_path,
    )
    proc.stdin.write(b"Tell me a long story\n" * 3)
    proc.stdin.close()
    assert proc.stdout.read(20)
    proc.stdout.close()  # what `head` does once it has enough
    err = proc.stderr.read().decode()
    assert proc.wait(60) == 141
    assert "Traceback" not in err and "BrokenPipe" not in err


def test_kv_bits_works_on_the_bundled_model_with_default_flags(loom):
    result = loom("generate", "Once upon a time", "-m", "8", "--kv-bits", "4", "--verbose")
    assert result.returncode == 0, result.stderr
    assert "kv cache: 4-bit, group 32" in result.stderr  # 64 does not divide head_dim 32
    assert "Generation: 8 tokens" in result.stderr


def test_kv_bits_8_works_on_the_bundled_model_too(capsys):
    assert main(["generate", "-m", "8", "--kv-bits", "8", "--verbose"]) == 0
    assert "kv cache: 8-bit, group 32" in capsys.readouterr().err


def test_an_explicit_kv_group_size_that_cannot_fit_names_the_one_that_does(capsys):
    assert main(["generate", "-m", "4", "--kv-bits", "4", "--kv-group-size", "64"]) == 2
    err = capsys.readouterr().err
    assert "--kv-group-size 64 does not divide this model's head dimension (32)" in err
    assert "fix: pass --kv-group-size 32" in err


@pytest.mark.parametrize("model_type", FAMILIES)
def test_kv_bits_default_group_size_works_for_every_family(short_context, model_type, capsys):
    code = main(
        ["generate", "hi", "--model", str(short_context[model_type]), "-m", "6", "--kv-bits", "4"]
    )
    assert code == 0, capsys.readouterr().err


def test_m_is_max_tokens_as_in_mlx_lm(capsys):
    assert main(["generate", "hi", "-m", "3"]) == 0
    assert "Generation: 3 tokens" in capsys.readouterr().err


def test_generate_with_max_new_tokens_suggests_max_tokens():
    import mlx_loom
    from mlx_loom.errors import RequestError

    model, tokenizer = mlx_loom.load("tiny")
    with pytest.raises(RequestError, match="did you mean 'max_tokens'"):
        mlx_loom.generate(model, tokenizer, "hi", max_new_tokens=4)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_max_kv_size_is_the_apis_sliding_window_for_every_family(short_context, model_type, capsys):
    import mlx_loom

    path = str(short_context[model_type])
    prompt = "one two three four five six seven eight nine ten eleven twelve"
    argv = ["generate", prompt, "--model", path, "-m", "10", "--no-chat-template"]
    assert main([*argv, "--max-kv-size", "6"]) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    model, tokenizer = mlx_loom.load(path)
    expected = mlx_loom.generate(model, tokenizer, prompt, max_tokens=10, max_kv_size=6)
    assert printed.split("==========")[0].strip() == expected.strip()


def test_max_kv_size_out_of_range_is_a_usage_error_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "hi", "--max-kv-size", "0"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "argument --max-kv-size" in err and "fix: pass a positive token count" in err


def test_json_schema_and_grammar_files_hold_the_output(tmp_path, capsys):
    import json

    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"], "additionalProperties": False,
    }))
    args = ["generate", "hi", "-m", "40", "--temp", "1.0", "--seed", "3"]
    assert main([*args, "--json-schema", str(schema)]) == 0
    value = json.loads(capsys.readouterr().out)
    assert set(value) == {"n"} and 0 <= value["n"] <= 9
    grammar = tmp_path / "g.gbnf"
    grammar.write_text('root ::= "yes" | "no"')
    assert main([*args, "--grammar", str(grammar)]) == 0
    assert capsys.readouterr().out.strip() in ("yes", "no")


def test_a_bad_schema_file_is_refused_naming_the_problem(tmp_path, capsys):
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "array", "uniqueItems": true}')
    assert main(["generate", "hi", "-m", "4", "--json-schema", str(schema)]) != 0
    assert "uniqueItems" in capsys.readouterr().err
    assert main(["generate", "hi", "--json-schema", str(schema), "--grammar", str(schema)]) == 2
