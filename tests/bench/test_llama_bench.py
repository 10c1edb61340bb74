"""`bench --peer llama-bench`: llama.cpp's own benchmark on the same GGUF. Its JSON is read into a bench row (tg128 as
decode, pp512 as the long prompt's prefill); where it cannot be built or the model is not a GGUF file, the row is
absent with the reason and the other rows still run, each with its own long-prompt prefill. A real run needs the
binary built once (`bench --peer llama-bench` builds it; minutes of CMake), so that test skips without it."""

from __future__ import annotations

import json
import stat

import pytest

from inference_core.bench import llama_bench
from inference_core.bench.llama_cpp import PeerUnavailable, peer_gguf_path
from inference_core.cli import main

from tiny_models import build_tiny_model

LLAMA_BENCH_JSON = [
    {"build_commit": "0c1e570", "build_number": 7000, "cpu_info": "AMD EPYC", "n_threads": 2, "type_k": "f16",
     "n_prompt": 512, "n_gen": 0, "avg_ts": 1234.5, "stddev_ts": 10.25},
    {"build_commit": "0c1e570", "build_number": 7000, "cpu_info": "AMD EPYC", "n_threads": 2, "type_k": "f16",
     "n_prompt": 0, "n_gen": 128, "avg_ts": 111.11, "stddev_ts": 1.5},
]


def test_llama_bench_json_becomes_a_bench_row(tmp_path):
    fake = tmp_path / "llama-bench"
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/args\ncat <<'END'\n{json.dumps(LLAMA_BENCH_JSON)}\nEND\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    row = llama_bench.run_llama_bench(peer_gguf_path("bundled"), threads=2, repetitions=3, binary=fake)
    assert row["name"] == "llama-bench (Q4_1 GGUF)" and row["quant"] == "Q4_1 (GGUF)" and row["kv"] == "llama.cpp (f16)"
    assert (row["decode_tokens_per_s"], row["prefill_long_tokens_per_s"], row["threads"], row["runs"]) == (
        111.11, 1234.5, 2, 3)
    assert row["llama_bench"]["build_commit"] == "0c1e570" and row["llama_bench"]["pp_stddev"] == 10.2
    args = (tmp_path / "args").read_text().split()
    assert args[args.index("-p") + 1] == "512" and args[args.index("-n") + 1] == "128"
    assert args[args.index("-t") + 1] == "2" and args[args.index("-fa") + 1] == "1" and "json" in args


