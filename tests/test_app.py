"""`app.py`: flags and environment variables, and bad settings refused with a message before anything is served."""

from __future__ import annotations

import app


def test_flags_default_to_the_bundled_model_on_localhost(monkeypatch):
    for name in ("PLAYGROUND_MODEL", "PLAYGROUND_DEVICE", "PLAYGROUND_HOST", "PLAYGROUND_PORT", "SPACE_ID",
                 "GRADIO_SERVER_NAME", "GRADIO_SERVER_PORT"):
        monkeypatch.delenv(name, raising=False)
    args = app.parse_args([])
    assert (args.model, args.device, args.dtype, args.host, args.port, args.max_seq_len) == \
        ("bundled", "auto", "auto", "127.0.0.1", 7860, 2048)


def test_environment_and_flags(monkeypatch):
    monkeypatch.setenv("PLAYGROUND_HOST", "0.0.0.0")
    monkeypatch.setenv("PLAYGROUND_PORT", "7999")
    monkeypatch.setenv("SPACE_ID", "someone/playground")
    args = app.parse_args(["--dtype", "bfloat16"])
    assert (args.host, args.port, args.dtype) == ("0.0.0.0", 7999, "bfloat16")
    assert args.model == "HuggingFaceTB/SmolLM2-135M-Instruct"  # a Space has no bundled package
    assert app.parse_args(["--model", "bundled"]).model == "bundled"


def test_bad_settings_exit_with_a_message(capsys):
    assert app.main(["--dtype", "float8"]) == 2
    assert "unknown dtype 'float8'" in capsys.readouterr().err
    assert app.main(["--device", "tpu"]) == 2
    assert "unknown device 'tpu'" in capsys.readouterr().err


def test_zero_gpu_wraps_generation_in_spaces_gpu(monkeypatch):
    import sys
    import types

    from ui.layout import _gpu_task

    def handler():
        yield "token"

    assert _gpu_task(handler) is handler  # no `spaces` package: used as it is
    calls = []
    fake = types.ModuleType("spaces")
    fake.GPU = lambda duration: (lambda fn: calls.append((duration, fn)) or fn)
    monkeypatch.setitem(sys.modules, "spaces", fake)
    assert _gpu_task(handler) is handler and calls == [(120, handler)]
