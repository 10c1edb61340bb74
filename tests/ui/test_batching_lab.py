"""The Batching tab without a browser: the handler on the bundled model (panels, exact counts, preemption in the
small-pool preset, Stop, a closed tab, bad settings) and the view as pure functions of hand-made StepReports."""

from __future__ import annotations

import dataclasses
import re

import pandas as pd
import plotly.graph_objects as go
import pytest

from inference_core.bench.latency import LatencyTargets
from inference_core.engine.engine import StepReport
from ui.batching import (LAB_OUTPUTS, LAB_PRESETS, TYPED, LabMemory, arrival_offsets, output_limits,
                         preset_values, run_batching)
from ui.batching_view import (RESULT_COLUMNS, Arrival, RunRecord, Segment, StepRecord, activity_figure,
                              request_timelines, results_frame, run_numbers, timeline_figure, verdict)
from ui.control import RunControl
from ui.frontier import frontier_figure
from inference_core import load_model
from inference_core.engine.compiled import compile_unavailable
from serving.pool import EnginePool
from tiny_models import build_tiny_model

SMALL_POOL = next(name for name in LAB_PRESETS if name.startswith("small KV pool"))
BURST = "all at once (burst)"
SAME = "max new tokens for every request"


@pytest.fixture(scope="module")
def lab_pool(bundled, one_torch_thread):
    return EnginePool(bundled, max_seq_len=512)


def _settings(**overrides) -> dict:
    settings = dict(preset="8 mixed chat/code prompts", mode="continuous", num_requests=4, max_new_tokens=8,
                    lengths=SAME, max_num_seqs=8, kv_pool_tokens=0, arrival=BURST, rate=4.0, seed=0)
    return {**settings, **overrides}


def _run(pool, control=None, **overrides) -> list[dict]:
    return [dict(zip(LAB_OUTPUTS, values)) for values in run_batching(pool, control, **_settings(**overrides))]


def _last(updates: list[dict], name: str):
    """The latest value an output was sent (None if never)."""
    values = [u[name] for u in updates if not (isinstance(u[name], dict) and u[name].get("__type__") == "update"
                                               and "value" not in u[name])]
    return values[-1] if values else None


def _idle(pool) -> bool:
    return pool.loop.status() == []  # no engine on the loop has a request queued or running


def test_small_continuous_run_fills_every_panel(lab_pool):
    updates = _run(lab_pool, slo_ttft_ms=60000, slo_tpot_ms="")  # an empty box: no TPOT target
    assert updates[0]["run_button"]["interactive"] is False and updates[-1]["run_button"]["interactive"] is True
    last = updates[-1]
    assert last["status"].startswith("Finished. Under TTFT <= 60000 ms: continuous 100% of requests met them, a "
                                     "goodput of ")
    assert "continuous batching: 4 requests, 32 output tokens" in last["status"]
    table = last["results"]
    assert isinstance(table, pd.DataFrame) and list(table.columns) == list(RESULT_COLUMNS)
    row = table.iloc[0]
    assert (len(table), row["mode"], row["requests"], row["output tokens"], row["preemptions"]) == (
        1, "continuous", 4, 32, 0)  # greedy chats run past 8 tokens: no end of text
    assert 1 <= row["mean batch size"] <= 4 and row["TTFT p50 (ms)"] <= row["TTFT p95 (ms)"]
    assert row["latency p50 (s)"] <= row["latency p95 (s)"] <= row["wall time (s)"]
    assert row["throughput (tok/s)"] == pytest.approx(32 / row["wall time (s)"], rel=0.01)
    assert row["SLO met (%)"] == 100.0 and row["goodput (req/s)"] == pytest.approx(4 / row["wall time (s)"], rel=0.01)
    assert row["TPOT p95 (ms)"] > 0  # 8 tokens each, counted per request as the engine delivered them
    timeline = last["timeline"]
    assert isinstance(timeline, go.Figure)
    by_name = {trace.name: trace for trace in timeline.data}
    assert {"queued", "prefill (prompt or recompute)", "decode", "finished"} <= set(by_name)
    assert "preempted (KV taken back)" not in by_name
    assert sorted(by_name["finished"].y) == ["#1 chat-short-1", "#2 code-1", "#3 chat-med-1", "#4 code-2"]
    assert isinstance(last["chart"], go.Figure) and len(last["chart"].data) >= 4
    assert "continuous pool at its fullest" in last["pool"] and "0 blocks held (every request" in last["pool"]
    assert _idle(lab_pool)


