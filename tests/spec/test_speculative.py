"""Speculative decoding: the draft sources and the acceptance rules on exact values; end to end on the bundled model
that greedy speculation with every draft source is lossless (token ids identical to plain greedy over 128 tokens) and
leaks no KV block; and on tiny models the test builds, that sampled speculation with a deliberately bad draft emits
tokens distributed as the target alone would sample them."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from torch import nn

from inference_core import ConfigError, Engine, EngineConfig, FinishEvent, LoadedModel, SamplingParams, TokenEvent
from inference_core.model.llama import CausalLM
from inference_core.sampling import probabilities
from inference_core.sequence import Sequence
from inference_core.spec.decoding import (SpecConfig, SpecStats, accept_greedy, accept_sampled, next_k,
                                        propose_ngram)
from conftest import assert_nothing_held, make_engine
from tiny_models import build_tiny, run_to_end, TINY_VOCAB


def first_layers_copy(loaded: LoadedModel, num_layers: int) -> LoadedModel:
    """A separate draft model made of the first `num_layers` layers of `loaded` (its weights shared, not copied),
    with the same norm, LM head and tokenizer: a cheaper sibling that agrees with the target part of the time."""
    config = dataclasses.replace(loaded.config, num_layers=num_layers)
    with torch.device("meta"):
        network = CausalLM(config)
    network.embed_tokens, network.norm, network.lm_head = (loaded.model.embed_tokens, loaded.model.norm,
                                                           loaded.model.lm_head)
    network.layers = nn.ModuleList(loaded.model.layers[:num_layers])
    network.rope_inv_freq = loaded.model.rope_inv_freq
    return LoadedModel(f"{loaded.name} (first {num_layers} layers)", config, network.eval(), loaded.tokenizer,
                       loaded.device, loaded.dtype)


def assert_draft_released(engine: Engine) -> None:
    """The draft model's own KV cache holds nothing either."""
    if engine.draft_runner is None:  # no request has drafted with the draft model yet
        return
    assert engine.draft_runner.kv_cache.blocks_in_use() == 0


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


def test_adaptive_k_grows_on_full_acceptance_and_shrinks_on_early_rejection():
    assert next_k(4, drafted=4, accepted=4, max_k=8) == 5
    assert next_k(8, drafted=8, accepted=8, max_k=8) == 8  # capped
    assert next_k(4, drafted=4, accepted=1, max_k=8) == 3  # rejected in the first half
    assert next_k(4, drafted=4, accepted=2, max_k=8) == 4  # rejected in the second half: unchanged
    assert next_k(1, drafted=1, accepted=0, max_k=8) == 1  # never below 1
    assert next_k(4, drafted=2, accepted=2, max_k=8) == 4  # a short prompt-lookup draft proves nothing about k
    assert SpecConfig("ngram", k=5, adaptive=True).max_k == 10
    assert SpecConfig("ngram", k=12, adaptive=True).max_k == 16


