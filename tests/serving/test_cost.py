"""Estimates that hold (`serving.cost.StepCosts`): a probe warms up and takes the best of several timings, the
engine's own measured steps replace it, and a slow moment while the app starts does not refuse the default race; the
page starts with a token count that fits the run limit and says so."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from inference_core.engine.engine import StepReport
from inference_core.engine.request import FinishEvent, TokenEvent
from serving.admission import Job
from serving.cost import MIN_MEASURED, START_SHARE, StepCosts, length_bucket
from serving.pool import EnginePool
from tiny_models import build_tiny_model
from ui.layout import DEFAULT_NEW_TOKENS, _start_tokens, warm_up
from ui.setups import DEFAULT_LANES, presets


def report(work, duration_ms: float, **extra) -> StepReport:
    return StepReport(0, 0.0, duration_ms, tuple(work), (), (), 0, len(work), 0, **extra)


class SlowClock:
    """perf_counter, plus `extra_s` on every reading while `slow`: a host busy with other work."""

    def __init__(self, extra_s: float):
        self.extra_s, self.offset, self.slow = extra_s, 0.0, True

    def __call__(self) -> float:
        if self.slow:
            self.offset += self.extra_s
        return time.perf_counter() + self.offset


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_a_probe_warms_up_and_takes_the_best_timing(tiny):
    timings = [(10.0, 15.0), (20.0, 20.003), (30.0, 30.004)]  # a slow moment, then two quiet forwards
    readings = iter([reading for timing in timings for reading in timing])
    costs = StepCosts(tiny, max_seq_len=256, clock=lambda: next(readings))
    assert costs.forward_ms_at(64) == pytest.approx(3.0)  # the 5 s timing is not the figure
    assert costs.forward_ms_at(32) == pytest.approx(1.5)  # within a bucket: its per-token time
    assert list(costs.probed_forward_ms) == [64] and next(readings, None) is None  # a warm-up, untimed, then three


def test_the_engines_own_steps_replace_the_probe(tiny):
    probes = []
    costs = StepCosts(tiny, max_seq_len=256, on_device=lambda probe: probes.append(probe) or 50.0)
    eager, compiled = SimpleNamespace(loaded=tiny, decoder=None), SimpleNamespace(loaded=tiny, decoder=object())
    other_weights = SimpleNamespace(loaded=object(), decoder=None)
    for _ in range(MIN_MEASURED - 1):
        costs.observe(eager, report([(1, "decode", 1)], 2.0))
    # Not a plain one-request eager step on these weights: none of these counts.
    costs.observe(eager, report([(1, "decode", 1), (2, "decode", 1)], 9.0))
    costs.observe(eager, report([(1, "speculative", 3)], 9.0))
    costs.observe(eager, report([(1, "decode", 1)], 9.0, compile_ms=8.0))
    costs.observe(compiled, report([(1, "decode", 1)], 9.0))
    costs.observe(other_weights, report([(1, "decode", 1)], 9.0))
    assert costs.decode_ms == 50.0 and len(probes) == 1  # too few measured steps yet: the probe
    costs.observe(eager, report([(1, "decode", 1)], 4.0))
    assert costs.decode_ms == 2.0  # the median of the measured steps 2, 2, 2, 4
    for tokens in (40, 48, 60, 64):  # a prefill, or with no KV cache any step: a forward over its tokens
        costs.observe(eager, report([(1, "prefill" if tokens == 40 else "decode", tokens)], tokens / 8))
    assert costs.forward_ms_at(64) == pytest.approx(8.0) and len(probes) == 1
    assert length_bucket(65) not in costs.measured_forward_ms and costs.forward_ms_at(65) > 0 and len(probes) == 2


def test_a_slow_first_probe_does_not_refuse_the_default_race(bundled):
    pool = EnginePool(bundled, max_seq_len=512)
    clock = pool.costs.clock = SlowClock(extra_s=10.0)  # every probe timing of the first moment 10 s slower
    first = next(iter(presets().values()))
    prompt_tokens = len(bundled.tokenizer.prompt_ids(first["prompt"], first.get("system")))
    lanes = list(DEFAULT_LANES.values())
    slow_estimate = sum(pool.estimate_s(lanes, prompt_tokens, DEFAULT_NEW_TOKENS))
    assert slow_estimate > pool.max_run_s  # what refused the default race until a restart
    clock.slow = False
    warm_up(pool)  # before serving: the warm-up race's steps are measured, and replace the slow probes
    assert sum(pool.estimate_s(lanes, prompt_tokens, DEFAULT_NEW_TOKENS)) < slow_estimate / 2
    start_tokens, _ = _start_tokens(pool, first)  # DEFAULT_NEW_TOKENS unless this host is far slower than usual
    lanes_job = {name: (f"lane-{name}", settings) for name, settings in DEFAULT_LANES.items()}
    run = pool.submit(Job("race", lanes_job, (first["prompt"],), system=first.get("system"),
                          max_new_tokens=start_tokens, ignore_eos=True))
    try:  # it runs: both lanes stream, then Stop ends both (the whole race is not needed to show that)
        run.start()
        tokens = {name: 0 for name in DEFAULT_LANES}
        for handle, event in run.events(should_stop=lambda: min(tokens.values()) >= 4):
            if isinstance(event, TokenEvent):
                tokens[handle.tag] += 1
            elif isinstance(event, FinishEvent):
                assert event.stats.finish_reason == "stopped"
    finally:
        run.close()
    assert min(tokens.values()) >= 4 and run.new_tokens == [start_tokens]
    assert sum(run.estimates) < pool.max_run_s
    pool.loop.close()


def test_the_page_starts_with_a_token_count_that_fits(bundled):
    pool = EnginePool(bundled, max_seq_len=128, max_run_s=1.0)
    first = next(iter(presets().values()))
    tokens, note = _start_tokens(pool, first)
    prompt_tokens = len(bundled.tokenizer.prompt_ids(first["prompt"], first.get("system")))
    assert 8 <= tokens < DEFAULT_NEW_TOKENS and tokens % 8 == 0
    assert tokens == 8 or sum(pool.estimate_s(list(DEFAULT_LANES.values()), prompt_tokens, tokens)) \
        <= START_SHARE * pool.max_run_s
    assert f"so the page starts at {tokens} new tokens per lane" in note
    pool.loop.close()