def test_small_pool_preset_preempts(lab_pool):
    _, new_tokens, lengths, kv_tokens, arrival = preset_values(SMALL_POOL)
    assert (new_tokens, lengths, kv_tokens, arrival) == (16, SAME, 480, BURST)
    # Four of its prompts are enough: three fill the 30 blocks, and the second needs an 11th after 12 tokens.
    last = _run(lab_pool, preset=SMALL_POOL, num_requests=4, max_new_tokens=new_tokens, kv_pool_tokens=kv_tokens,
                arrival=arrival)[-1]
    row = last["results"].iloc[0]
    assert row["requests"] == 4 and row["output tokens"] == 64 and row["preemptions"] > 0
    assert "preempted (KV taken back)" in {trace.name for trace in last["timeline"].data}
    assert re.search(rf"continuous: {row['preemptions']} preemptions?: the pool's 30 blocks ran out", last["status"])
    assert _idle(lab_pool)


def test_race_of_two_modes_then_stop_skips_the_second(lab_pool):
    control = RunControl()
    control.arm()
    updates = []
    for values in run_batching(lab_pool, control, **_settings(mode="race: continuous vs static",
                                                              max_new_tokens=64)):
        updates.append(dict(zip(LAB_OUTPUTS, values)))
        if len(updates) == 3:
            control.request_stop()
    last = updates[-1]
    assert last["status"].startswith("Stopped: every request ended")
    assert list(last["results"]["mode"]) == ["continuous"]  # static never started
    assert last["results"].iloc[0]["output tokens"] < 4 * 64
    assert _idle(lab_pool)


def test_closing_the_handler_cancels_every_request(lab_pool):
    run = run_batching(lab_pool, None, **_settings(max_new_tokens=64))
    for _ in range(3):
        next(run)
    run.close()
    assert _idle(lab_pool)


@pytest.mark.parametrize("overrides, message", [
    (dict(num_requests=32, max_new_tokens=256), "asks for 8192 new tokens (32 requests x 256), over this tab's "
                                                "limit of 4096"),
    (dict(mode="race: continuous vs none", num_requests=16, max_new_tokens=256), "x 2 modes"),
    (dict(num_requests=0), "'requests' must be a whole number from 1 to 32"),
    (dict(preset=TYPED, typed_prompts="  \n "), "no prompts typed"),
    (dict(preset=SMALL_POOL, kv_pool_tokens=128), "raise 'KV pool (tokens)' or lower 'max new tokens'"),
    (dict(kv_pool_tokens=10 ** 6), "Lower 'KV pool (tokens)'"),
    (dict(arrival="Poisson arrivals", rate=0), "'Poisson rate (requests/s)' must be a number from 0.01 to 100"),
    (dict(seed="abc"), "'seed' must be a whole number from 0 to 2.14748e+09, got 'abc'"),
    (dict(mode="round robin"), "unknown batching mode"),
    (dict(slo_tpot_ms=0.5), "'TPOT target (ms)' must be a number from 1 to 1e+06, got 0.5"),
    (dict(slo_ttft_ms="soon"), "'TTFT target (ms)' must be a number"),
])
def test_bad_settings_get_a_message(lab_pool, overrides, message):
    updates = _run(lab_pool, **overrides)
    assert len(updates) == 1
    assert updates[0]["status"].startswith("**Cannot start the run:**") and message in updates[0]["status"]
    assert updates[0]["run_button"]["interactive"] is True


