"""The command line is a contract other tools rely on: `generate --json`, `bench --json` and `batch-bench --json`
output shapes, several prompts on one engine (the prefix cache carries over), batched prompts giving the same greedy
ids as prompts run in turn (also when a tiny KV pool forces preemption), and bad settings exiting with status 2 and a
message."""

from __future__ import annotations

import contextlib
import io
import json
import random

import pytest

from inference_core.bench import batching
from inference_core.bench.batching import ROW_KEYS, parse_arrivals, percentile, rate_sweep, run_engine
from inference_core.bench.latency import LatencyTargets
from inference_core.bench.speed import paired_roofline_pct
from inference_core.cli import main
from inference_core.config import EngineConfig
from inference_core.engine.engine import Engine

STATS_KEYS = {"kv_mode", "prompt_tokens", "cached_prompt_tokens", "generated_tokens", "finish_reason", "ttft_ms",
              "prefill_tokens_per_s", "decode_tokens_per_s", "total_ms", "kv_bytes_in_use", "kv_bytes_reserved", "spec",
              "preemptions", "queue_ms", "batch_size_mean", "compile", "grammar_ms"}
# The CLI's default dtype is auto (bf16 on CPUs with native bf16 math); these tests compare runs id for id in fp32.
CPU = ["--device", "cpu", "--dtype", "float32"]
THREE_PROMPTS = ["What is the capital of France?", "Name three rivers.", "Say hello."]


