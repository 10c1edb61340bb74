"""Peers of `bench` that run in a process of their own (`inference_core.bench.process_peers`): the bench's rows for
them, driven through a fake peer (`fake_peer.py`: our engine behind the peers' protocol) on a tiny model. What each
row must hold: the measured numbers, the host it ran on, its greedy tokens checked against our row's (where they part,
named); a peer that cannot start becomes a row that says why, and the bench goes on."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from tiny_models import build_tiny_model

from inference_core.bench import process_peers
from inference_core.bench.llama_cpp import PeerUnavailable
from inference_core.bench.process_peers import PeerSpec, ProcessPeer, parse_peer, token_check
from inference_core import Engine, EngineConfig, SamplingParams
from inference_core.cli import main

FAKE = PeerSpec("fake", (), str(Path(__file__).with_name("fake_peer.py")), ("ours", "shifted", "broken"),
                "directory", "directory")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-process-peers"))


@pytest.fixture
def fake_peer(monkeypatch, tmp_path):
    monkeypatch.setenv("INFERENCE_CORE_CACHE", str(tmp_path / "cache"))  # the peer's log goes under the cache
    monkeypatch.setitem(process_peers.PEERS, "fake", FAKE)
    monkeypatch.setattr("inference_core.bench.speed.ALL_PEERS", ("llama-cpp", "llama-bench", *process_peers.PEERS))


def test_bench_rows_of_a_process_peer(tiny, fake_peer, tmp_path, capsys):
    path = tmp_path / "bench.json"
    assert main(["bench", "--model", tiny.name, "--device", "cpu", "--dtype", "float32", "--prompt-ids", "plain-1",
                 "--repeats", "2", "--max-new-tokens", "8", "--configs", "paged", "--no-hf", "--long-prompt-tokens",
                 "32", "--peer", "fake", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    rows = {row["name"]: row for row in report["rows"]}
    assert list(rows) == ["paged", "fake (directory, ours)", "fake (directory, shifted)",
                          "fake (directory, broken)"]
    ours, shifted = rows["fake (directory, ours)"], rows["fake (directory, shifted)"]
    for row in (ours, shifted):
        assert row["runs"] == 2 and row["decode_tokens_per_s"] > 0 and row["prefill_long_tokens_per_s"] > 0
        assert row["version"] == "fake 1.0" and row["threads"] >= 1 and row["host"]["threads"] == row["threads"]
        assert row["host"]["cpu"] and isinstance(row["host"]["flags"], list)
    # Our engine behind the protocol decodes what our row does; the shifted one parts at its fourth token.
    assert ours["token_check"] == {"against": "paged", "first_difference": {"plain-1": None}, "equal": True}
    assert shifted["token_check"]["first_difference"] == {"plain-1": 3} and not shifted["token_check"]["equal"]
    broken = rows["fake (directory, broken)"]
    assert broken["runs"] == 0 and "this fake engine does not open" in broken["absent"]
    assert [pair["peer"] for pair in report["ours_vs_peers"]] == ["fake (directory, ours)",
                                                                 "fake (directory, shifted)"]
    assert all(pair["prefill_ratio"] > 0 for pair in report["ours_vs_peers"])
    printed = capsys.readouterr().out
    assert "fake (directory, shifted): greedy tokens differ from paged's: plain-1 at token 3" in printed
    assert "fake (directory, ours): greedy tokens equal to paged's" in printed
    assert ("| fake (directory, broken) | absent: fake (directory, broken) did not start: could not open the "
            "engine: RuntimeError: this fake engine does not open |") in printed


def test_a_peer_precision_is_chosen_by_name(tiny, fake_peer, tmp_path):
    path = tmp_path / "bench.json"
    assert main(["bench", "--model", tiny.name, "--device", "cpu", "--dtype", "float32", "--prompt-ids", "plain-1",
                 "--repeats", "1", "--max-new-tokens", "4", "--configs", "paged", "--no-hf", "--long-prompt-tokens",
                 "0", "--peer", "fake:shifted", "--json", str(path)]) == 0
    assert [row["name"] for row in json.loads(path.read_text())["rows"]] == ["paged", "fake (directory, shifted)"]


def test_peer_names_and_precisions_are_checked():
    known = ("llama-cpp", "openvino", "onnxruntime-genai")
    assert parse_peer("openvino", known) == ("openvino", None)
    assert parse_peer("onnxruntime-genai:int4+fp32", known) == ("onnxruntime-genai", ("int4", "fp32"))
    with pytest.raises(ValueError, match="unknown peer vllm; choose from: llama-cpp, openvino"):
        parse_peer("vllm", known)
    with pytest.raises(ValueError, match="runs int4, int8, fp32 on a CPU, not 'fp8'"):
        parse_peer("onnxruntime-genai:fp8", known)
    with pytest.raises(ValueError, match="llama-cpp takes no precisions"):
        parse_peer("llama-cpp:f16", known)
    with pytest.raises(SystemExit):  # argparse says which peers there are
        main(["bench", "--peer", "vllm", "--no-hf"])


def test_the_token_check_stops_at_the_reference_end_of_sequence():
    reference = {"a": [5, 6, 2, 9, 9], "b": [7, 8, 9]}
    # After the end of sequence (2) the engines differ in how they ignore it: not counted.
    assert token_check({"a": [5, 6, 2, 4, 4], "b": [7, 8, 9]}, reference, "ours", {2})["equal"]
    check = token_check({"a": [5, 1, 2], "b": [7, 8]}, reference, "ours", {2})
    assert check["first_difference"] == {"a": 1, "b": 2} and not check["equal"]  # b: a token short


def test_a_peer_that_dies_or_hangs_is_an_absent_row_not_a_failure(tmp_path, monkeypatch):
    script = tmp_path / "dies.py"
    script.write_text("import sys\nsys.exit(3)\n")
    with pytest.raises(PeerUnavailable, match=r"exited \(3\) to load its model"):
        ProcessPeer("dies", [sys.executable, str(script)], 1, {"log": str(tmp_path / "dies.log")}, 0, 0)
    script.write_text("import sys\nsys.stdin.read()\n")  # silent until its input ends
    monkeypatch.setattr(process_peers, "START_TIMEOUT_S", 1)
    with pytest.raises(PeerUnavailable, match="silent gave no answer within 1 s to load its model"):
        ProcessPeer("silent", [sys.executable, str(script)], 1, {"log": str(tmp_path / "silent.log")}, 0, 0)


REAL = process_peers.PEERS["ctranslate2"]


def test_a_real_peer_installs_converts_and_decodes_what_our_engine_does(tiny, monkeypatch, tmp_path):
    """CTranslate2, installed from the package registry into an environment of its own (seeing our environment's torch
    and transformers, which its converter needs, so only its own wheel is installed: seconds), converts the tiny model
    and decodes it in its own process: at float32 its greedy tokens are ours."""
    monkeypatch.setenv("INFERENCE_CORE_CACHE", str(tmp_path / "cache"))
    spec = PeerSpec("ctranslate2", REAL.packages[:1], REAL.worker, ("float32",), "convert", "CTranslate2",
                    convert=REAL.convert, shares_our_packages=True)
    monkeypatch.setitem(process_peers.PEERS, "ctranslate2", spec)
    runners, absent = process_peers.open_process_peers([("ctranslate2", None)], tiny.name, Path(tiny.name), 1, 128)
    assert absent == [] and list(runners) == ["ctranslate2 (CTranslate2, float32)"]
    peer = runners["ctranslate2 (CTranslate2, float32)"]
    try:
        prompt_ids = [1, 17, 33, 90, 5, 61]
        run = peer.run(prompt_ids, 12)
        ours = Engine(tiny, EngineConfig(kv_mode="paged")).complete(
            prompt_ids, SamplingParams(max_new_tokens=12, ignore_eos=True)).token_ids
        assert run["token_ids"] == list(ours) and run["decode_tokens_per_s"] > 0
        described = peer.describe()
        assert described["version"] == "ctranslate2 4.8.5" and "--quantization float32" in \
            described["conversion"]["command"]
    finally:
        peer.close()
    # The environment and the conversion are kept: a second bench starts from them.
    assert process_peers.environment(spec).endswith("venv/bin/python")
    assert process_peers.peer_model(spec, "unused", tiny.name, Path(tiny.name), "float32")[1] == \
        described["conversion"]
