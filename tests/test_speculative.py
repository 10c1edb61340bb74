"""Speculative decoding: the draft source and acceptance rule on exact values, and end to end on the bundled model
that greedy speculation is lossless (token ids identical to plain greedy over 128 tokens) and leaks no KV block."""

from __future__ import annotations

import json
import math

import pytest
import torch

from inference_core import ConfigError, FinishEvent, SamplingParams, TokenEvent
from inference_core.speculative import SpecConfig, SpecStats, accept_greedy, accept_sampled, propose_ngram
from conftest import assert_nothing_held, make_engine


def test_prompt_lookup_takes_the_latest_longest_match():
    # Suffix [7, 8] occurred at 1 (followed by 9, 4) and at 5 (followed by 5, 6): the later one wins.
    assert propose_ngram([1, 7, 8, 9, 4, 7, 8, 5, 6, 7, 8], k=3) == [5, 6, 7]
    # A 3-token match is preferred to a later 1-token one.
    assert propose_ngram([1, 2, 3, 9, 9, 3, 5, 1, 2, 3], k=2, ngram_max=3) == [9, 9]
    assert propose_ngram([1, 2, 3, 9, 9, 3, 5, 1, 2, 3], k=2, ngram_max=1) == [5, 1]
    assert propose_ngram([1, 2, 3, 4], k=4) == []  # nothing recurs
    assert propose_ngram([5, 5], k=4) == [5]  # the match must leave at least one token after it
    assert propose_ngram([1, 2, 1, 2], k=4, ngram_min=3) == []


def test_greedy_acceptance_is_the_agreeing_prefix():
    assert accept_greedy([4, 5, 6], [4, 5, 6, 7]) == 3
    assert accept_greedy([4, 5, 6], [4, 9, 6, 7]) == 1
    assert accept_greedy([4, 5, 6], [3, 5, 6, 7]) == 0


def test_stats_count_by_position():
    stats = SpecStats(k=3)
    stats.record(3, 3)
    stats.record(3, 1)
    stats.record(2, 0)
    summary = stats.as_dict()
    assert (summary["drafted"], summary["accepted"], summary["steps"]) == (8, 4, 3)
    assert summary["acceptance_rate"] == 0.5
    assert summary["mean_accepted_length"] == (4 + 3) / 3
    assert summary["accepted_by_position"] == [2, 1, 1]
    assert summary["drafted_by_position"] == [3, 3, 2]


