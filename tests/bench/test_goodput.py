"""Goodput under latency targets, from hand-made per-request records: a batch-bench row's TPOT, goodput and SLO
attainment come from the same `Timing` records as its TTFT and latency percentiles and its throughput (the same
wall clock), with exact expected numbers; one-token answers, unfinished requests, one target alone, and bad targets
and rates."""

from __future__ import annotations

import math

import pytest

from inference_core.bench.batching import ROW_KEYS, summarize
from inference_core.bench.latency import LatencyTargets, Timing, meets, parse_rates, slo_summary, tpot_ms
from inference_core.config import ConfigError

# Times in seconds, exact in binary. Per request: TTFT ms, latency ms, tokens, TPOT ms = (latency - TTFT) / (tokens - 1)
TIMINGS = [
    Timing(0.0, 0.125, 0.5, 6),  # 125, 500, 6: TPOT 75
    Timing(0.0, 0.25, 0.375, 6, preemptions=1),  # 250, 375, 6: TPOT 25
    Timing(0.5, 0.625, 0.625, 1),  # 125, 125, 1: one token, no TPOT
    Timing(0.5, 1.0, 1.25, 11),  # 500, 750, 11: TPOT 25
    Timing(1.0, 1.0625, 1.5625, 5),  # 62.5, 562.5, 5: TPOT 125
]
WALL_S = 1.5625  # first arrival (0.0) to last completion (1.5625)


def test_a_row_judges_its_own_records():
    # TTFT <= 250 ms (met by 1, 2, 3, 5) and TPOT <= 50 ms (met by 2, 4, and 3: a one-token answer meets any TPOT
    # target): requests 2 and 3 meet both, 2 of 5 in 1.5625 s.
    row = summarize("continuous", TIMINGS, [1, 2, 3], LatencyTargets(ttft_ms=250, tpot_ms=50))
    assert tuple(row) == ROW_KEYS
    assert row == {
        "name": "continuous", "requests": 5, "output_tokens": 29, "throughput_tokens_per_s": 18.56,  # 29 / 1.5625
        "ttft_ms_p50": 125.0, "ttft_ms_p95": 450.0,  # of 62.5, 125, 125, 250, 500
        "latency_ms_p50": 500.0, "latency_ms_p95": 712.5,  # of 125, 375, 500, 562.5, 750
        "preemptions": 1, "mean_batch_size": 2,
        "tpot_ms_p50": 50.0, "tpot_ms_p95": 117.5,  # of 25, 25, 75, 125 (the one-token answer left out)
        "goodput_requests_per_s": 1.28, "slo_attainment_pct": 40.0}  # 2 / 1.5625 s; 2 of 5


@pytest.mark.parametrize("targets, goodput, attainment", [
    (LatencyTargets(ttft_ms=250), 2.56, 80.0),  # requests 1, 2, 3, 5
    (LatencyTargets(tpot_ms=50), 1.92, 60.0),  # requests 2, 3, 4
    (LatencyTargets(ttft_ms=62.5, tpot_ms=125), 0.64, 20.0),  # request 5, both at the target exactly
    (LatencyTargets(), None, None),  # no target: no goodput
    (None, None, None),
])
def test_each_target_alone_and_none(targets, goodput, attainment):
    row = summarize("static", TIMINGS, [], targets)
    assert (row["goodput_requests_per_s"], row["slo_attainment_pct"]) == (goodput, attainment)
    assert (row["tpot_ms_p50"], row["tpot_ms_p95"]) == (50.0, 117.5)  # measured with or without targets


def test_one_token_answers_and_unfinished_requests():
    assert tpot_ms(125.0, 125.0, 1) is None and tpot_ms(100.0, 400.0, 4) == 100.0
    strict = LatencyTargets(ttft_ms=200, tpot_ms=1)
    assert meets(125.0, 125.0, 1, strict)  # one token: TTFT alone judges it
    assert not meets(250.0, 250.0, 1, strict)
    assert not meets(100.0, math.nan, 3, LatencyTargets(ttft_ms=200))  # never finished
    assert not meets(math.nan, math.nan, 0, LatencyTargets(tpot_ms=50))  # never started
    # Only one-token answers: no TPOT percentiles; an unfinished request counts against attainment.
    summary = slo_summary([100.0, 100.0, math.nan], [100.0, 100.0, math.nan], [1, 1, 0], 0.5,
                          LatencyTargets(ttft_ms=150))
    assert summary == {"tpot_ms_p50": None, "tpot_ms_p95": None, "goodput_requests_per_s": 4.0,
                       "slo_attainment_pct": 66.7}


def test_bad_targets_and_rates_say_what_to_change():
    with pytest.raises(ConfigError, match="the TTFT target must be a number of milliseconds above 0"):
        LatencyTargets(ttft_ms=0)
    with pytest.raises(ConfigError, match="the TPOT target"):
        LatencyTargets(tpot_ms=math.inf)
    assert LatencyTargets(500, 62.5).describe() == "TTFT <= 500 ms and TPOT <= 62.5 ms"
    assert parse_rates("0.5,1, 2,4") == [0.5, 1.0, 2.0, 4.0]
    for text in ("", "1,x", "0,1", "-2"):
        with pytest.raises(ConfigError, match="like 0.5,1,2,4"):
            parse_rates(text)
