"""Speculation where it pays (`spec.pays`): the choice from measured rates, and the engine following it."""

from __future__ import annotations

import pytest

from inference_core import Engine, EngineConfig, SamplingParams
from inference_core.spec.decoding import SpecConfig
from inference_core.spec.pays import EXPLORE_EVERY, MEASURE_FIRST, SAMPLES, SpeculationPolicy

from conftest import assert_nothing_held
from tiny_models import build_tiny, run_to_end


def test_speculation_runs_first_then_plain_steps_are_measured_then_the_faster_kind_wins():
    policy = SpeculationPolicy()
    for _ in range(MEASURE_FIRST):  # nothing measured: speculate, as asked, until MEASURE_FIRST steps are
        assert policy.plain_reason(4) is None
        policy.record(4, True, tokens=8, seconds=0.1)  # 80 tokens/s speculating
    for _ in range(MEASURE_FIRST):  # then as many plain steps, whatever the first of them measure
        assert "measuring plain steps at batch 4" in policy.plain_reason(4)
        policy.record(4, False, tokens=4, seconds=0.02)  # 200 tokens/s plain
    reasons = [policy.plain_reason(4) for _ in range(2 * EXPLORE_EVERY)]
    assert reasons[0].startswith("at batch 4 plain steps produce 200.0 tokens/s, speculative ones 80.0")
    # The losing kind (speculation) once in EXPLORE_EVERY steps, so a stale measurement can be won back.
    assert sum(reason is None for reason in reasons) == 2
    assert policy.plain_reason(2) is None  # another batch size is measured on its own
    for _ in range(MEASURE_FIRST):
        policy.record(1, True, tokens=1, seconds=1.0)
        policy.record(1, False, tokens=1, seconds=0.001)
    assert policy.plain_reason(1) is None  # a lone request drafts as it asked


def test_a_rate_is_the_mean_tokens_over_the_median_time_of_the_last_steps():
    policy = SpeculationPolicy()
    for seconds in [1.0] * SAMPLES + [0.01]:  # one quick outlier does not move the median time
        policy.record(1, False, tokens=10, seconds=seconds)
    assert policy.rate(1, False) == 10.0
    policy.record(1, True, tokens=5, seconds=0.0)  # a zero-length step measures nothing
    assert policy.rate(1, True) is None
    # Verifications that accept nothing (4 tokens for 4 requests) or everything (16), at the same cost: the rate is
    # what the steps produce together, where the median of each step's own rate read the rejections alone.
    for tokens in [4, 4, 4, 4, 4, 16, 16, 16]:
        policy.record(4, True, tokens=tokens, seconds=0.02)
    assert policy.rate(4, True) == pytest.approx(8.5 / 0.02)
    for _ in range(MEASURE_FIRST):
        policy.record(4, False, tokens=4, seconds=0.012)  # plain: 333 tokens/s, more than 200 but less than 425
    assert policy.plain_reason(4) is None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("target"), seed=0, initializer_range=0.3)


def test_greedy_requests_take_plain_steps_where_those_measured_faster_and_keep_their_tokens(tiny):
    engine = Engine(tiny, EngineConfig(kv_mode="paged", block_size=2, max_num_seqs=4))
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    spec = SpecConfig("ngram", k=3, ngram_min=1)
    prompts = [[3 + (i * 5 + j * 3) % 13 for j in range(6 + i)] * 2 for i in range(2)]
    want = [engine.complete(ids, params).token_ids for ids in prompts]
    for _ in range(MEASURE_FIRST):  # as if speculating at batch 2 were slow
        engine.speculation.record(2, True, tokens=2, seconds=1.0)
        engine.speculation.record(2, False, tokens=2, seconds=0.001)
    requests = [engine.submit(ids, params, spec=spec) for ids in prompts]
    run_to_end(engine)
    assert [request.events[-1].token_ids for request in requests] == want
    stats = [request.events[-1].stats.spec for request in requests]
    assert all(s["plain_steps"] > 0 and "plain steps produce" in s["plain_reason"] for s in stats)
    assert_nothing_held(engine)


def test_sampling_requests_always_draft_and_the_switch_turns_the_choice_off(tiny):
    spec = SpecConfig("ngram", k=3, ngram_min=1)
    prompts = [[3, 5, 7, 3, 5, 7, 3, 5, 7, 3, 5], [4, 6, 8, 4, 6, 8, 4, 6, 8, 4, 6]]
    for config, params in [(EngineConfig(kv_mode="paged"), SamplingParams(max_new_tokens=16, temperature=0.8,
                                                                           seed=1, ignore_eos=True)),
                           (EngineConfig(kv_mode="paged", speculate_when_it_pays=False),
                            SamplingParams(max_new_tokens=16, ignore_eos=True))]:
        engine = Engine(tiny, config)
        for _ in range(MEASURE_FIRST):
            engine.speculation.record(2, True, tokens=2, seconds=1.0)
            engine.speculation.record(2, False, tokens=2, seconds=0.001)
        requests = [engine.submit(prompt, params, spec=spec) for prompt in prompts]
        run_to_end(engine)
        assert [request.events[-1].stats.spec["plain_steps"] for request in requests] == [0, 0]
        assert all(request.events[-1].stats.spec["drafted"] > 0 for request in requests)


def test_a_group_of_speculating_requests_drafts_what_a_verification_of_few_rows_holds(tiny):
    """Where a verification's projections take `verify_rows` rows at about one row's cost (bf16 through our op's
    wide pass), each of a group of speculating requests drafts at most what keeps the group's verification within
    them (at least 1 draft); a lone request drafts its k. Greedy ids stay plain greedy's."""
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    spec = SpecConfig("ngram", k=3, ngram_min=1)
    prompts = [[3 + (i * 5 + j * 3) % 13 for j in range(6 + i)] * 2 for i in range(4)]
    later = {}  # drafts proposed past the first position, all requests together
    for rows in (None, 8):
        engine = Engine(tiny, EngineConfig(kv_mode="paged", block_size=2, max_num_seqs=4,
                                           speculate_when_it_pays=False))
        assert engine.verify_rows is None  # fp32, eager: no measured row count, every request drafts its k
        engine.verify_rows = rows
        if rows:
            assert [engine.drafts_that_fit(3, 1, group) for group in (1, 2, 3, 4, 8)] == [(3, 1), (3, 1), (1, 1),
                                                                                            (1, 1), (1, 1)]
            # a tree's levels, then no room for one: a chain
            assert [engine.drafts_that_fit(2, 3, group) for group in (1, 2, 3)] == [(2, 3), (1, 3), (1, 1)]
            assert engine.compiled_queries(spec, 4) == ()  # eager: no query step to compile
        want = [engine.complete(ids, params).token_ids for ids in prompts]
        requests = [engine.submit(ids, params, spec=spec) for ids in prompts]
        run_to_end(engine)
        assert [request.events[-1].token_ids for request in requests] == want
        later[rows] = sum(sum(request.events[-1].stats.spec["drafted_by_position"][1:]) for request in requests)
        stats = [request.events[-1].stats.spec for request in requests]
        if rows:  # the stats count the shortened steps and say why
            assert sum(s["fitted_steps"] for s in stats) > 0
            reason = next(s["fitted_reason"] for s in stats if s["fitted_steps"])
            assert "1 draft each kept their verification within the 8 rows" in reason
        else:
            assert all(s["fitted_steps"] == 0 and s["fitted_reason"] is None for s in stats)
        assert_nothing_held(engine)
    assert 0 < later[8] < later[None]  # groups of 3 and 4 drafted one token each