def test_generate_json_runs_prompts_on_one_engine(bundled, capsys):
    code = main(["generate", "--prompt", "What is the capital of France?", "--prompt",
                 "What is the capital of Italy?", "--max-new-tokens", "6", "--kv", "paged", *CPU,
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
    plain_code = main(["generate", "--prompt", prompt, "--max-new-tokens", "24", *CPU, "--json"])
    plain = json.loads(capsys.readouterr().out)[0]
    code = main(["generate", "--prompt", prompt, "--max-new-tokens", "24", *CPU, "--spec", "ngram",
                 "--spec-k", "5", "--json"])
    (result,) = json.loads(capsys.readouterr().out)
    assert plain_code == code == 0 and result["token_ids"] == plain["token_ids"]
    spec = result["stats"]["spec"]
    assert spec["k"] == 5 and len(spec["accepted_by_position"]) == 5
    assert 0 < spec["accepted"] <= spec["drafted"] and spec["acceptance_rate"] == spec["accepted"] / spec["drafted"]


@pytest.mark.parametrize("spec_args", [["--spec", "early-exit", "--draft-layers", "20", "--spec-adaptive"],
                                       ["--spec", "draft", "--draft-model", "bundled", "--spec-k", "3"]])
def test_generate_with_model_drafts_matches_plain(bundled, capsys, spec_args):
    base = ["generate", "--prompt", "Name three rivers.", "--max-new-tokens", "20", *CPU, "--json"]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)[0]
    assert main(base + spec_args) == 0
    (result,) = json.loads(capsys.readouterr().out)
    assert result["token_ids"] == plain["token_ids"]
    assert result["stats"]["spec"]["drafted"] > 0


def test_a_draft_model_with_another_tokenizer_is_refused(tmp_path, capsys):
    from tiny_models import build_tiny

    build_tiny(tmp_path, seed=0, initializer_range=0.3)
    assert main(["generate", "--prompt", "hi", *CPU, "--spec", "draft", "--draft-model",
                 str(tmp_path)]) == 2
    assert "has a different tokenizer" in capsys.readouterr().err


def test_generate_n_logprobs_and_a_constraint(bundled, capsys):
    """--n copies sampled with seed + i, --logprobs per token in --json, --constraint holding the output to a choice,
    and the sampling flags reaching the engine (a logit bias of 100 forces its token)."""
    assert main(["generate", "--prompt", "Is the sky blue?", "--max-new-tokens", "4", *CPU, "--batching", "continuous",
                 "--n", "3", "--temperature", "1.0", "--seed", "5", "--logprobs", "2", "--constraint", "choice",
                 "--constraint-spec", "yes|no|maybe", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert len(results) == 3 and all(r["text"] in ("yes", "no", "maybe") for r in results)
    assert [r["stats"]["cached_prompt_tokens"] for r in results][1:] == [32, 32]  # the copies share the prompt's blocks
    first = results[0]["logprobs"][0]
    assert first["token_id"] == results[0]["token_ids"][0] and len(first["top"]) == 2 and first["logprob"] <= 0
    forced = bundled.tokenizer.encode(" banana", add_special_tokens=False)[0]
    assert main(["generate", "--prompt", "hi", "--max-new-tokens", "3", *CPU, "--logit-bias", f"{forced}:100",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["token_ids"] == [forced] * 3


def test_generate_streams_text(bundled, capsys):
    assert main(["generate", "--prompt", "Say hello.", "--max-new-tokens", "5", "--kv", "contiguous",
                 *CPU]) == 0
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
    (["generate", "--prompt", "a", "--prompt", "b", "--batching", "continuous", "--priority", "1"],
     "1 --priority values for 2 --prompt flags"),
    (["generate", "--prompt", "hi", "--priority", "1"], "--batching none runs them one after another"),
    (["generate", "--prompt", "hi", "--max-num-seqs", "4"], "--max-num-seqs needs --batching static"),
    (["generate", "--prompt", "hi", "--kv", "contiguous", "--kv-cache-tokens", "64"],
     "--kv-cache-tokens sizes the paged KV pool; use it with --kv paged (not --kv contiguous)"),
    (["generate", "--prompt", "hi", "--kv-cache-tokens", "8"], "must hold at least one block of 16 tokens"),
    (["generate", "--prompt", "hi", "--n", "2"], "--n runs the copies of a prompt together: choose a --batching"),
    (["generate", "--prompt", "hi", "--logprobs", "21"], "logprobs must be an integer from 0 to 20"),
    (["generate", "--prompt", "hi", "--min-p", "2"], "min_p must be in [0, 1]"),
    (["generate", "--prompt", "hi", "--logit-bias", "x:1"], "--logit-bias takes 'token id: bias' pairs"),
    (["generate", "--prompt", "hi", "--constraint", "regex"], "give it in --constraint-spec"),
    (["generate", "--prompt", "hi", "--constraint", "json_schema", "--constraint-spec", "{"],
     "the JSON schema is not valid JSON"),
    (["batch-bench", "--arrival", "poisson:0"], "use burst or poisson:RATE with RATE > 0"),
    (["batch-bench", "--modes", "none,fast"], "unknown batch-bench row 'fast'"),
    (["batch-bench", "--modes", "continuous+join0"], "unknown batch-bench row 'continuous+join0'"),
    (["batch-bench", "--rates", "1,0"], "bad --rates '1,0'; give request rates per second above 0"),
    (["batch-bench", "--rates", "1,2", "--arrival", "poisson:2"], "--rates sets the arrivals"),
    (["batch-bench", "--slo-tpot-ms", "-1"], "the TPOT target must be a number of milliseconds above 0"),
    (["batch-bench", "--quant-activations", "int8"], "int8 activations go with quantized weights"),
    (["batch-bench", "--spec", "eagle", "--spec-tree-width", "0"], "tree width must be an integer from 1 to"),
    (["bench", "--repeats", "0", "--no-hf"], "--repeats >= 1"),
    (["bench", "--prompts", "no-such-prompts.jsonl", "--no-hf"], "prompt file no-such-prompts.jsonl does not exist"),
])
def test_bad_settings_exit_2_with_a_message(argv, message, capsys):
    assert main([argv[0], *CPU, *argv[1:]]) == 2
    assert message in capsys.readouterr().err


def test_bench_json_rows(bundled, tmp_path, capsys):
    path = tmp_path / "bench.json"
    assert main(["bench", "--prompt-ids", "plain-1", "--repeats", "1", "--max-new-tokens", "4", *CPU,
                 "--configs", "contiguous,paged", "--json", str(path)]) == 0  # compiled rows: test_compiled.py
    report = json.loads(path.read_text())
    assert [row["name"] for row in report["rows"]] == ["contiguous", "paged", "hf-transformers"]
    for row in report["rows"]:
        assert {"name", "kv", "decode_tokens_per_s", "ttft_ms", "prefill_tokens_per_s", "roofline_pct"} <= set(row)
        assert row["decode_tokens_per_s"] > 0 and 0 < row["roofline_pct"] < 100
        low, high = row["roofline_pct_paired_range"]  # one run: its probe alone sets the limit
        assert 0 < low == row["roofline_pct_paired"] == high < 100
    assert report["rows"][-1]["speedup_vs_hf"] == 1.0
    probes = report["read_bandwidth_probes_gb_s"]  # before the runs and after the one repeat; the limit: their median
    assert len(probes) == 2 and min(probes) <= report["read_bandwidth_gb_s"] <= max(probes)
    assert "| contiguous |" in capsys.readouterr().out


def test_paired_roofline_takes_each_run_against_its_own_probe():
    runs = [{"decode_tokens_per_s": 100.0, "read_bytes_per_s": 1e9},  # limit 200 tok/s at 5 MB a step: 50%
            {"decode_tokens_per_s": 150.0, "read_bytes_per_s": 2e9},  # limit 400: 37.5%
            {"decode_tokens_per_s": 90.0, "read_bytes_per_s": 1e9}]  # limit 200: 45%
    assert paired_roofline_pct(runs, 5e6) == (45.0, [37.5, 50.0])
    # Against the probes' median (1e9 B/s: 200 tok/s) the median run (100 tok/s) would read 50%.


# --- batching ---------------------------------------------------------------------------------------------------------
# These tests run on one torch thread (`one_torch_thread`): with another test run sharing this 2-core machine, the
# batched generate of three prompts took 18.6 s on two threads and 4.8 s on one (measured from the command line).

@pytest.fixture(scope="module")
def in_turn(bundled, one_torch_thread) -> list[dict]:
    """THREE_PROMPTS run one after another (--batching none), 8 greedy tokens each: the baseline the batched runs
    must equal. (Module scope, so it reads stdout itself instead of through capsys.)"""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(_three_prompts("--batching", "none")) == 0
    return json.loads(out.getvalue())


def _three_prompts(*args: str, as_json: bool = True) -> list[str]:
    prompts = [arg for prompt in THREE_PROMPTS for arg in ("--prompt", prompt)]
    return ["generate", *prompts, "--max-new-tokens", "8", *CPU, *(["--json"] if as_json else []), *args]


@pytest.mark.parametrize("spec_args", [[], ["--spec", "ngram", "--spec-k", "3"]])
def test_batched_generate_keeps_prompt_order_and_greedy_ids(in_turn, capsys, spec_args):
    assert main(_three_prompts("--batching", "continuous", *spec_args)) == 0
    batched = json.loads(capsys.readouterr().out)
    assert [r["prompt"] for r in batched] == [r["prompt"] for r in in_turn] == THREE_PROMPTS
    assert [r["token_ids"] for r in batched] == [r["token_ids"] for r in in_turn]
    for result in batched:
        assert set(result["stats"]) == STATS_KEYS and result["stats"]["preemptions"] == 0
    assert [r["stats"]["batch_size_mean"] for r in in_turn] == [1.0, 1.0, 1.0]
    # All three are admitted in the first step and all end at token 8 (the first at its end-of-sequence), so every
    # step holds all three.
    assert [r["stats"]["batch_size_mean"] for r in batched] == [3.0, 3.0, 3.0]


def test_priority_orders_admission(bundled, one_torch_thread, capsys):
    assert main(_three_prompts("--batching", "continuous", "--max-num-seqs", "1", "--max-new-tokens", "2",
                               "--priority", "2", "--priority", "0", "--priority", "1")) == 0
    results = json.loads(capsys.readouterr().out)
    assert [r["prompt"] for r in results] == THREE_PROMPTS  # output stays in prompt order
    queued = [r["stats"]["queue_ms"] for r in results]
    assert sorted(range(3), key=queued.__getitem__) == [1, 2, 0]  # ran in priority order, one at a time


def test_a_tiny_kv_pool_preempts_and_keeps_greedy_ids(bundled, one_torch_thread, capsys):
    # Four prompts of 36-38 tokens (3 blocks of 16 each; the first block, system prompt and chat scaffolding, is
    # shared through the prefix cache) growing by 24 tokens to 4 blocks each, in a pool of 6 blocks: not all fit.
    prompts = ["What is the capital of France?", "Name three rivers in Europe.", "Say hello to my friend.",
               "Write a haiku about the sea."]
    base = ["generate", *[arg for prompt in prompts for arg in ("--prompt", prompt)], "--max-new-tokens", "24",
            "--ignore-eos", *CPU, "--json"]
    assert main(base) == 0
    alone = json.loads(capsys.readouterr().out)
    assert main(base + ["--batching", "continuous", "--kv-cache-tokens", "96"]) == 0
    batched = json.loads(capsys.readouterr().out)
    assert [r["token_ids"] for r in batched] == [r["token_ids"] for r in alone]
    assert all(len(r["token_ids"]) == 24 for r in batched)
    assert [r["stats"]["preemptions"] for r in alone] == [0, 0, 0, 0]
    assert sum(r["stats"]["preemptions"] for r in batched) > 0


def test_batched_generate_prints_texts_in_prompt_order(in_turn, capsys):
    assert main(_three_prompts("--batching", "static", as_json=False)) == 0  # no --json
    captured = capsys.readouterr()
    assert captured.out == "".join(r["text"] + "\n" for r in in_turn)
    assert captured.err.count("0 preemptions, mean batch 3.0]") == 3


def test_batch_bench_json_rows(bundled, one_torch_thread, tmp_path, capsys):
    path = tmp_path / "batch.json"
    assert main(["batch-bench", "--requests", "3", "--max-new-tokens", "4", "--modes", "none,continuous", "--peers",
                 "hf-sequential", *CPU, "--slo-ttft-ms", "600000", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert [row["name"] for row in report["rows"]] == ["none", "continuous", "hf-sequential"]
    for row in report["rows"]:
        assert tuple(row) == ROW_KEYS
        assert row["requests"] == 3 and row["preemptions"] == 0 and row["output_tokens"] > 0
        assert 0 < row["ttft_ms_p50"] <= row["ttft_ms_p95"] and row["ttft_ms_p50"] <= row["latency_ms_p50"]
        # Every request meets a 10-minute TTFT target: goodput is the requests over the throughput's wall clock.
        assert row["slo_attainment_pct"] == 100.0 and 0 < row["tpot_ms_p50"] <= row["tpot_ms_p95"]
        wall_s = row["output_tokens"] / row["throughput_tokens_per_s"]
        assert row["goodput_requests_per_s"] == pytest.approx(3 / wall_s, rel=0.01)
    none, continuous = report["rows"][:2]
    assert none["output_tokens"] == continuous["output_tokens"]  # greedy: batching changes speed, not tokens
    assert [row["mean_batch_size"] for row in report["rows"]] == [1.0, 3.0, 1.0]
    assert report["arrivals_s"] == [0.0, 0.0, 0.0] and report["arguments"]["requests"] == 3
    assert (report["arguments"]["slo_ttft_ms"], report["arguments"]["slo_tpot_ms"]) == (600000.0, None)
    assert {"processor", "cpu_capability", "torch"} <= set(report["machine"])
    assert "| continuous | 3 |" in capsys.readouterr().out


def test_batch_bench_quantizes_our_rows(bundled, one_torch_thread, tmp_path, capsys, monkeypatch):
    """--quant: our rows run the quantized model (the engine is handed its int4 projections), and the report says
    so."""
    from inference_core.quant.linear import QuantLinear

    engines = []  # the models our rows' engines are made on
    real_engine = batching.Engine
    monkeypatch.setattr(batching, "Engine",
                        lambda loaded, config: engines.append(loaded) or real_engine(loaded, config))
    path = tmp_path / "batch.json"
    assert main(["batch-bench", "--requests", "2", "--max-new-tokens", "3", "--modes", "continuous", "--peers", "",
                 "--quant", "int4", *CPU, "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert report["arguments"]["quant"] == "int4 g32" and report["rows"][0]["output_tokens"] == 6
    assert "our rows quantized (int4 g32)" in capsys.readouterr().out
    assert engines and all(isinstance(loaded.model.layers[0].mlp.down_proj, QuantLinear) for loaded in engines)


def test_batch_bench_runs_each_mode_again_speculating(bundled, one_torch_thread, tmp_path, monkeypatch):
    """--spec: each mode, then the same mode with every request speculating, on the prompts of --kinds; greedy, so
    both rows produce the same tokens, and the speculative row's acceptance is its requests' own. Every step drafts:
    on a busy host the warm-up run can measure plain steps faster at batch 2, and the engine would then draft nothing
    in the timed run (`spec.pays`, tested on its own)."""
    from inference_core.spec.pays import SpeculationPolicy

    monkeypatch.setattr(SpeculationPolicy, "plain_reason", lambda self, batch: None)
    path = tmp_path / "batch.json"
    assert main(["batch-bench", "--requests", "2", "--max-new-tokens", "12", "--modes", "continuous", "--peers", "",
                 "--kinds", "grounded", "--spec", "ngram", "--spec-k", "3", *CPU, "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    plain, speculative = report["rows"]
    assert (plain["name"], speculative["name"]) == ("continuous", "continuous + ngram k=3")
    assert plain["output_tokens"] == speculative["output_tokens"] == 24
    entry = report["speculation"]["continuous + ngram k=3"]
    assert entry["verifications"] > 0 and 0 < entry["acceptance_rate"] <= 1  # a grounded prompt: lookups find drafts
    assert entry["ratio"] == round(speculative["throughput_tokens_per_s"] / plain["throughput_tokens_per_s"], 3)
    assert report["arguments"]["spec"] == {"method": "ngram", "k": 3} and report["arguments"]["kinds"] == "grounded"
    assert set(report["steps"]) == {"continuous", "continuous + ngram k=3"}


def test_batch_bench_keeps_the_rows_it_finished(bundled, one_torch_thread, tmp_path, monkeypatch):
    """The JSON is written after each row: a run that stops part-way (here the second mode fails; in the GPU report a
    run stopped at its share of the budget) leaves the rows before it on disk."""
    calls = []

    def failing_on_the_second_mode(*args):
        calls.append(args)
        if len(calls) == 3:  # the second mode's warm-up (each mode: a warm-up, then the timed run)
            raise RuntimeError("stopped")
        return run_engine(*args)

    monkeypatch.setattr(batching, "run_engine", failing_on_the_second_mode)
    path = tmp_path / "batch.json"
    prompts = [{"prompt": "Say hello.", "kind": "chat"}]
    with pytest.raises(RuntimeError, match="stopped"):
        batching.batch_bench(bundled, None, prompts, [0.0, 0.0], [2, 2], ["none", "continuous"], [], 2,
                             json_path=str(path))
    assert [row["name"] for row in json.loads(path.read_text())["rows"]] == ["none"]


def test_batch_bench_rate_sweep(bundled, one_torch_thread, capsys):
    """--rates runs the bench once per Poisson rate (arrivals from the one seed) and lists each row at each rate."""
    prompts = [{"prompt": "Say hello.", "kind": "chat"}]
    report = rate_sweep(bundled, None, prompts, [100.0, 50.0], 3, [2, 2], ["continuous"], [], 2,
                        targets=LatencyTargets(600000, 600000))
    assert [(row["name"], row["rate_requests_per_s"]) for row in report["sweep"]] == [
        ("continuous", 50.0), ("continuous", 100.0)]
    assert all(row["slo_attainment_pct"] == 100.0 and row["output_tokens"] == 4 for row in report["sweep"])
    assert [run["arrivals_s"] for run in report["runs"]] == [
        [round(s, 4) for s in parse_arrivals(f"poisson:{rate}", 2, seed=3)] for rate in (100, 50)]
    assert report["arguments"]["rates"] == [100.0, 50.0] and report["arguments"]["arrival"] is None
    assert "| continuous | 50 |" in capsys.readouterr().out


def test_static_batches_wait_for_a_full_batch(bundled, one_torch_thread):
    # max_num_seqs 2: the first request waits for the second (arriving at 0.3 s); the third runs alone once it has
    # arrived and nothing more is coming.
    engine = Engine(bundled, EngineConfig(kv_mode="paged", batching="static", max_num_seqs=2))
    prompt = engine.prompt_ids("Say hello.")
    timings, batch_sizes = run_engine(engine, [prompt] * 3, [0.0, 0.3, 0.6], 2)
    assert timings[0].first_token - timings[0].arrival >= 0.3
    assert [t.output_tokens for t in timings] == [2, 2, 2]
    assert batch_sizes == [2, 2, 1, 1]


def test_arrivals_and_percentiles():
    rng = random.Random(7)
    gaps = [rng.expovariate(4.0) for _ in range(3)]
    assert parse_arrivals("poisson:4", 4, seed=7) == [0.0, gaps[0], gaps[0] + gaps[1], gaps[0] + gaps[1] + gaps[2]]
    assert parse_arrivals("burst", 2, seed=7) == [0.0, 0.0]
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([10.0, 20.0], 95) == 19.5
    assert percentile([5.0], 95) == 5.0
