"""``loom generate`` and ``loom chat`` from the command line (in-process)."""

from __future__ import annotations

import io
import json

import pytest

from mlx_loom.cli.main import main


def test_generate_streams_text_and_ends_with_stats(llama_f32, capsys):
    code = main(["generate", "--model", str(llama_f32), "--prompt", "hello", "--max-tokens", "8"])
    out, err = capsys.readouterr()
    assert code == 0
    assert out.strip()
    assert "Prompt:" in err and "tokens-per-sec" in err
    assert "Generation: 8 tokens" in err
    assert "Peak memory:" in err


def test_generate_verbose_names_the_resolution(llama_f32, capsys):
    main(["generate", "--model", str(llama_f32), "-p", "hi", "-m", "2", "--verbose"])
    err = capsys.readouterr().err
    assert "profile: minicpm5/llama" in err and "implementation: minicpm5.llama" in err


def test_generate_without_chat_template_feeds_raw_text(llama_f32, capsys):
    from mlx_loom.text import Tokenizer

    tok = Tokenizer.from_dir(llama_f32)
    raw = len(tok.encode("hello world"))
    templated = len(tok.encode_chat([{"role": "user", "content": "hello world"}]))
    assert raw != templated
    main(
        [
            "generate",
            "--model",
            str(llama_f32),
            "-p",
            "hello world",
            "-m",
            "3",
            "--no-chat-template",
        ]
    )
    assert f"Prompt: {raw} tokens" in capsys.readouterr().err
    main(["generate", "--model", str(llama_f32), "-p", "hello world", "-m", "3"])
    assert f"Prompt: {templated} tokens" in capsys.readouterr().err


def test_generate_rejects_bad_sampling_as_a_usage_error(llama_f32, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", str(llama_f32), "-p", "hi", "--top-p", "2"])
    assert exit_info.value.code == 2
    assert "argument --top-p" in capsys.readouterr().err


def test_generate_with_kv_bits(llama_hd32, capsys):
    code = main(
        [
            "generate",
            "--model",
            str(llama_hd32),
            "-p",
            "hi",
            "-m",
            "6",
            "--kv-bits",
            "8",
            "--kv-group-size",
            "32",
        ]
    )
    assert code == 0


def test_generate_pinning_an_unavailable_backend_is_a_refusal(llama_f32, capsys):
    code = main(["generate", "--model", str(llama_f32), "-p", "hi", "--kernel-backend", "metal"])
    # The llama family needs no custom kernels; a pinned backend must still be runnable.
    assert code == 3
    assert "pins kernel backend 'metal'" in capsys.readouterr().err


def test_chat_keeps_the_conversation_and_its_cache(llama_f32, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("hello there\nwhat next\n/exit\n"))
    code = main(["chat", "--model", str(llama_f32), "-m", "6", "--stats"])
    out, err = capsys.readouterr()
    assert code == 0
    assert err.count("Generation:") == 2
    second_prompt = err.split("Prompt:")[2]
    assert "reused from cache" in second_prompt


def test_chat_reset_forgets_the_conversation(llama_f32, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n/reset\nhello\n"))
    assert main(["chat", "--model", str(llama_f32), "-m", "4"]) == 0
    assert "(conversation reset)" in capsys.readouterr().err


def test_explain_json_for_a_family_checkpoint(llama_f32, capsys):
    assert main(["explain", str(llama_f32), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["profile"] == "minicpm5/llama"
    assert summary["implementation"] == "minicpm5.llama"


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--max-tokens", "many"])
    assert exit_info.value.code == 2


def test_version_and_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert "mlx-loom" in capsys.readouterr().out
    assert main([]) == 2