def test_compiled_runs_where_compiling_works_and_says_so_elsewhere(lab_pool, monkeypatch):
    monkeypatch.setattr("ui.batching.compile_unavailable", lambda device: "no C++ compiler")
    status = _run(lab_pool, compiled=True)[0]["status"]
    assert status == ("**Cannot start the run:** compiled steps are not available on this device (no C++ compiler); "
                      "untick 'compiled'.")


@pytest.fixture(scope="module")
def chat_tiny(tmp_path_factory):
    """The tiny model with a chat template of its own (the lab sends every prompt as a chat)."""
    directory = tmp_path_factory.mktemp("tiny-chat")
    build_tiny_model(directory)
    (directory / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }} {% endfor %}")
    return load_model(str(directory), device="cpu", dtype="float32")


def test_a_compiled_race_of_continuous_and_dynamic_compiles_every_step(chat_tiny, one_torch_thread, monkeypatch):
    """The lab's 'compiled' setting: each mode's packages are readied before its timed run (a status says so), its
    prompts, mixed steps and decodes all run through them (the final status counts them, none eager), and the
    requests get what the eager engine gives them. Compiled without max-autotune (minutes less on a tiny model;
    the options are not what this test is about)."""
    if compile_unavailable(chat_tiny.device) is not None:
        pytest.skip(compile_unavailable(chat_tiny.device))
    monkeypatch.setattr("inference_core.engine.engine.default_options", lambda device, model: {"freezing": True})
    pool = EnginePool(chat_tiny, max_seq_len=128)
    typed = "t5 t6 t7 t8 t9\nt10 t11 t12\nt13 t14 t15 t16 t17 t18 t19 t20 t21 t22 t23 t24 t25 t26 t27 t28 t29"
    settings = dict(preset=TYPED, typed_prompts=typed, mode="race: continuous vs dynamic", num_requests=4,
                    max_new_tokens=8, lengths="varied (1/8 to all of max new tokens, seeded)", max_num_seqs=2)
    memory = LabMemory()
    eager, compiled = _run(pool, **settings)[-1], _run(pool, compiled=True, memory=memory, **settings)
    statuses = [update["status"] for update in compiled if isinstance(update["status"], str)]
    assert [s for s in statuses if s.startswith("Readying")] == [
        f"Readying {mode} batching's compiled steps (batch sizes 1, 2, and prompts): loaded from disk where this "
        "host built them before, else compiled now, about a minute each. This time is not in the figures."
        for mode in ("continuous", "dynamic")]
    last = compiled[-1]
    assert "every step compiled" in statuses[0]
    assert re.search(r"Compiled steps: continuous: \d+ forwards compiled, none eager, dynamic: \d+ forwards "
                     r"compiled, none eager\.$", last["status"]), last["status"]
    assert list(last["results"]["output tokens"]) == list(eager["results"]["output tokens"])
    assert [step.report.compile_ms for record in memory.records for step in record.steps] == [0.0] * sum(
        len(record.steps) for record in memory.records)  # no package was built or loaded inside a timed step
    assert _idle(pool)


def test_an_emptied_target_box_is_no_target():
    """The browser sends an emptied number box as 0."""
    from ui.batching import latency_targets

    assert not latency_targets(0, None).given and not latency_targets("", 0).given
    assert latency_targets(0, 120).given


def test_typed_prompts_repeat_up_to_n(lab_pool):
    last = _run(lab_pool, preset=TYPED, typed_prompts="Hi\n\nName a colour.", num_requests=3, max_new_tokens=4)[-1]
    assert sorted(last["timeline"].data[-1].y) == ["#1 typed", "#2 typed", "#3 typed"]
    assert last["results"].iloc[0]["requests"] == 3