def test_bench_runs_llama_bench_once_per_repeat_and_takes_medians(bundled, one_torch_thread, monkeypatch, tmp_path):
    """Interleaved with our rows: one llama-bench run per repeat (its stand-in here prints 111.11 and 1234.5 tok/s),
    the row the medians of its runs, and the ratio of our best row to it."""
    monkeypatch.setattr(llama_bench, "binary_dir", lambda source=None: tmp_path)
    fake = tmp_path / "llama-bench"
    fake.write_text(f"#!/bin/sh\necho \"$*\" >> {tmp_path}/runs\ncat <<'END'\n{json.dumps(LLAMA_BENCH_JSON)}\nEND\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    path = tmp_path / "bench.json"
    assert main(["bench", "--device", "cpu", "--dtype", "float32", "--prompt-ids", "plain-1", "--repeats", "2",
                 "--max-new-tokens", "4", "--configs", "paged", "--no-hf", "--long-prompt-tokens", "512", "--peer",
                 "llama-bench", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    paged, peer = report["rows"]
    check, *runs = (tmp_path / "runs").read_text().splitlines()  # the check on a short prompt, then the runs
    assert "-p 16 -n 2" in check and len(runs) == 2 and all("-p 512 -n 128" in run for run in runs)
    assert peer["runs"] == 2 and peer["llama_bench"]["tg_runs"] == [111.11, 111.11]
    assert (peer["decode_tokens_per_s"], peer["prefill_long_tokens_per_s"]) == (111.11, 1234.5)
    assert paged["prefill_long_tokens_per_s"] > 0 and report["long_prompt_tokens"] == 512
    (pair,) = report["ours_vs_peers"]
    assert pair["peer"] == "llama-bench (Q4_1 GGUF)" and pair["peer_decode_tokens_per_s"] == 111.11


def test_ik_llama_bench_is_the_same_row_from_its_own_build_with_repacking(monkeypatch, tmp_path):
    """`--peer ik-llama-bench`: ik_llama.cpp's llama-bench, built from ik-llama-cpp-python's source into a folder of its
    own, run with its run-time repacking (`-rtr 1`), its row named for it."""
    assert llama_bench.binary_dir(llama_bench.IK_LLAMA_CPP) != llama_bench.binary_dir()
    assert "-DLLAMA_BUILD_EXAMPLES=ON" in llama_bench.IK_LLAMA_CPP.build_flags  # its llama-bench is an example
    monkeypatch.setattr(llama_bench, "binary_dir", lambda source=None: tmp_path / source.peer)
    (tmp_path / "ik-llama-bench").mkdir()
    fake = tmp_path / "ik-llama-bench" / "llama-bench"
    fake.write_text(f"#!/bin/sh\necho \"$*\" >> {tmp_path}/runs\ncat <<'END'\n{json.dumps(LLAMA_BENCH_JSON)}\nEND\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    gguf = peer_gguf_path("bundled")
    binary = llama_bench.llama_bench_binary(gguf, 2, source=llama_bench.IK_LLAMA_CPP)
    row = llama_bench.run_llama_bench(gguf, 2, repetitions=1, binary=binary, source=llama_bench.IK_LLAMA_CPP)
    assert row["name"] == "ik-llama-bench (Q4_1 GGUF)" and row["kv"] == "ik_llama.cpp (f16)"
    assert row["llama_bench"]["package"] == "ik-llama-cpp-python 0.1.5"
    check, run = (tmp_path / "runs").read_text().splitlines()
    assert "-rtr 1" in check and "-rtr 1" in run
    fake.unlink()
    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.raises(PeerUnavailable, match="building ik-llama-bench needs cmake"):
        llama_bench.llama_bench_binary(source=llama_bench.IK_LLAMA_CPP)


def test_a_tree_without_its_build_info_script_gets_the_file_from_its_template(tmp_path):
    """ik-llama-cpp-python's distribution leaves out the script that writes common/build-info.cpp from git: the file
    is written from its template instead (and a tree that has the script is left to it)."""
    (tmp_path / "common").mkdir()
    (tmp_path / "common" / "build-info.cpp.in").write_text('int LLAMA_BUILD_NUMBER = @BUILD_NUMBER@;\n'
                                                          'char const *LLAMA_COMMIT = "@BUILD_COMMIT@";\n')
    llama_bench._write_build_info(tmp_path, llama_bench.IK_LLAMA_CPP)
    written = (tmp_path / "common" / "build-info.cpp").read_text()
    assert "= 0;" in written and '"ik-llama-cpp-python 0.1.5"' in written and "@" not in written
    (tmp_path / "common" / "build-info.cpp").unlink()
    (tmp_path / "common" / "cmake").mkdir()
    (tmp_path / "common" / "cmake" / "build-info-gen-cpp.cmake").write_text("")
    llama_bench._write_build_info(tmp_path, llama_bench.LLAMA_CPP)
    assert not (tmp_path / "common" / "build-info.cpp").exists()


def test_without_cmake_it_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(llama_bench, "binary_dir", lambda source=None: tmp_path / "none")
    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.raises(PeerUnavailable, match="building llama-bench needs cmake and c[+][+]"):
        llama_bench.llama_bench_binary()


def fake_binary(path, crashes: bool):
    """A stand-in llama-bench that prints the JSON above, or dies by SIGSEGV on any prompt (as llama.cpp's AMX path
    did on every prompt of an AMX host)."""
    body = "kill -SEGV $$" if crashes else f"cat <<'END'\n{json.dumps(LLAMA_BENCH_JSON)}\nEND"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_a_native_build_that_crashes_on_an_amx_cpu_gives_way_to_one_without_amx(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(llama_bench, "binary_dir", lambda source=None: tmp_path)
    fake_binary(tmp_path / "llama-bench", crashes=True)
    fake_binary(tmp_path / "llama-bench-no-amx", crashes=False)  # built already: no CMake in the test
    gguf = peer_gguf_path("bundled")
    assert llama_bench.crash(tmp_path / "llama-bench", gguf, 1) == "killed by signal 11 (SIGSEGV)"
    monkeypatch.setattr(llama_bench, "cpu_has_amx", lambda: True)
    assert llama_bench.llama_bench_binary(gguf, 1) == tmp_path / "llama-bench-no-amx"
    assert "llama.cpp issue 20824" in capsys.readouterr().out
    monkeypatch.setattr(llama_bench, "cpu_has_amx", lambda: False)  # without AMX there is nothing to leave out
    with pytest.raises(PeerUnavailable, match=r"crashed on a 16-token prompt: killed by signal 11 \(SIGSEGV\)"):
        llama_bench.llama_bench_binary(gguf, 1)
    fake_binary(tmp_path / "llama-bench", crashes=False)
    assert llama_bench.llama_bench_binary(gguf, 1) == tmp_path / "llama-bench"


def test_bench_on_a_model_that_is_no_gguf_reports_llama_bench_absent(tmp_path, capsys):
    tiny = build_tiny_model(tmp_path / "tiny")
    path = tmp_path / "bench.json"
    assert main(["bench", "--model", tiny.name, "--device", "cpu", "--dtype", "float32", "--prompt-ids",
                 "plain-1", "--repeats", "1", "--max-new-tokens", "4", "--configs", "paged", "--no-hf",
                 "--long-prompt-tokens", "64", "--peer", "llama-bench", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    paged, peer = report["rows"]
    assert report["long_prompt_tokens"] == 64 and paged["prefill_long_tokens_per_s"] > 0
    assert peer["name"] == "llama-bench (GGUF)" and peer["absent"].startswith("llama.cpp runs GGUF files only")
    assert "| llama-bench (GGUF) | absent:" in capsys.readouterr().out


@pytest.mark.skipif(not (llama_bench.binary_dir() / "llama-bench").is_file(),
                    reason="llama-bench is not built here (bench --peer llama-bench builds it once)")
def test_a_real_llama_bench_run_on_the_bundled_gguf():
    """The binary the bench would use: the native build, or the one without AMX where the native one crashes."""
    binary = llama_bench.llama_bench_binary(peer_gguf_path("bundled"), threads=1, build=False)
    row = llama_bench.run_llama_bench(peer_gguf_path("bundled"), threads=1, prompt_tokens=64, repetitions=1,
                                      binary=binary)
    assert row["decode_tokens_per_s"] > 0 and row["prefill_long_tokens_per_s"] > row["decode_tokens_per_s"]
    assert row["threads"] == 1 and row["llama_bench"]["build_commit"]
