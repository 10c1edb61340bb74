"""`app.py`: flags and environment variables, and bad settings refused with a message before anything is served."""

from __future__ import annotations

import pytest

import app


def test_flags_default_to_the_bundled_model_on_localhost(monkeypatch):
    for name in ("PLAYGROUND_MODEL", "PLAYGROUND_DRAFT_MODEL", "PLAYGROUND_DEVICE", "PLAYGROUND_HOST",
                 "PLAYGROUND_PORT", "SPACE_ID", "GRADIO_SERVER_NAME", "GRADIO_SERVER_PORT"):
        monkeypatch.delenv(name, raising=False)
    args = app.parse_args([])
    assert (args.model, args.draft_model, args.device, args.dtype, args.host, args.port, args.max_seq_len) == \
        ("bundled", "none", "auto", "auto", "127.0.0.1", 7860, 2048)


def test_environment_and_flags(monkeypatch):
    monkeypatch.setenv("PLAYGROUND_HOST", "0.0.0.0")
    monkeypatch.setenv("PLAYGROUND_PORT", "7999")
    monkeypatch.setenv("SPACE_ID", "someone/playground")
    args = app.parse_args(["--dtype", "bfloat16"])
    assert (args.host, args.port, args.dtype) == ("0.0.0.0", 7999, "bfloat16")
    assert args.model == "HuggingFaceTB/SmolLM2-135M-Instruct"  # a Space has no bundled package
    assert app.parse_args(["--model", "bundled"]).model == "bundled"


def test_draft_model_flag_and_environment(monkeypatch):
    monkeypatch.delenv("PLAYGROUND_DRAFT_MODEL", raising=False)
    assert app.parse_args(["--draft-model", "some/draft-model"]).draft_model == "some/draft-model"
    monkeypatch.setenv("PLAYGROUND_DRAFT_MODEL", "/models/draft")
    assert app.parse_args([]).draft_model == "/models/draft"
    assert app.parse_args(["--draft-model", "none"]).draft_model == "none"  # the flag wins over the environment


def test_serving_flag_and_environment(monkeypatch, capsys):
    monkeypatch.delenv("PLAYGROUND_SERVING", raising=False)
    assert app.parse_args([]).serving == "fastest"
    monkeypatch.setenv("PLAYGROUND_SERVING", "reference")
    assert app.parse_args([]).serving == "reference"
    assert app.parse_args(["--serving", "fastest"]).serving == "fastest"
    with pytest.raises(SystemExit) as exit:
        app.parse_args(["--serving", "quickest"])
    assert exit.value.code == 2 and "invalid choice: 'quickest'" in capsys.readouterr().err
    monkeypatch.setenv("PLAYGROUND_SERVING", "quickest")
    with pytest.raises(SystemExit) as exit:
        app.parse_args([])
    assert exit.value.code == 2 and "PLAYGROUND_SERVING must be one of fastest, reference" in capsys.readouterr().err


def test_draft_model_with_another_tokenizer_exits_with_a_message(tmp_path, capsys, monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    from tiny_models import TINY, write_word_level_tokenizer

    monkeypatch.delenv("PLAYGROUND_DRAFT_MODEL", raising=False)
    LlamaForCausalLM(LlamaConfig(**TINY)).save_pretrained(str(tmp_path))  # 256 word-level tokens
    write_word_level_tokenizer(tmp_path)
    assert app.main(["--model", "bundled", "--draft-model", str(tmp_path), "--device", "cpu",
                     "--max-seq-len", "256"]) == 2
    assert "has a different tokenizer from 'bundled'" in capsys.readouterr().err


def test_max_run_seconds_flag_and_environment(monkeypatch, capsys):
    monkeypatch.delenv("PLAYGROUND_MAX_RUN_SECONDS", raising=False)
    assert app.parse_args([]).max_run_seconds == 180.0
    monkeypatch.setenv("PLAYGROUND_MAX_RUN_SECONDS", "600")
    assert app.parse_args([]).max_run_seconds == 600.0
    assert app.parse_args(["--max-run-seconds", "30"]).max_run_seconds == 30.0
    assert app.main(["--max-run-seconds", "0", "--device", "cpu"]) == 2
    assert "--max-run-seconds must be positive, got 0" in capsys.readouterr().err


def test_bad_settings_exit_with_a_message(capsys):
    assert app.main(["--dtype", "float8"]) == 2
    assert "unknown dtype 'float8'" in capsys.readouterr().err
    assert app.main(["--device", "tpu"]) == 2
    assert "unknown device 'tpu'" in capsys.readouterr().err