def test_arrival_offsets():
    assert arrival_offsets(3, "burst", 4.0, 0) == [0.0, 0.0, 0.0]
    poisson = arrival_offsets(200, "poisson", 4.0, 7)
    assert poisson == arrival_offsets(200, "poisson", 4.0, 7) != arrival_offsets(200, "poisson", 4.0, 8)
    assert poisson[0] == 0.0 and all(b > a for a, b in zip(poisson, poisson[1:]))
    assert 0.2 < poisson[-1] / 199 < 0.3  # mean gap 1/rate = 0.25 s


# --- the view on hand-made reports -------------------------------------------------------------------------------

def _report(index, started_at, work, preempted=(), finished=(), blocks=4, waiting=0):
    return StepReport(index, started_at, 125.0, tuple(work), tuple(preempted), tuple(finished), waiting, len(work),
                      blocks)


def _record() -> RunRecord:
    """Request 1 arrives at 0, request 2 at 0.5; request 2 is preempted in step 4 and recomputes in step 6. Steps
    start every 0.25 s and take 0.125 s (exact in binary)."""
    record = RunRecord("continuous", 8, 10, started_at=0.0, arrivals=[Arrival(1, "#1 a", 0.0), Arrival(2, "#2 b", 0.5)])
    record.steps = [
        StepRecord(_report(1, 1.0, [(1, "prefill", 30)]), 1, (1,)),
        StepRecord(_report(2, 1.25, [(1, "decode", 1), (2, "prefill", 20)]), 2, (2,)),
        StepRecord(_report(3, 1.5, [(1, "decode", 1), (2, "decode", 1)]), 2),
        StepRecord(_report(4, 1.75, [(1, "decode", 1)], preempted=[2], blocks=9, waiting=1), 1),
        StepRecord(_report(5, 2.0, [(1, "decode", 1)], finished=[1], waiting=1), 1),
        StepRecord(_report(6, 2.25, [(2, "prefill", 22)]), 0),
        StepRecord(_report(7, 2.5, [(2, "decode", 1)], finished=[2]), 1),
    ]
    return record


def test_timeline_segments_have_exact_boundaries():
    record = _record()
    first, second = request_timelines(record.arrivals, record.steps, now=9.0)
    assert first.segments == (Segment("queued", 0.0, 1.0), Segment("prefill", 1.0, 1.125),
                              Segment("decode", 1.25, 2.125))
    assert first.finished_at == 2.125
    assert second.segments == (Segment("queued", 0.5, 1.25), Segment("prefill", 1.25, 1.375),
                               Segment("decode", 1.5, 1.625), Segment("preempted", 1.75, 2.25),
                               Segment("prefill", 2.25, 2.375), Segment("decode", 2.5, 2.625))
    assert second.finished_at == 2.625
    # Live: after step 4, request 2 is preempted up to now, and a request that has just arrived is queued.
    record.arrivals.append(Arrival(3, "#3 c", 1.8))
    _, second, third = request_timelines(record.arrivals, record.steps[:4], now=1.9)
    assert second.segments[-1] == Segment("preempted", 1.75, 1.9) and second.finished_at is None
    assert third.segments == (Segment("queued", 1.8, 1.9),)


def test_results_are_computed_from_the_steps():
    record = _record()
    record.ended = True
    numbers = run_numbers(record, now=99.0)
    # TTFT: step 1 ends at 1.125 (request 1 arrived at 0), step 2 at 1.375 (request 2 arrived at 0.5).
    # Latency: 2.125 - 0 and 2.625 - 0.5. Wall time: 0 to the end of step 7.
    assert numbers == {
        "mode": "continuous", "requests": 2, "output tokens": 8, "wall time (s)": 2.62,
        "throughput (tok/s)": round(8 / 2.625, 1), "TTFT p50 (ms)": 1000, "TTFT p95 (ms)": 1112,
        "latency p50 (s)": 2.12, "latency p95 (s)": 2.12, "TPOT p95 (ms)": None, "goodput (req/s)": None,
        "SLO met (%)": None, "preemptions": 1, "mean batch size": round(9 / 7, 2),
        "padding tokens": 0, "device time (s)": 0.88}
    assert list(results_frame([record], 99.0).iloc[0]) == ["-" if numbers[c] is None else numbers[c]
                                                           for c in RESULT_COLUMNS]  # no targets: "-"
    # A static batch's padding: prompt padding tokens plus finished members' rows, summed over the steps.
    record.steps[0] = StepRecord(dataclasses.replace(record.steps[0].report, prompt_padding_tokens=9), 1)
    record.steps[1] = StepRecord(dataclasses.replace(record.steps[1].report, padding_rows=2), 1)
    assert run_numbers(record, now=99.0)["padding tokens"] == 11


