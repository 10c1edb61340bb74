"""`python -m inference_core gpu-report --device cpu --smoke`: the GPU run's code on a tiny model of Qwen3-0.6B's
family, so that the one prepared GPU run cannot break unnoticed between GPU runs. The compiled rows are left out
here (their CPU compile is the compiled step's own tests' business); every other part runs as on a GPU."""

from __future__ import annotations

import json
import re

import pytest
import torch

from inference_core.cli import main

ROW_KEYS = {"shape", "name", "batch", "decode_tokens_per_s", "roofline_pct", "speedup_vs_hf"}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out, work = tmp_path_factory.mktemp("gpu-report"), tmp_path_factory.mktemp("gpu-report-checkpoints")
    status = main(["gpu-report", "--out", str(out), "--device", "cpu", "--smoke", "--work", str(work),
                   "--rows", "gather,flex,hf,hf-static-compiled", "--shapes", "qwen3-0.6b"])
    return status, json.loads((out / "gpu-report.json").read_text()), (out / "gpu-report.md").read_text(), work


def test_smoke_report_has_every_part(smoke):
    status, report, markdown, _ = smoke
    assert report["errors"] == [] and status == 0
    assert report["device"].startswith("cpu") and report["torch"] and report["copy_bandwidth_gb_s"] > 0
    rows = {row["name"]: row for row in report["rows"]}
    assert {"gather", "flex", "hf", "hf-static-compiled"} == set(rows)
    for row in rows.values():
        assert ROW_KEYS <= set(row) and row["shape"] == "qwen3-0.6b" and row["batch"] == 1
        assert row["decode_tokens_per_s"] > 0 and row["roofline_tokens_per_s"] > 0 and row["roofline_pct"] >= 0
    assert rows["hf-static-compiled"]["speedup_vs_hf"] == 1.0  # transformers' best row is the reference
    batch = {row["name"]: row for row in report["parts"]["batch"]["rows"]}
    assert {"continuous", "continuous+join16", "dynamic", "static", "hf-static", "hf-sequential"} == set(batch)
    assert batch["continuous"]["output_tokens"] == sum(report["parts"]["batch"]["output_lengths"])
    assert batch["hf-sequential"]["requests"] == 2  # the first requests only
    steps = report["parts"]["batch"]["steps"]  # each of our modes' timed steps by kind, their time shares adding up
    assert set(steps) == {"continuous", "continuous+join16", "dynamic", "static"}
    assert {"decode", "prefill"} <= set(steps["static"])
    assert all(abs(sum(kind["time_pct"] for kind in kinds.values()) - 100) < 0.5 for kinds in steps.values())
    profile = report["parts"]["batch"]["profile"]  # a profiled eager step of half the batch's most sequences
    assert profile["batch_size"] == 4 and profile["work"] == {"decode": 4 * profile["steps"]}  # decodes only
    assert sum(part["ms"] for part in profile["breakdown"]) == pytest.approx(profile["step_ms"])
    assert "an eager decode step of 4 sequences, profiled" in markdown
    serve = report["parts"]["serve"]
    assert [run["run"] for run in serve["runs"]] == ["race", "race", "chat turn", "API completion (streamed)"]
    assert all(run["tokens"] == 8 and run["ttft_ms"] > 0 for run in serve["runs"])
    assert serve["api_chunks"] > 0 and serve["kv_blocks_held_after"] == 0
    assert report["parts"]["tests"]["status"] == 0  # the CUDA tests are collected (they skip without a GPU)
    assert "GPU only" in report["parts"]["attention"]["skipped"]  # timed on a GPU only, and the report says so
    assert "attention kernel timing: skipped" in markdown
    assert "GPU only" in report["parts"]["int4"]["skipped"] and "int4 kernel timing: skipped" in markdown
    assert "| qwen3-0.6b | gather | 1 |" in markdown and "serving path" in markdown


def test_a_spent_budget_leaves_parts_out_and_still_writes(smoke, tmp_path):
    work = smoke[3]
    assert main(["gpu-report", "--out", str(tmp_path), "--device", "cpu", "--smoke", "--work", str(work),
                 "--budget-s", "0", "--parts", "device,decode,batch"]) == 0
    report = json.loads((tmp_path / "gpu-report.json").read_text())
    assert report["rows"] == [] and {"qwen3-0.6b graphs: budget", "qwen3-0.6b gather: budget"} <= set(
        report["left_out"])
    assert {"batch continuous: budget", "batch hf-static: budget"} <= set(report["left_out"])


