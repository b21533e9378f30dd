"""Bad flag values are one-line usage errors naming the flag; fixes speak in flags."""

from __future__ import annotations

import pytest

from mlx_loom.cli.flags import speak_flags
from mlx_loom.cli.main import main

OUT_OF_RANGE = [
    (["generate", "--temp", "-1"], "--temp", "--temp 0"),
    (["generate", "--temp", "nan"], "--temp", "--temp 0"),
    (["generate", "--top-p", "0"], "--top-p", "--top-p 1.0"),
    (["generate", "--top-p", "1.5"], "--top-p", "--top-p 1.0"),
    (["generate", "--top-k", "-3"], "--top-k", "--top-k 0"),
    (["generate", "--min-p", "2"], "--min-p", "--min-p 0"),
    (["generate", "--max-tokens", "0"], "--max-tokens", "--max-tokens 64"),
    (["generate", "-m", "many"], "--max-tokens", "--max-tokens 64"),
    (["generate", "--repetition-penalty", "0"], "--repetition-penalty", "--repetition-penalty"),
    (["generate", "--presence-penalty", "inf"], "--presence-penalty", "--presence-penalty"),
    (["generate", "--seed", "-1"], "--seed", "--seed 42"),
    (["generate", "--kv-bits", "7"], "--kv-bits", "--kv-bits 4"),
    (["generate", "--kv-group-size", "48"], "--kv-group-size", "--kv-group-size 32"),
    (["generate", "--quantized-kv-start", "-1"], "--quantized-kv-start", "--quantized-kv-start 0"),
    (["generate", "--prefill-step-size", "0"], "--prefill-step-size", "--prefill-step-size"),
    (["generate", "--num-draft-tokens", "0"], "--num-draft-tokens", "--num-draft-tokens 3"),
    (["chat", "--max-kv-size", "0"], "--max-kv-size", "--max-kv-size"),
    (["chat", "--temp", "-0.5"], "--temp", "--temp 0"),
    (["serve", "--port", "99999"], "--port", "--port 8080"),
    (["serve", "--port", "-1"], "--port", "--port 0"),
    (["serve", "--max-tokens-limit", "0"], "--max-tokens-limit", "--max-tokens-limit 4096"),
]


@pytest.mark.parametrize(("argv", "flag", "in_fix"), OUT_OF_RANGE)
def test_an_out_of_range_value_is_a_usage_error_naming_the_flag(argv, flag, in_fix, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    error, fix = capsys.readouterr().err.strip().split("\n")  # exactly two lines
    assert error.startswith(f"loom {argv[0]}: error: argument {flag}")
    assert fix.startswith("fix: ") and in_fix in fix
    assert "=" not in fix  # no Python-API spellings such as temperature=0


def test_out_of_range_values_exit_2_from_the_real_command_without_a_traceback(loom):
    for argv, flag in (
        (["serve", "--port", "99999"], "--port"),
        (["generate", "--temp", "-1"], "--temp"),
    ):
        result = loom(*argv)
        assert result.returncode == 2
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 2 and f"argument {flag}" in lines[0] and flag in lines[1]
        assert "Traceback" not in result.stderr and "usage:" not in result.stderr


def test_an_unknown_flag_points_at_help_in_two_lines(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--tempreature", "1"])
    error, fix = capsys.readouterr().err.strip().split("\n")
    assert "unrecognized arguments: --tempreature" in error
    assert fix == "fix: run `loom generate --help` to see the options"


def test_kv_bits_help_says_what_it_accepts(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--kv-bits {2,3,4,5,6,8}" in help_text
    assert "4 and 8 are the usual choices" in help_text


def test_a_pinned_backend_refusal_names_the_kernel_backend_flag(loom):
    result = loom("generate", "--kernel-backend", "metal", "-m", "2")
    assert result.returncode == 3
    assert "--kernel-backend cpu" in result.stderr
    assert "kernel_backend=" not in result.stderr


@pytest.mark.parametrize(
    ("api", "cli"),
    [
        ("pin one that runs here (e.g. kernel_backend='cpu').", "(e.g. --kernel-backend cpu)."),
        ("pass temperature=0 for greedy decoding", "pass --temp 0 for greedy decoding"),
        ("pass top_p=1.0 to disable", "pass --top-p 1.0 to disable"),
        ("omit repetition_penalty (or pass 1.0)", "omit --repetition-penalty (or pass 1.0)"),
        ("use one of [4, 8] for kv_bits, or None", "use one of [4, 8] for --kv-bits, or None"),
        ("Pass a positive max_tokens.", "Pass a positive --max-tokens."),
    ],
)
def test_fixes_from_the_engine_are_rewritten_in_flags(api, cli):
    assert cli in speak_flags(api)


def test_plain_words_are_not_mistaken_for_flags():
    text = "raise the temperature, or pass a seed such as 42; see top-p sampling"
    assert speak_flags(text) == text