def test_goodput_is_computed_from_the_same_steps():
    """Tokens per request as the engine delivered them: request 1 got 1 in step 1 and 1 in each of steps 2-5 (5),
    request 2 one in steps 2, 3 and 7 (its recompute in step 6 emits none): 3."""
    record = _record()
    per_step = [((1, 1),), ((1, 1), (2, 1)), ((1, 1), (2, 1)), ((1, 1),), ((1, 1),), (), ((2, 1),)]
    record.steps = [dataclasses.replace(step, request_tokens=tokens) for step, tokens in zip(record.steps, per_step)]
    record.targets = LatencyTargets(ttft_ms=1000, tpot_ms=700)
    # Request 1: TTFT 1125 ms, latency 2125 ms, TPOT (2125 - 1125) / 4 = 250 ms: misses the TTFT target.
    # Request 2: TTFT 1375 - 500 = 875 ms, latency 2625 - 500 = 2125 ms, TPOT (2125 - 875) / 2 = 625 ms: meets both.
    live = run_numbers(record, now=99.0)
    assert (live["goodput (req/s)"], live["SLO met (%)"]) == (None, None)  # not judged while the mode runs
    record.ended = True
    numbers = run_numbers(record, now=99.0)
    assert (numbers["goodput (req/s)"], numbers["SLO met (%)"]) == (0.381, 50.0)  # 1 request / 2.625 s; 1 of 2
    assert numbers["TPOT p95 (ms)"] == pytest.approx(606.25, abs=0.05)  # 250 + 0.95 * (625 - 250)
    record.targets = LatencyTargets(tpot_ms=250)  # request 1 at the target exactly; request 2 over it
    assert run_numbers(record, now=99.0)["SLO met (%)"] == 50.0
    other = _record()
    other.ended, other.mode = True, "static"
    text = verdict([record, other], now=99.0)
    assert "Under TPOT <= 250 ms: continuous 50% of requests met them, a goodput of 0.381 requests/s." in text


def test_frontier_draws_each_mode_through_its_rates():
    def row(name, rate, tokens_per_s, p95_ms, goodput):
        return {"name": name, "rate_requests_per_s": rate, "throughput_tokens_per_s": tokens_per_s,
                "latency_ms_p95": p95_ms, "ttft_ms_p95": 100.0, "tpot_ms_p95": 80.0,
                "goodput_requests_per_s": goodput, "slo_attainment_pct": 50.0}
    sweep = [row("continuous", 2, 60.0, 4000.0, 1.5), row("continuous", 0.5, 20.0, 2500.0, 0.5),
             row("static", 0.5, 15.0, 9000.0, 0.0), row("hf-static", 0.5, 14.0, 9500.0, None)]
    figure = frontier_figure(sweep)
    assert [trace.name for trace in figure.data] == ["continuous", "static", "hf-static"]
    continuous, static, peer = figure.data
    assert list(continuous.x) == [2.5, 4.0] and list(continuous.y) == [20.0, 60.0]  # in order of rate
    assert list(continuous.text) == ["0.5/s", "2/s"] and "goodput 1.5 requests/s" in continuous.hovertext[1]
    assert static.line.dash == "solid" and peer.line.dash == "dash" and "no latency target" in peer.hovertext[0]
    assert figure.layout.xaxis.title.text.startswith("p95 latency")
    assert "A request-rate sweep" in frontier_figure([]).layout.annotations[0].text


