"""`bench --peer llama-cpp`: without llama-cpp-python (or on a model that is not a GGUF file) the peer is an absent row
that says why and the other rows still run; with it, llama.cpp sees exactly our prompt tokens, ignores
end-of-sequence, produces the requested token count and starts each run from an empty KV cache. The tests that need
llama-cpp-python skip without it (it is an optional install, not in requirements-dev.txt: building it takes minutes)."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch

from inference_core.bench import llama_cpp as llama_cpp_peer
from inference_core.cli import main, parser
from inference_core.bench.llama_cpp import INSTALL_COMMAND, PeerUnavailable, open_peers, peer_gguf_path, row_name

CPU = ["--device", "cpu", "--dtype", "float32"]
SMALL_BENCH = ["bench", "--prompt-ids", "plain-1", "--repeats", "1", "--max-new-tokens", "4", *CPU, "--configs",
               "paged", "--no-hf", "--peer", "llama-cpp"]


def test_peer_flag_takes_repeats_and_comma_lists(capsys):
    args = parser().parse_args(["bench", "--peer", "llama-cpp,llama-cpp", "--peer", "llama-cpp"])
    assert args.peer == ["llama-cpp", "llama-cpp", "llama-cpp"]  # open_peers runs each peer once
    assert parser().parse_args(["bench"]).peer is None
    with pytest.raises(SystemExit) as exit_info:
        parser().parse_args(["bench", "--peer", "vllm"])
    assert exit_info.value.code == 2
    assert "unknown peer vllm; choose from: llama-cpp" in capsys.readouterr().err


def test_only_gguf_models_have_a_peer(tmp_path, capsys):
    assert peer_gguf_path("bundled").name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert row_name(peer_gguf_path("bundled")) == "llama.cpp (Q4_1 GGUF)"
    with pytest.raises(PeerUnavailable, match="llama.cpp runs GGUF files only: --model Qwen/Qwen3-0.6B is neither"):
        peer_gguf_path("Qwen/Qwen3-0.6B")
    runners, absent = open_peers(["llama-cpp"], str(tmp_path), context_len=64, kv_bytes_per_token=1024)
    assert runners == {}
    assert [row["name"] for row in absent] == ["llama.cpp (GGUF)"]
    assert absent[0]["absent"].startswith("llama.cpp runs GGUF files only")
    assert "llama.cpp (GGUF) absent: llama.cpp runs GGUF files only" in capsys.readouterr().out


def test_bench_reports_a_missing_llama_cpp_and_runs_the_other_rows(bundled, one_torch_thread, monkeypatch, tmp_path,
                                                                     capsys):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` now raises ImportError
    path = tmp_path / "bench.json"
    assert main([*SMALL_BENCH, "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    paged, peer = report["rows"]
    assert paged["name"] == "paged" and paged["decode_tokens_per_s"] > 0 and paged["runs"] == 1
    assert peer["name"] == "llama.cpp (Q4_1 GGUF)" and peer["runs"] == 0 and peer["decode_tokens_per_s"] is None
    assert peer["absent"] == f"llama-cpp-python is not installed; install it with: {INSTALL_COMMAND}"
    assert set(peer) == set(paged) | {"absent"}  # the same fields, numbers left empty
    assert report["ours_vs_peers"] == []
    out = capsys.readouterr().out
    assert f"| llama.cpp (Q4_1 GGUF) | absent: llama-cpp-python is not installed; install it with: {INSTALL_COMMAND}" \
           in out
    assert "| paged |" in out and "ours best /" not in out


def test_a_llama_cpp_that_crashes_on_a_prompt_is_an_absent_peer_not_a_crashed_bench(monkeypatch):
    """The check runs llama-cpp-python on a short prompt in a child process: a crash there (llama.cpp's AMX path on an
    AMX host) makes the peer absent, with the reinstall that leaves AMX out, instead of ending the bench."""
    monkeypatch.setattr(llama_cpp_peer, "_CHECK", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    assert llama_cpp_peer.crash.__wrapped__(peer_gguf_path("bundled"), 1) == "killed by signal 11 (SIGSEGV)"
    monkeypatch.setattr(llama_cpp_peer, "_CHECK", "pass")
    assert llama_cpp_peer.crash.__wrapped__(peer_gguf_path("bundled"), 1) is None
    monkeypatch.setitem(sys.modules, "llama_cpp", types.ModuleType("llama_cpp"))  # importable, never reached
    monkeypatch.setattr(llama_cpp_peer, "crash", lambda path, threads: "killed by signal 11 (SIGSEGV)")
    monkeypatch.setattr(llama_cpp_peer, "cpu_has_amx", lambda: True)
    with pytest.raises(PeerUnavailable) as error:
        llama_cpp_peer.open_llama_cpp("bundled", 64, 1024, 1)
    assert str(error.value) == (
        "llama-cpp-python crashed on a 16-token prompt here (killed by signal 11 (SIGSEGV)); this CPU has AMX, whose "
        "llama.cpp path crashes on some hosts (llama.cpp issue 20824): reinstall llama-cpp-python without it: "
        f"{llama_cpp_peer.NO_AMX_INSTALL_COMMAND}")
    assert "-mno-amx-int8" in llama_cpp_peer.NO_AMX_INSTALL_COMMAND


# --- with llama-cpp-python installed ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama(bundled):
    pytest.importorskip("llama_cpp")
    from inference_core.bench.llama_cpp import open_llama_cpp

    return open_llama_cpp("bundled", context_len=1024,
                          kv_bytes_per_token=bundled.config.kv_bytes_per_token(torch.float16), threads=1)


def test_llama_cpp_tokenizes_our_chat_text_into_our_ids(llama, bundled, bench_prompts):
    from inference_core import Engine, EngineConfig

    engine = Engine(bundled, EngineConfig(kv_mode="none"))
    for prompt_id in ("chat-short-1", "code-2", "grounded-1", "long-2"):
        row = bench_prompts[prompt_id]
        messages = ([{"role": "system", "content": row["system"]}] if row.get("system") else []) + [
            {"role": "user", "content": row["prompt"]}]
        text = engine.tokenizer.apply_chat_template(messages)
        ids = engine.prompt_ids(row["prompt"], row.get("system"))
        assert llama.llm.tokenize(text.encode(), add_bos=False, special=True) == ids, prompt_id
        assert llama.check_tokens(ids), prompt_id


def test_llama_cpp_greedy_run_gives_every_token_from_a_cold_cache(llama, bundled, bench_prompts):
    from inference_core import Engine, EngineConfig

    engine = Engine(bundled, EngineConfig(kv_mode="none"))
    first, other = (engine.prompt_ids(bench_prompts[i]["prompt"]) for i in ("chat-short-1", "code-2"))
    timings = llama.run(first, 8)
    first_ids = llama.last_token_ids
    assert len(first_ids) == 8  # end-of-sequence is never checked
    assert timings["ttft_ms"] > 0 and timings["decode_tokens_per_s"] > 0
    assert timings["prefill_tokens_per_s"] == pytest.approx(len(first) / (timings["ttft_ms"] / 1e3))
    llama.run(other, 8)
    llama.run(first, 8)  # after another prompt: a stale KV entry would change these ids
    assert llama.last_token_ids == first_ids


def test_bench_with_llama_cpp_reports_the_ratio(bundled, one_torch_thread, tmp_path, capsys):
    pytest.importorskip("llama_cpp")
    path = tmp_path / "bench.json"
    assert main([*SMALL_BENCH, "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    paged, peer = report["rows"]
    assert peer["name"] == "llama.cpp (Q4_1 GGUF)" and peer["runs"] == 1 and "absent" not in peer
    assert peer["quant"] == "Q4_1 (GGUF)" and peer["prompt_tokens_match"] is True and peer["threads"] == 1
    assert peer["weights_mib"] == round(peer_gguf_path("bundled").stat().st_size / 2**20, 1)
    assert 0 < peer["roofline_pct"] < 100
    (pair,) = report["ours_vs_peers"]
    assert pair["ours"] == "paged" and pair["peer"] == "llama.cpp (Q4_1 GGUF)"
    assert pair["ratio"] == round(paged["decode_tokens_per_s"] / peer["decode_tokens_per_s"], 2)
    assert "ours best / llama.cpp (Q4_1 GGUF), decode: paged" in capsys.readouterr().out
