"""The command line is a contract other tools rely on: `generate --json` and `bench --json` output shapes, several
prompts on one engine (the prefix cache carries over), and bad settings exiting with status 2 and a message."""

from __future__ import annotations

import json

import pytest

from inference_core.cli import main

STATS_KEYS = {"kv_mode", "prompt_tokens", "cached_prompt_tokens", "generated_tokens", "finish_reason", "ttft_ms",
              "prefill_tokens_per_s", "decode_tokens_per_s", "total_ms", "kv_bytes_in_use", "kv_bytes_reserved", "spec"}


def test_generate_json_runs_prompts_on_one_engine(bundled, capsys):
    code = main(["generate", "--prompt", "What is the capital of France?", "--prompt",
                 "What is the capital of Italy?", "--max-new-tokens", "6", "--kv", "paged", "--device", "cpu",
                 "--json"])
    assert code == 0
    results = json.loads(capsys.readouterr().out)
    assert [r["prompt"] for r in results] == ["What is the capital of France?", "What is the capital of Italy?"]
    for result in results:
        assert set(result) == {"prompt", "token_ids", "text", "stats"}
        assert set(result["stats"]) == STATS_KEYS
        assert result["stats"]["spec"] is None  # no speculation asked for
        assert len(result["token_ids"]) == result["stats"]["generated_tokens"] <= 6
    # The default system prompt and the chat scaffolding fill one 16-token block that the second prompt reuses.
    assert [r["stats"]["cached_prompt_tokens"] for r in results] == [0, 16]


def test_generate_with_prompt_lookup_reports_spec_stats(bundled, capsys):
    prompt = "Repeat exactly: the red fox, the red fox, the red fox, the red fox."
    plain_code = main(["generate", "--prompt", prompt, "--max-new-tokens", "24", "--device", "cpu", "--json"])
    plain = json.loads(capsys.readouterr().out)[0]
    code = main(["generate", "--prompt", prompt, "--max-new-tokens", "24", "--device", "cpu", "--spec", "ngram",
                 "--spec-k", "5", "--json"])
    (result,) = json.loads(capsys.readouterr().out)
    assert plain_code == code == 0 and result["token_ids"] == plain["token_ids"]
    spec = result["stats"]["spec"]
    assert spec["k"] == 5 and len(spec["accepted_by_position"]) == 5
    assert 0 < spec["accepted"] <= spec["drafted"] and spec["acceptance_rate"] == spec["accepted"] / spec["drafted"]


@pytest.mark.parametrize("spec_args", [["--spec", "early-exit", "--draft-layers", "20", "--spec-adaptive"],
                                       ["--spec", "draft", "--draft-model", "bundled", "--spec-k", "3"]])
def test_generate_with_model_drafts_matches_plain(bundled, capsys, spec_args):
    base = ["generate", "--prompt", "Name three rivers.", "--max-new-tokens", "20", "--device", "cpu", "--json"]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)[0]
    assert main(base + spec_args) == 0
    (result,) = json.loads(capsys.readouterr().out)
    assert result["token_ids"] == plain["token_ids"]
    assert result["stats"]["spec"]["drafted"] > 0


def test_a_draft_model_with_another_tokenizer_is_refused(tmp_path, capsys):
    from test_speculative import build_tiny

    build_tiny(tmp_path, seed=0, initializer_range=0.3)
    assert main(["generate", "--prompt", "hi", "--device", "cpu", "--spec", "draft", "--draft-model",
                 str(tmp_path)]) == 2
    assert "has a different tokenizer" in capsys.readouterr().err


def test_generate_streams_text(bundled, capsys):
    assert main(["generate", "--prompt", "Say hello.", "--max-new-tokens", "5", "--kv", "contiguous",
                 "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip()
    assert "decode" in captured.err and "tok/s" in captured.err


@pytest.mark.parametrize("argv, message", [
    (["generate", "--prompt", "hi", "--max-new-tokens", "0"], "max_new_tokens must be an integer of at least 1"),
    (["generate", "--prompt", "  "], "the prompt is empty"),
    (["generate", "--prompt", "hi", "--dtype", "float64"], "unknown dtype 'float64'"),
    (["generate", "--prompt", "hi", "--model", "./no-such-model"], "is neither 'bundled'"),
    (["generate", "--prompt", "hi", "--block-size", "0"], "block size must be a positive integer"),
    (["generate", "--prompt", "hi", "--spec", "draft"], "'draft' needs a draft model: pass --draft-model"),
    (["generate", "--prompt", "hi", "--spec", "ngram", "--draft-model", "bundled"], "used only with --spec draft"),
    (["generate", "--prompt", "hi", "--spec", "early-exit", "--draft-layers", "30"], "below the model's 30 layers"),
    (["generate", "--prompt", "hi", "--draft-layers", "3"], "used only with --spec early-exit"),
    (["bench", "--repeats", "0", "--no-hf"], "--repeats >= 1"),
    (["bench", "--prompts", "no-such-prompts.jsonl", "--no-hf"], "prompt file no-such-prompts.jsonl does not exist"),
])
def test_bad_settings_exit_2_with_a_message(argv, message, capsys):
    assert main(argv + ["--device", "cpu"]) == 2
    assert message in capsys.readouterr().err


def test_bench_json_rows(bundled, tmp_path, capsys):
    path = tmp_path / "bench.json"
    assert main(["bench", "--prompt-ids", "plain-1", "--repeats", "1", "--max-new-tokens", "4", "--device", "cpu",
                 "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert [row["name"] for row in report["rows"]] == ["contiguous", "paged", "hf-transformers"]
    for row in report["rows"]:
        assert {"name", "kv", "decode_tokens_per_s", "ttft_ms", "prefill_tokens_per_s", "roofline_pct"} <= set(row)
        assert row["decode_tokens_per_s"] > 0 and 0 < row["roofline_pct"] < 100
    assert report["rows"][-1]["speedup_vs_hf"] == 1.0
    assert report["read_bandwidth_gb_s"] > 0
    assert "| contiguous |" in capsys.readouterr().out
