"""The API load test (`server.load_test`): a small run in-process passes every check (no 5xx, bad bodies refused
with a 400 naming the problem, dropped streams cancelled, no KV block held after), and its plan and checks count
what they claim."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from server.load_test import (BAD_BODIES, Outcome, Planned, make_plan, read_metrics, run_load, send_bad,
                               start_in_process, summarize)

PROMPT_IDS = ["a", "b", "c"]


@pytest.fixture(scope="module")
def api(bundled, one_torch_thread):
    server, pool = start_in_process(bundled, clients=6, max_tokens=8)
    yield server, pool
    server.stop()


def test_a_small_load_run_passes_every_check(api):
    server, pool = api
    report = asyncio.run(run_load(server.url, requests=24, clients=6, disconnect_fraction=0.25, bad_fraction=0.25,
                                  max_tokens=8, pool=pool))
    summary = report["summary"]
    assert report["problems"] == []
    assert report["checks"] == {name: True for name in report["checks"]}
    assert (summary["good_requests"], summary["dropped_streams"], summary["bad_bodies"]) == (12, 6, 6)
    # A dropped stream ends as cancelled, or as finished when it ended before the server saw the drop; with 8 new
    # tokens and a drop after at most 3, most are cancelled.
    assert summary["cancelled"] + summary["late_disconnects"] == 6 and summary["cancelled"] >= 1
    assert summary["server_counters"]["finished"] == 12 + summary["late_disconnects"]
    assert (summary["kv_blocks_in_use"], summary["pool_blocks_in_use"], summary["pool_active_requests"]) == (0, 0, 0)
    assert summary["generated_tokens"] > 0 and summary["ttft_ms_p50"] is not None
    assert len(report["requests"]) == 24 and sum(row["requests"] for row in report["rows"]) == 24


def test_every_bad_body_is_a_400_that_names_the_problem(api):
    server, _ = api

    async def send_all() -> list[Outcome]:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            model = (await client.get("/v1/models")).json()["data"][0]["id"]
            outcomes = []
            for index, (_, endpoint, _, _) in enumerate(BAD_BODIES):
                outcome = Outcome(Planned(index, endpoint, "bad", "a", bad=index))
                await send_bad(client, outcome.planned, model, outcome)
                outcomes.append(outcome)
            return outcomes

    outcomes = asyncio.run(send_all())
    assert [(o.status, o.problem) for o in outcomes] == [(400, None)] * len(BAD_BODIES)


def test_the_plan_has_the_asked_fractions_and_is_seeded():
    plan = make_plan(200, 0.2, 0.1, PROMPT_IDS, seed=0)
    modes = [p.mode for p in plan]
    assert (modes.count("bad"), modes.count("disconnect")) == (20, 40)
    assert modes.count("whole") + modes.count("stream") == 140
    assert min(modes.count("whole"), modes.count("stream")) > 0
    assert sorted({p.bad for p in plan if p.mode == "bad"}) == list(range(len(BAD_BODIES)))
    assert {p.disconnect_after for p in plan if p.mode == "disconnect"} == {1, 2, 3}
    assert all(p.endpoint == BAD_BODIES[p.bad][1] for p in plan if p.mode == "bad")
    assert plan == make_plan(200, 0.2, 0.1, PROMPT_IDS, seed=0)
    assert plan != make_plan(200, 0.2, 0.1, PROMPT_IDS, seed=1)
    with pytest.raises(ValueError, match="more than every request"):
        make_plan(10, 0.6, 0.5, PROMPT_IDS)


def test_read_metrics_takes_the_api_counters_and_the_kv_gauge():
    text = ('# TYPE playground_requests counter\n'
            'playground_requests_total{outcome="finished",source="api"} 7.0\n'
            'playground_requests_total{outcome="cancelled",source="api"} 3.0\n'
            'playground_requests_total{outcome="cancelled",source="page"} 5.0\n'
            '# TYPE playground_http_requests counter\n'
            'playground_http_requests_total{endpoint="/v1/completions",status="200"} 9.0\n'
            'playground_http_requests_total{endpoint="/v1/completions",status="500"} 2.0\n'
            '# TYPE playground_kv_blocks_in_use gauge\n'
            'playground_kv_blocks_in_use 4.0\n')
    assert read_metrics(text) == {"finished": 7.0, "cancelled": 3.0, "failed": 0.0, "http_5xx": 2.0,
                                  "kv_blocks_in_use": 4.0}


def test_the_checks_fail_on_a_5xx_a_lost_cancel_and_a_held_block():
    good = Outcome(Planned(0, "completions", "whole", "a"), status=500, latency_s=0.1, problem="500 'boom'")
    dropped = Outcome(Planned(1, "chat", "disconnect", "a", disconnect_after=1), status=200, latency_s=0.1)
    delta = {"finished": 0.0, "cancelled": 0.0, "failed": 0.0, "http_5xx": 1.0}
    gauges = {"kv_blocks_in_use": 3.0, "pool_blocks_in_use": 3, "pool_active_requests": 1, "in_process": True}
    report = summarize([good, dropped], [good], [dropped], delta, gauges, 1.0, "m", {})
    assert report["checks"] == {"no 5xx (clients)": False, "no 5xx (server's count)": False,
                                "every good request a complete 200 (dropped: a 200 stream)": False,
                                "every bad body a 400 naming the problem": True,
                                "every dropped stream ended on the server": False,
                                "no KV block held at the end": False}
    assert report["passed"] is False
    assert report["problems"] == ["#0 whole completions: 500 'boom'"]