@pytest.mark.parametrize("settings, message", [
    (dict(method="lookahead"), "unknown speculative method 'lookahead'"),
    (dict(method="ngram", k=0), "draft length k must be an integer from 1 to 16"),
    (dict(method="ngram", ngram_min=3, ngram_max=2), "1 <= ngram_min <= ngram_max"),
    (dict(method="early-exit", draft_layers=0), "draft layers must be a positive integer"),
])
def test_bad_spec_settings(settings, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        SpecConfig(**settings)


def test_engine_refuses_what_its_model_cannot_draft(bundled):
    engine = make_engine(bundled, "paged")
    with pytest.raises(ConfigError, match="'draft' needs a draft model: pass --draft-model"):
        engine.generate("Hi", spec=SpecConfig("draft"))
    with pytest.raises(ConfigError, match=r"--draft-layers must be below the model's 30 layers \(1 to 29\)"):
        engine.generate("Hi", spec=SpecConfig("early-exit", draft_layers=30))
    assert engine.resolve_spec(SpecConfig("early-exit")).draft_layers == 15  # default: half the layers
    assert_nothing_held(engine)


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


# Tokens per case of the lossless matrix (3 prompts, each with its draft length, per source and KV mode), each case
# rolling back rejected drafts many times (early exit and the draft model roll back at most of their steps); 40 tokens
# cross ten 4-token blocks (the oracle tests run 128 without speculation).
LOSSLESS_TOKENS = 40


@pytest.fixture(scope="module")
def lossless_prompts(bench_prompts):
    return [bench_prompts[name] for name in ("grounded-1", "code-2", "chat-short-1")]


@pytest.fixture(scope="module")
def plain_greedy(bundled, lossless_prompts):
    """Plain greedy ids of each lossless prompt (LOSSLESS_TOKENS), the reference every draft source must reproduce."""
    engine = make_engine(bundled, "paged")
    params = SamplingParams(max_new_tokens=LOSSLESS_TOKENS, ignore_eos=True)
    return {row["id"]: engine.complete(row["prompt"], params, system=row.get("system")).token_ids
            for row in lossless_prompts}


# Draft source -> (SpecConfig settings, draft model layers or None). Early exit at 8 of 30 layers and an 8-layer draft
# model agree with the target only now and then (a few percent of drafts), so most steps roll drafts back; the
# self-draft test below covers steps where every draft is accepted.
SOURCES = {
    "ngram": (dict(method="ngram"), None),
    "early-exit": (dict(method="early-exit", draft_layers=8), None),
    "draft": (dict(method="draft"), 8),
    "ngram-adaptive": (dict(method="ngram", adaptive=True), None),
}


@pytest.mark.parametrize("kv_mode", ["contiguous", "paged"])
@pytest.mark.parametrize("source", sorted(SOURCES))
def test_greedy_speculation_is_lossless(bundled, lossless_prompts, plain_greedy, kv_mode, source, one_torch_thread):
    settings, draft_layers = SOURCES[source]
    draft = first_layers_copy(bundled, draft_layers) if draft_layers else None
    engine = Engine(bundled, EngineConfig(kv_mode=kv_mode, block_size=4), draft_model=draft)
    params = SamplingParams(max_new_tokens=LOSSLESS_TOKENS, ignore_eos=True)
    accepted = rejected = 0
    # The paged cache's rollback frees whole blocks of 4 and cuts a partial one: draft lengths below, at and above
    # the block size cross block boundaries in different ways, one per prompt. The contiguous cache only moves its
    # length back: one draft length and two prompts cover it.
    for row, k in zip(lossless_prompts, (2, 5, 4) if kv_mode == "paged" else (4, 4)):
        prompt_ids = engine.prompt_ids(row["prompt"], row.get("system"))
        fast = engine.complete(prompt_ids, params, spec=SpecConfig(k=k, **settings))
        assert fast.token_ids == plain_greedy[row["id"]], (row["id"], k)
        spec = fast.stats.spec
        assert spec["drafted"] > 0 and 0 <= spec["accepted"] <= spec["drafted"]
        assert sum(spec["drafted_by_position"]) == spec["drafted"]
        assert sum(spec["accepted_by_position"]) == spec["accepted"]
        accepted, rejected = accepted + spec["accepted"], rejected + spec["drafted"] - spec["accepted"]
    assert accepted > 0 and rejected > 0  # both kinds of step were exercised, rollback included
    assert_nothing_held(engine)
    if draft is not None:
        assert_draft_released(engine)


def test_a_model_drafting_for_itself_is_always_accepted(bundled, bench_prompts):
    engine = Engine(bundled, EngineConfig(kv_mode="paged", block_size=4), draft_model=bundled)
    row = bench_prompts["chat-short-1"]
    kinds = [event.draft for event in engine.generate(row["prompt"], SamplingParams(max_new_tokens=25, ignore_eos=True),
                                                      spec=SpecConfig("draft", k=3))
             if isinstance(event, TokenEvent)]
    # The first token comes from the prefill; then each step is 3 accepted drafts and a bonus token.
    assert kinds == [None] + ["accepted", "accepted", "accepted", "bonus"] * 6
    assert_nothing_held(engine)
    assert_draft_released(engine)


@pytest.mark.parametrize("kv_mode", ["none", "contiguous", "paged"])
def test_draft_sources_cancelled_mid_stream_release_everything(bundled, bench_prompts, kv_mode):
    engine = Engine(bundled, EngineConfig(kv_mode=kv_mode, block_size=4), draft_model=first_layers_copy(bundled, 8))
    row = bench_prompts["grounded-1"]
    for spec in (SpecConfig("early-exit", k=3, draft_layers=8), SpecConfig("draft", k=3)):
        request = engine.generate(row["prompt"], SamplingParams(max_new_tokens=64, temperature=0.8, seed=1),
                                  system=row.get("system"), spec=spec)
        for index, event in enumerate(request):
            if index == 9:
                break
        request.close()
        assert_nothing_held(engine)
        assert_draft_released(engine)


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


def test_spec_bench_writes_rows_per_kind_and_keeps_the_best_k_for_the_setup(bundled, tmp_path, capsys, monkeypatch):
    from inference_core.cli import main
    from inference_core.spec import defaults

    monkeypatch.setattr(defaults, "_path", lambda: tmp_path / defaults.FILE_NAME)
    path = tmp_path / "spec.json"
    assert main(["spec-bench", "--kinds", "grounded", "--spec-k", "2,4", "--max-new-tokens", "16", "--repeats", "1",
                 "--device", "cpu", "--dtype", "float32", "--json", str(path), "--keep"]) == 0
    report = json.loads(path.read_text())
    rows = report["rows"]
    assert [(row["kind"], row["setting"]) for row in rows] == [("grounded", "ngram k=2"), ("grounded", "ngram k=4")]
    for row in rows:
        assert row["ratio"] == pytest.approx(row["spec_tokens_per_s"] / row["plain_tokens_per_s"], abs=0.01)
        assert 0 <= row["acceptance_rate"] <= 1 and 1 <= row["mean_accepted_length"] <= 5
    out = capsys.readouterr().out
    assert "| grounded | ngram k=2 |" in out and "kept as the default k of" in out
    best = max(rows, key=lambda row: (row["ratio"], -row["k"]))["k"]  # one kind: its best ratio is the best mean
    assert report["best_k"]["ngram"]["k"] == best
    # A request of the same setup (the bundled model in fp32, paged, eager) that leaves k open gets the kept k; one
    # that names k keeps it; another setup (contiguous KV) gets the project's default.
    engine = Engine(bundled, EngineConfig(kv_mode="paged"))
    assert engine.resolve_spec(SpecConfig("ngram")).k == best
    assert engine.default_k(SpecConfig("ngram"))[1].startswith("measured on this host")
    assert engine.resolve_spec(SpecConfig("ngram", k=3)).k == 3
    assert Engine(bundled, EngineConfig(kv_mode="contiguous")).resolve_spec(SpecConfig("ngram")).k == \
        defaults.BUILT_IN_K["ngram"]


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """A tiny target and a deliberately bad draft: another random init with flatter logits, so it often proposes
    tokens the target finds unlikely (about 1 draft in 5 is accepted)."""
    target = build_tiny(tmp_path_factory.mktemp("target"), seed=0, initializer_range=0.3)
    draft = build_tiny(tmp_path_factory.mktemp("draft"), seed=1, initializer_range=0.15)
    return target, draft


@pytest.mark.parametrize("kv_mode", ["none", "contiguous", "paged"])
def test_speculating_requests_verify_in_one_forward_and_each_equals_its_solo_run(tiny_pair, kv_mode):
    """Five requests at once, each with its own draft source: every step drafts for each of them, then verifies all
    their chains (and a plain token for those that drafted nothing) in one forward; each answer is its solo plain
    greedy one, and the pool ends empty. A small paged pool leaves some steps no room to draft."""
    target, draft = tiny_pair
    engine = Engine(target, EngineConfig(kv_mode=kv_mode, block_size=2, max_num_seqs=8,
                                         kv_cache_tokens=120 if kv_mode == "paged" else None), draft_model=draft)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    specs = [SpecConfig("ngram", k=3, ngram_min=1), SpecConfig("early-exit", k=2, draft_layers=1),
             SpecConfig("draft", k=3), SpecConfig("ngram", k=2, adaptive=True, ngram_min=1), SpecConfig()]
    prompts = [[3 + (i * 5 + j * 3) % 13 for j in range(6 + i)] * 2 for i in range(len(specs))]
    want = [engine.complete(ids, params).token_ids for ids in prompts]
    forwards = []
    run = engine.runner.run

    def counted(seqs, *args, **kwargs):
        forwards.append((len(seqs), kwargs.get("num_logits", 1)))
        return run(seqs, *args, **kwargs)

    engine.runner.run = counted
    requests = [engine.submit(ids, params, spec=spec) for ids, spec in zip(prompts, specs)]
    run_to_end(engine)
    assert [request.events[-1].token_ids for request in requests] == want
    assert any(count == 4 and logits > 1 for count, logits in forwards)  # four chains verified together
    assert sum(request.events[-1].stats.spec["accepted"] for request in requests[:4]) > 0
    assert_nothing_held(engine)
    assert_draft_released(engine)


def exact_marginals(loaded: LoadedModel, prompt: list[int], params: SamplingParams, length: int) -> list[torch.Tensor]:
    """The target's own distribution of each of the first `length` generated tokens, by summing over every earlier
    token (V + V^2 + ... forwards of the tiny model)."""
    engine = Engine(loaded, EngineConfig(kv_mode="none"))
    marginals, paths = [], {(): 1.0}  # prefix of generated tokens -> its probability
    for _ in range(length):
        marginal, next_paths = torch.zeros(TINY_VOCAB, dtype=torch.float64), {}
        for prefix, weight in paths.items():
            probs = probabilities(engine.runner.run([Sequence(prompt + list(prefix))])[0], params).double()
            marginal += weight * probs
            for token in range(TINY_VOCAB):
                next_paths[prefix + (token,)] = weight * float(probs[token])
        marginals.append(marginal)
        paths = next_paths
    return marginals


SAMPLED_PROMPT = [1, 5, 9, 3]
SAMPLED_PARAMS = SamplingParams(max_new_tokens=4, temperature=1.0, top_k=12, ignore_eos=True)


def sampled_speculation_distances(engine: Engine, target: LoadedModel, spec: SpecConfig, trials: int = 3000):
    """Sample SAMPLED_PROMPT's continuation `trials` times (seeds 0..) with speculation k=2; returns the total
    variation distance of generated tokens 2 and 3 (one verification step: draft positions 0 and 1, or a rejection's
    residual) from the target's exact marginals, the bound sqrt(V/N) the sampling error stays under, and the drafts
    drafted and accepted. Leaves nothing held."""
    marginals = exact_marginals(target, SAMPLED_PROMPT, SAMPLED_PARAMS, 3)[1:]
    counts = torch.zeros(2, TINY_VOCAB, dtype=torch.float64)
    drafted = accepted = 0
    for seed in range(trials):
        result = engine.complete(SAMPLED_PROMPT, dataclasses.replace(SAMPLED_PARAMS, seed=seed), spec=spec)
        for position in range(2):
            counts[position, result.token_ids[1 + position]] += 1
        drafted, accepted = drafted + result.stats.spec["drafted"], accepted + result.stats.spec["accepted"]
    assert_nothing_held(engine)
    distances = [float(0.5 * (counts[position] / trials - marginal).abs().sum())
                 for position, marginal in enumerate(marginals)]
    return distances, math.sqrt(TINY_VOCAB / trials), drafted, accepted


@pytest.mark.parametrize("source", ["draft", "early-exit"])
def test_sampled_speculation_keeps_the_target_distribution(tiny_pair, source, one_torch_thread):
    target, bad_draft = tiny_pair
    engine = Engine(target, EngineConfig(kv_mode="paged", block_size=2), draft_model=bad_draft)
    distances, bound, drafted, accepted = sampled_speculation_distances(
        engine, target, SpecConfig(source, k=2, draft_layers=1))
    assert accepted / drafted < 0.5  # the draft is bad: rejections are frequent
    # The sampling error of an empirical distribution shrinks as sqrt(V/N): 0.073 here, where the correct rule measured
    # 0.02-0.04 and a broken one (resampling from p instead of max(0, p - q) after a rejection) 0.09.
    for position, distance in enumerate(distances):
        assert distance < bound, position