def test_figures_draw_every_state_and_step():
    record = _record()
    timeline = timeline_figure([record], now=3.0)
    bars = {trace.name: trace for trace in timeline.data if isinstance(trace, go.Bar)}
    assert list(bars["preempted (KV taken back)"].base) == [1.75] and list(bars["preempted (KV taken back)"].x) == [0.5]
    assert list(bars["decode"].y) == ["#1 a", "#2 b", "#2 b"]
    assert list(timeline.data[-1].x) == [2.125, 2.625]  # finished marks
    chart = activity_figure([record])
    batch, waiting, rate, blocks, pool_line, preemptions = chart.data
    assert list(batch.y) == [1, 2, 2, 1, 1, 1, 1] and list(waiting.y) == [0, 0, 0, 1, 1, 0, 0]
    assert list(blocks.y) == [4, 4, 4, 9, 4, 4, 4]
    assert list(rate.y) == [8.0, 16.0, 16.0, 8.0, 8.0, 0.0, 8.0]  # tokens emitted / 0.125 s
    assert list(pool_line.y) == [10, 10] and list(preemptions.x) == [1.75]
    empty = timeline_figure([], 0.0)
    assert "One row per request" in empty.layout.annotations[0].text


def test_output_limits():
    assert output_limits(3, 32, "same", 0) == [32, 32, 32]
    varied = output_limits(50, 64, "varied", 3)
    assert varied == output_limits(50, 64, "varied", 3) != output_limits(50, 64, "varied", 4)
    assert all(8 <= limit <= 64 for limit in varied) and len(set(varied)) > 10


def test_stop_pressed_before_the_run_starts(lab_pool):
    control = RunControl()
    control.arm()
    control.request_stop()
    updates = _run(lab_pool, control)
    assert len(updates) == 1 and updates[0]["status"] == "Stopped before the run started: nothing ran."


def test_device_time_limit_stops_the_run(bundled, one_torch_thread):
    limited = EnginePool(bundled, max_seq_len=512, max_run_s=0.2)
    last = _run(limited, mode="race: continuous vs static", max_new_tokens=64)[-1]
    assert last["status"].startswith("Stopped at this app's limit of 0.2 s of device time per run")
    assert list(last["results"]["mode"]) == ["continuous"] and last["results"].iloc[0]["output tokens"] < 4 * 64
    assert limited.loop.status() == []
    limited.loop.close()


def test_a_finished_run_lets_go_of_its_engines(lab_pool, monkeypatch):
    """The engine loop keeps no reference to an idle engine nobody listens to, so each run's engine and KV pool are
    freed when the run ends."""
    import gc
    import weakref

    from ui.batching import LabPlan

    engines, make = [], LabPlan.engine

    def engine(plan, pool, mode):
        made = make(plan, pool, mode)
        engines.append(weakref.ref(made[0]))
        return made
    monkeypatch.setattr(LabPlan, "engine", engine)
    _run(lab_pool, mode="race: continuous vs static", max_new_tokens=4)
    _run(lab_pool, max_new_tokens=4)
    gc.collect()
    assert [ref() is None for ref in engines] == [True, True, True]


def test_verdict_names_the_winner_from_the_table_numbers():
    fast, slow = _record(), _record()
    fast.ended = slow.ended = True
    slow.mode, slow.started_at = "static", -2.625  # the same steps over twice the wall time
    text = verdict([slow, fast], now=99.0)
    assert text.startswith("**continuous batching served 2.00x the throughput of static batching** (3.0 vs 1.5 "
                           "tok/s) on the same 2 requests.")
    assert "static: 1 preemption: the pool's 10 blocks ran out" in text