@pytest.mark.parametrize("settings, message", [
    (dict(method="medusa"), "unknown speculative method 'medusa'"),
    (dict(method="ngram", k=0), "draft length k must be an integer from 1 to 16"),
    (dict(method="ngram", ngram_min=3, ngram_max=2), "1 <= ngram_min <= ngram_max"),
])
def test_bad_spec_settings(settings, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        SpecConfig(**settings)


TARGET = [0.4, 0.3, 0.15, 0.1, 0.05, 0.0]
BAD_DRAFT = [0.05, 0.05, 0.1, 0.1, 0.3, 0.4]  # puts most of its mass where the target puts little or none


def _first_token_frequencies(draft_probs, trials: int, fixed_draft: int | None = None):
    generator = torch.Generator().manual_seed(0)
    target = torch.tensor([TARGET, TARGET])  # [k + 1, vocab] with k = 1
    counts, rejections = [0] * len(TARGET), 0
    for _ in range(trials):
        if fixed_draft is None:
            draft = int(torch.multinomial(draft_probs[0], 1, generator=generator))
        else:
            draft = fixed_draft
        accepted, final_token = accept_sampled([draft], draft_probs, target, generator)
        counts[draft if accepted else final_token] += 1
        rejections += accepted == 0
    return [count / trials for count in counts], rejections / trials


@pytest.mark.parametrize("source", ["bad draft model", "deterministic draft (prompt lookup)"])
def test_speculative_sampling_keeps_the_target_distribution(source):
    trials = 20_000
    if source == "bad draft model":
        frequencies, rejection_rate = _first_token_frequencies(torch.tensor([BAD_DRAFT]), trials)
    else:
        frequencies, rejection_rate = _first_token_frequencies(None, trials, fixed_draft=4)
    total_variation = 0.5 * sum(abs(f - p) for f, p in zip(frequencies, TARGET))
    # The sampling error of an empirical distribution over V outcomes shrinks like sqrt(V / N).
    assert total_variation < 2 * math.sqrt(len(TARGET) / trials)
    assert frequencies[5] == 0.0  # never emits a token the target cannot produce
    assert rejection_rate > 0.6  # the bad draft is rejected most of the time


def test_sampled_speculation_runs_and_leaks_nothing(bundled, bench_prompts):
    engine = make_engine(bundled, "paged", block_size=4)
    row = bench_prompts["grounded-2"]
    params = SamplingParams(max_new_tokens=64, temperature=0.7, seed=3, ignore_eos=True)
    first = engine.complete(row["prompt"], params, spec=SpecConfig("ngram", k=4))
    again = engine.complete(row["prompt"], params, spec=SpecConfig("ngram", k=4))
    assert first.token_ids == again.token_ids and len(first.token_ids) == 64  # seeded: reproducible
    assert first.stats.spec["drafted"] > 0
    assert_nothing_held(engine)


@pytest.fixture(scope="module")
def lossless_prompts(bench_prompts):
    return [bench_prompts[name] for name in ("grounded-1", "code-2", "chat-short-1")]


@pytest.mark.parametrize("kv_mode", ["contiguous", "paged"])
def test_greedy_speculation_is_lossless(bundled, lossless_prompts, kv_mode, one_torch_thread):
    engine = make_engine(bundled, kv_mode, block_size=4)
    params = SamplingParams(max_new_tokens=128, ignore_eos=True)
    for row in lossless_prompts:
        prompt_ids = engine.prompt_ids(row["prompt"], row.get("system"))
        plain = engine.complete(prompt_ids, params)
        for k in (2, 5):
            fast = engine.complete(prompt_ids, params, spec=SpecConfig("ngram", k=k))
            assert fast.token_ids == plain.token_ids, (row["id"], k)
            spec = fast.stats.spec
            assert spec["drafted"] > 0 and 0 <= spec["accepted"] <= spec["drafted"]
            assert sum(spec["drafted_by_position"]) == spec["drafted"]
            assert sum(spec["accepted_by_position"]) == spec["accepted"]
    assert_nothing_held(engine)


def test_paged_blocks_follow_the_accepted_tokens_and_return_on_cancel(bundled, bench_prompts):
    engine = make_engine(bundled, "paged", block_size=4, prefix_cache=False)
    row = bench_prompts["grounded-1"]
    request = engine.generate(row["prompt"], SamplingParams(max_new_tokens=96, ignore_eos=True),
                              system=row.get("system"), spec=SpecConfig("ngram", k=6))
    kinds = []
    for event in request:
        if isinstance(event, FinishEvent):
            break
        assert isinstance(event, TokenEvent)
        kinds.append(event.draft)
        (held,) = engine.kv_snapshot()["requests"]
        # Rejected drafts' blocks went back to the pool: a request holds exactly the blocks its written KV needs.
        assert len(held["block_table"]) == math.ceil(held["stored_tokens"] / 4)
        if event.draft == "replaced":
            assert event.rejected_ids and event.rejected_ids[0] != event.token_id
        if len(kinds) == 60:
            break
    assert {"accepted", "replaced"} <= set(kinds)
    request.close()  # cancelled in the middle of the stream
    assert_nothing_held(engine)


def test_spec_bench_writes_rows_per_kind(bundled, tmp_path, capsys):
    from inference_core.cli import main

    path = tmp_path / "spec.json"
    assert main(["spec-bench", "--kinds", "grounded", "--spec-k", "2,4", "--max-new-tokens", "16", "--repeats", "1",
                 "--device", "cpu", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert [(row["kind"], row["setting"]) for row in rows] == [("grounded", "ngram k=2"), ("grounded", "ngram k=4")]
    for row in rows:
        assert row["ratio"] == pytest.approx(row["spec_tokens_per_s"] / row["plain_tokens_per_s"], abs=0.01)
        assert 0 <= row["acceptance_rate"] <= 1 and 1 <= row["mean_accepted_length"] <= 5
    assert "| grounded | ngram k=2 |" in capsys.readouterr().out