def test_real_shapes_need_a_gpu(tmp_path):
    assert main(["gpu-report", "--out", str(tmp_path), "--device", "cpu"]) == 2


def test_a_row_past_its_cap_is_stopped_and_reported(smoke, tmp_path):
    """A compiled row runs in a process of its own: past its cap it is killed and the report lists it as left out,
    which is what keeps a compile that runs away from taking the rest of the report."""
    from inference_core.bench.gpu_report import RowStopped, row_in_child

    work = smoke[3]
    with pytest.raises(RowStopped, match=r"stopped after \d+ s \(its cap\)"):
        row_in_child(work / "qwen3-0.6b", "graphs", torch.device("cpu"), 8, 1, cap=0.05)


def test_goal_rows_of_every_shape_run_before_the_other_rows():
    from inference_core.bench.gpu_report import decode_order

    order = decode_order(["llama-3-8b", "qwen3-0.6b"], ["gather", "graphs", "hf", "graphs+int4", "hf-static-compiled"])
    assert order == [("llama-3-8b", "graphs"), ("llama-3-8b", "hf-static-compiled"), ("llama-3-8b", "graphs+int4"),
                     ("qwen3-0.6b", "graphs"), ("qwen3-0.6b", "hf-static-compiled"),
                     ("llama-3-8b", "gather"), ("llama-3-8b", "hf"),
                     ("qwen3-0.6b", "graphs+int4"), ("qwen3-0.6b", "gather"), ("qwen3-0.6b", "hf")]


def test_test_outcomes_are_read_from_verbose_lines_and_the_summary():
    """A run stopped at its share has only the -v lines of the tests that ended; a whole run has the summary too."""
    from inference_core.bench.gpu_report import parse_test_outcomes

    output = """tests/engine/test_cuda.py::test_a[paged] PASSED                      [  4%]
tests/engine/test_cuda.py::test_b FAILED                                [  8%]
tests/quant/test_quant_cuda.py::test_c[int4-None-dtype0] SKIPPED (no GPU) [ 12%]
=========================== short test summary info ============================
PASSED tests/engine/test_cuda.py::test_a[paged]
SKIPPED [1] tests/quant/test_quant_cuda.py:40: no GPU
FAILED tests/engine/test_cuda.py::test_b - AssertionError: ids differ
ERROR tests/kv/test_x.py - ImportError: nothing
"""
    assert parse_test_outcomes(output) == {
        "tests/engine/test_cuda.py::test_a[paged]": "PASSED", "tests/engine/test_cuda.py::test_b": "FAILED",
        "tests/quant/test_quant_cuda.py::test_c[int4-None-dtype0]": "SKIPPED"}
    assert parse_test_outcomes(output.split("=====")[0]) == {
        "tests/engine/test_cuda.py::test_a[paged]": "PASSED", "tests/engine/test_cuda.py::test_b": "FAILED",
        "tests/quant/test_quant_cuda.py::test_c[int4-None-dtype0]": "SKIPPED"}


def test_a_profiled_row_records_its_steps_and_a_trace(smoke, tmp_path):
    """What `row_in_child` adds for PROFILED_ROWS, on an eager engine (the compiled rows' compile is the compiled
    step's tests' business): the recorded steps' categories, which sum to the step, and the trace beside them."""
    from inference_core import Engine, EngineConfig
    from inference_core.bench.gpu_report import profile_engine
    from inference_core.model.loader import load_model

    loaded = load_model(str(smoke[3] / "qwen3-0.6b"), device="cpu", dtype="bfloat16")
    engine = Engine(loaded, EngineConfig(kv_mode="paged", max_num_seqs=1, max_seq_len=256))
    profile = profile_engine(engine, list(range(3, 19)), tmp_path / "trace.json.gz")
    assert profile["steps"] == 16 and profile["trace"] == "trace.json.gz"
    assert (tmp_path / "trace.json.gz").stat().st_size > 0
    assert abs(sum(part["ms"] for part in profile["breakdown"]) - profile["step_ms"]) < 1e-6
    assert engine.blocks_in_use() == 0


def test_trace_names_keep_to_plain_characters():
    from inference_core.bench.gpu_report import PROFILED_ROWS, trace_file

    names = [trace_file("llama-3-8b", row) for row in PROFILED_ROWS]
    assert "trace-llama-3-8b-graphs-steps8.json.gz" in names
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", name) for name in names)
