"""What the Batching tab shows, as pure functions of plain values: each request's timeline, the per-step activity
chart (batch size, tokens/s, KV blocks in use), the results table and the sentence that says who won.

Everything is built from a `RunRecord`, the plain values the handler (`ui.batching`) collects for one batching mode's
run: when each request was submitted (`Arrival`) and, per engine step, the engine's `StepReport` with the tokens that
step emitted (`StepRecord`, counted as the engine delivered them). Times are `time.perf_counter()` seconds; the
figures put x = 0 at the run's start. No engine, no tensors, no clocks are read here, so every function can be tested
on hand-made reports.

A request's timeline, from the reports: "queued" from its arrival to its first step; "prefill" and "decode" for the
steps it took part in (consecutive steps of one kind drawn as one segment, from the first one's start to the last
one's end); "preempted" from the start of the step that took its KV back to its next step (where it recomputes:
"prefill" again); "finished" is a mark at the end of the step that ended it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from inference_core.bench.latency import LatencyTargets, slo_summary
from inference_core.engine.engine import StepReport
from inference_core.roofline import steps_point

STATE_COLOURS = {"queued": "#cbd5e1", "prefill": "#f59e0b", "decode": "#2563eb", "preempted": "#dc2626",
                 "finished": "#16a34a"}
STATE_LABELS = {"queued": "queued", "prefill": "prefill (prompt or recompute)", "decode": "decode",
                "preempted": "preempted (KV taken back)", "finished": "finished"}
MODE_COLOURS = {"continuous": "#2563eb", "dynamic": "#9333ea", "static": "#ea580c", "none": "#475569"}
RESULT_COLUMNS = ("mode", "requests", "output tokens", "wall time (s)", "throughput (tok/s)", "TTFT p50 (ms)",
                  "TTFT p95 (ms)", "latency p50 (s)", "latency p95 (s)", "TPOT p95 (ms)", "goodput (req/s)",
                  "SLO met (%)", "preemptions", "mean batch size", "padding tokens", "device time (s)")
# What each column measures (the note under the table).
RESULT_NOTES = (
    "TTFT and latency are wall clock from a request's arrival (its submission) to the end of the engine step that "
    "produced its first token / its last token; throughput is all output tokens over the wall time from the run's "
    "start to its last token; mean batch size is the sequences per engine step; padding tokens are what a static "
    "batch computes and throws away (prompts padded to the batch's longest, finished members' rows); device time is "
    "the sum of the engine's step times. p95 is over this run's requests (linear interpolation). TPOT, time per "
    "output token, is (latency - TTFT) / (output tokens - 1) (one-token answers left out); with latency targets set, "
    "goodput is the requests whose TTFT and TPOT both met them per second of the same wall time (a one-token answer "
    "meets any TPOT target, an unfinished one none), and 'SLO met' their share of the requests; '-' without targets "
    "or before the mode has ended.")


def mode_name(mode: str) -> str:
    return "no batching (one request at a time)" if mode == "none" else f"{mode} batching"


@dataclass(frozen=True, slots=True)
class Arrival:
    request_id: int
    label: str  # "#3 chat-short-1": the row's name in the timeline
    at: float  # perf_counter when it was submitted


@dataclass(frozen=True, slots=True)
class StepRecord:
    report: StepReport
    output_tokens: int  # tokens this step emitted (a decode, or a prefill that completed its text, emits one)
    first_tokens: tuple[int, ...] = ()  # request ids whose first token this step produced
    request_tokens: tuple[tuple[int, int], ...] = ()  # (request id, tokens this step emitted for it)


@dataclass
class RunRecord:
    """One batching mode's run. The handler's threads only append to the lists (a reader copies them first)."""

    mode: str
    max_num_seqs: int
    num_blocks: int  # the paged pool's size
    started_at: float
    arrivals: list[Arrival] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    ended: bool = False  # every request has ended (or the run was stopped)
    targets: LatencyTargets = field(default_factory=LatencyTargets)  # what goodput counts
    compile_stats: dict | None = None  # a compiled run's `CompileStats.as_dict()` once it has ended (None: eager)


def compiled_words(records: list[RunRecord]) -> str:
    """What the compiled runs' stats say: each mode's steps through a compiled package, and those that ran eager
    and why ('' where no run was compiled)."""
    parts = []
    for record in records:
        stats = record.compile_stats
        if stats is None:
            continue
        eager = sum(stats["fallbacks"].values())
        why = "; ".join(f"{count} {reason}" for reason, count in stats["fallbacks"].items())
        parts.append(f"{record.mode}: {stats['compiled_steps']} forwards compiled, "
                     + (f"{eager} eager ({why})" if eager else "none eager"))
    return f"Compiled steps: {', '.join(parts)}." if parts else ""


@dataclass(frozen=True, slots=True)
class Segment:
    state: str  # "queued" | "prefill" | "decode" | "preempted"
    start: float
    end: float


@dataclass(frozen=True, slots=True)
class RequestTimeline:
    request_id: int
    label: str
    segments: tuple[Segment, ...]
    finished_at: float | None


def step_end(report: StepReport) -> float:
    return report.started_at + report.duration_ms / 1e3


def request_timelines(arrivals: list[Arrival], steps: list[StepRecord], now: float) -> list[RequestTimeline]:
    """Each submitted request's segments (see the module docstring), in arrival order; a request that has not ended
    has its current state drawn up to `now`."""
    segments: dict[int, list[Segment]] = {a.request_id: [] for a in arrivals}
    waiting = {a.request_id: ("queued", a.at) for a in arrivals}  # request id -> (state, since)
    running: dict[int, list] = {}  # request id -> [kind, start, end, index of its latest step]
    finished: dict[int, float] = {}

    def close(request_id: int) -> None:
        kind, start, end, _ = running.pop(request_id)
        segments[request_id].append(Segment(kind, start, end))

    for record in steps:
        report, end = record.report, step_end(record.report)
        for request_id in report.preempted:
            if request_id in segments and request_id not in finished:
                if request_id in running:
                    close(request_id)
                waiting[request_id] = ("preempted", report.started_at)
        for request_id, kind, _ in report.work:
            if request_id not in segments or request_id in finished:
                continue
            kind = "prefill" if kind == "prefill" else "decode"  # a speculative step decodes
            if request_id in waiting:
                state, since = waiting.pop(request_id)
                segments[request_id].append(Segment(state, since, report.started_at))
            run = running.get(request_id)
            if run is not None and run[0] == kind and run[3] == report.index - 1:
                run[2], run[3] = end, report.index
            else:
                if run is not None:
                    close(request_id)
                running[request_id] = [kind, report.started_at, end, report.index]
        for request_id in report.finished:
            if request_id in segments and request_id not in finished:
                if request_id in running:
                    close(request_id)
                if request_id in waiting:  # stopped before it ran
                    state, since = waiting.pop(request_id)
                    segments[request_id].append(Segment(state, since, end))
                finished[request_id] = end
    for request_id in list(running):
        close(request_id)
    for request_id, (state, since) in waiting.items():
        segments[request_id].append(Segment(state, since, max(now, since)))
    return [RequestTimeline(a.request_id, a.label, tuple(s for s in segments[a.request_id] if s.end > s.start),
                            finished.get(a.request_id)) for a in arrivals]


def timeline_figure(records: list[RunRecord], now: float) -> go.Figure:
    """One row per request (a subplot per mode, sharing the time axis), segments coloured by state."""
    if not records:
        figure = go.Figure()
        figure.add_annotation(text="One row per request appears here as the run goes: queued, prefill, decode, "
                                   "preempted, finished.", xref="paper", yref="paper", x=0.5, y=0.5,
                              showarrow=False, font={"color": "#64748b"})
        figure.update_layout(height=220, template="plotly_white", margin={"l": 40, "r": 20, "t": 20, "b": 40},
                             xaxis={"visible": False}, yaxis={"visible": False})
        return figure
    figure = make_subplots(rows=len(records), cols=1, shared_xaxes=True, vertical_spacing=0.12,
                           subplot_titles=[mode_name(r.mode) for r in records])
    shown = set()
    for row, record in enumerate(records, 1):
        timelines = request_timelines(list(record.arrivals), list(record.steps), now)
        t0 = record.started_at
        for state in ("queued", "prefill", "decode", "preempted"):
            parts = [(t.label, s) for t in timelines for s in t.segments if s.state == state]
            if not parts:
                continue
            figure.add_trace(go.Bar(
                orientation="h", y=[label for label, _ in parts], base=[s.start - t0 for _, s in parts],
                x=[s.end - s.start for _, s in parts], marker_color=STATE_COLOURS[state], name=STATE_LABELS[state],
                legendgroup=state, showlegend=state not in shown,
                customdata=[[s.start - t0, s.end - t0] for _, s in parts],
                hovertemplate="%{y}: " + state + " %{customdata[0]:.2f}-%{customdata[1]:.2f} s<extra></extra>"),
                row=row, col=1)
            shown.add(state)
        ends = [(t.label, t.finished_at - t0) for t in timelines if t.finished_at is not None]
        if ends:
            figure.add_trace(go.Scatter(
                x=[x for _, x in ends], y=[label for label, _ in ends], mode="markers", name="finished",
                marker={"color": STATE_COLOURS["finished"], "symbol": "line-ns", "size": 12,
                        "line": {"width": 3, "color": STATE_COLOURS["finished"]}},
                legendgroup="finished", showlegend="finished" not in shown,
                hovertemplate="%{y}: finished at %{x:.2f} s<extra></extra>"), row=row, col=1)
            shown.add("finished")
        figure.update_yaxes(autorange="reversed", type="category", tickfont={"size": 9}, row=row, col=1)
    rows = sum(len(r.arrivals) for r in records)
    # The legend in a row under the chart: at its right it took half a phone's width from the bars.
    figure.update_layout(height=min(390, max(260, 120 + 14 * rows + 40 * len(records))), template="plotly_white",
                         barmode="overlay", bargap=0.25, margin={"l": 40, "r": 20, "t": 30, "b": 70},
                         legend={"orientation": "h", "yref": "container", "y": 0, "yanchor": "bottom", "x": 0,
                                 "font": {"size": 11}})
    figure.update_xaxes(title_text="wall time since the run started (s)", rangemode="tozero", row=len(records), col=1)
    return figure


def activity_figure(records: list[RunRecord]) -> go.Figure:
    """Per engine step, over wall time: sequences in the step (and requests waiting), output tokens per second of
    the step's own time, and KV blocks in use after it (the pool's size dashed, preemptions marked)."""
    figure = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.09,
                           subplot_titles=("sequences per step (dotted: waiting)",
                                           "output tokens/s within each step", "KV blocks in use (dashed: pool)"))
    marked = False  # the preemption marks' legend entry is shown once
    for record in records:
        steps = list(record.steps)
        colour, t0 = MODE_COLOURS.get(record.mode, "#475569"), record.started_at
        xs = [s.report.started_at - t0 for s in steps]
        group = {"legendgroup": record.mode, "line": {"color": colour, "width": 2, "shape": "hv"}}
        figure.add_trace(go.Scatter(x=xs, y=[s.report.batch_size for s in steps], mode="lines", name=record.mode,
                                    hovertemplate="%{y} sequences at %{x:.2f} s<extra>" + record.mode + "</extra>",
                                    **group), row=1, col=1)
        figure.add_trace(go.Scatter(x=xs, y=[s.report.num_waiting for s in steps], mode="lines",
                                    name=f"{record.mode}: waiting", showlegend=False, legendgroup=record.mode,
                                    line={"color": colour, "width": 1, "dash": "dot", "shape": "hv"},
                                    hovertemplate="%{y} waiting at %{x:.2f} s<extra>" + record.mode + "</extra>"),
                         row=1, col=1)
        rates = [s.output_tokens / (s.report.duration_ms / 1e3) if s.report.duration_ms > 0 else 0 for s in steps]
        figure.add_trace(go.Scatter(x=xs, y=rates, mode="lines", showlegend=False, legendgroup=record.mode,
                                    line={"color": colour, "width": 1.5},
                                    hovertemplate="%{y:.1f} tok/s at %{x:.2f} s<extra>" + record.mode + "</extra>"),
                         row=2, col=1)
        figure.add_trace(go.Scatter(x=xs, y=[s.report.blocks_in_use for s in steps], mode="lines", showlegend=False,
                                    hovertemplate="%{y} blocks at %{x:.2f} s<extra>" + record.mode + "</extra>",
                                    **group), row=3, col=1)
        if xs:
            figure.add_trace(go.Scatter(x=[0, max(xs)], y=[record.num_blocks] * 2, mode="lines", showlegend=False,
                                        line={"color": colour, "width": 1, "dash": "dash"}, hoverinfo="skip"),
                             row=3, col=1)
        hits = [(x, s) for x, s in zip(xs, steps) if s.report.preempted]
        if hits:
            figure.add_trace(go.Scatter(
                x=[x for x, _ in hits], y=[s.report.blocks_in_use for _, s in hits], mode="markers",
                name="preemption", marker={"color": STATE_COLOURS["preempted"], "symbol": "x", "size": 9},
                legendgroup="preemption", showlegend=not marked,
                customdata=[len(s.report.preempted) for _, s in hits],
                hovertemplate="%{customdata} preempted at %{x:.2f} s<extra>" + record.mode + "</extra>"),
                row=3, col=1)
            marked = True
    figure.update_layout(height=460, template="plotly_white", margin={"l": 50, "r": 20, "t": 40, "b": 60},
                         legend={"orientation": "h", "y": -0.12, "x": 0})
    figure.update_yaxes(rangemode="tozero")
    figure.update_xaxes(title_text="wall time since the run started (s)", rangemode="tozero", row=3, col=1)
    return figure


def run_numbers(record: RunRecord, now: float) -> dict:
    """The results row of one run, by RESULT_COLUMNS; None where nothing is measured yet (goodput: until the mode has
    ended, as a running request has not yet met or missed its targets)."""
    arrivals, steps = list(record.arrivals), list(record.steps)
    arrived = {a.request_id: a.at for a in arrivals}
    first_token_at, finished_at, tokens_of = {}, {}, dict.fromkeys(arrived, 0)
    for step in steps:
        end = step_end(step.report)
        for request_id in step.first_tokens:
            first_token_at.setdefault(request_id, end)
        for request_id in step.report.finished:
            finished_at.setdefault(request_id, end)
        for request_id, count in step.request_tokens:
            tokens_of[request_id] = tokens_of.get(request_id, 0) + count
    ttft_ms = [(first_token_at[r] - arrived[r]) * 1e3 for r in first_token_at if r in arrived]
    latency_s = [finished_at[r] - arrived[r] for r in finished_at if r in arrived and r in first_token_at]
    tokens = sum(step.output_tokens for step in steps)
    last = step_end(steps[-1].report) if record.ended and steps else now
    wall_s = max(last - record.started_at, 0.0)
    batches = [step.report.batch_size for step in steps if step.report.work]
    # Every arrived request, in the same order in each list; NaN for a time it never reached.
    slo = slo_summary([(first_token_at.get(r, math.nan) - at) * 1e3 for r, at in arrived.items()],
                      [(finished_at[r] - at) * 1e3 if r in finished_at and r in first_token_at else math.nan
                       for r, at in arrived.items()], [tokens_of[r] for r in arrived], wall_s,
                      record.targets if record.ended else None)
    return {
        "mode": record.mode, "requests": len(arrivals), "output tokens": tokens,
        "wall time (s)": round(wall_s, 2), "throughput (tok/s)": round(tokens / wall_s, 1) if wall_s > 0 else None,
        "TTFT p50 (ms)": _percentile(ttft_ms, 50, 0), "TTFT p95 (ms)": _percentile(ttft_ms, 95, 0),
        "latency p50 (s)": _percentile(latency_s, 50, 2), "latency p95 (s)": _percentile(latency_s, 95, 2),
        "TPOT p95 (ms)": slo["tpot_ms_p95"], "goodput (req/s)": slo["goodput_requests_per_s"],
        "SLO met (%)": slo["slo_attainment_pct"],
        "preemptions": sum(len(step.report.preempted) for step in steps),
        "mean batch size": round(sum(batches) / len(batches), 2) if batches else None,
        "padding tokens": sum(step.report.prompt_padding_tokens + step.report.padding_rows for step in steps),
        "device time (s)": round(sum(step.report.duration_ms for step in steps) / 1e3, 2)}


def _percentile(values: list[float], q: float, digits: int):
    if not values:
        return None
    value = float(np.percentile(values, q))
    return round(value) if digits == 0 else round(value, digits)


def results_frame(records: list[RunRecord], now: float) -> pd.DataFrame:
    """The results table, a row per mode ("-" where nothing is measured yet)."""
    rows = [run_numbers(record, now) for record in records]
    return pd.DataFrame([[("-" if row[c] is None else row[c]) for c in RESULT_COLUMNS] for row in rows],
                        columns=list(RESULT_COLUMNS))


def verdict(records: list[RunRecord], now: float) -> str:
    """What the finished run's numbers mean, in a sentence or two, every number from the results table."""
    rows = [run_numbers(record, now) for record in records]
    parts = []
    if len(rows) == 2 and all(row["throughput (tok/s)"] for row in rows):
        a, b = rows
        winner, loser = (a, b) if a["throughput (tok/s)"] >= b["throughput (tok/s)"] else (b, a)
        ratio = winner["throughput (tok/s)"] / loser["throughput (tok/s)"]
        served = (f"**{mode_name(winner['mode'])} served {ratio:.2f}x the throughput of {mode_name(loser['mode'])}**"
                  if round(ratio, 2) > 1 else f"**{mode_name(a['mode'])} and {mode_name(b['mode'])} served the same "
                                              "throughput**")
        parts.append(f"{served} ({winner['throughput (tok/s)']} vs {loser['throughput (tok/s)']} tok/s) on the same "
                     f"{a['requests']} requests.")
        if a["latency p50 (s)"] and b["latency p50 (s)"]:
            fast, slow = sorted(rows, key=lambda row: row["latency p50 (s)"])
            parts.append(f"Median latency: {fast['mode']} {fast['latency p50 (s)']} s vs {slow['mode']} "
                         f"{slow['latency p50 (s)']} s; median TTFT {a['mode']} {a['TTFT p50 (ms)']} ms vs "
                         f"{b['mode']} {b['TTFT p50 (ms)']} ms.")
    judged = [(row, record) for row, record in zip(rows, records) if row["SLO met (%)"] is not None]
    if judged:
        parts.append(f"Under {judged[0][1].targets.describe()}: " + "; ".join(
            f"{row['mode']} {row['SLO met (%)']:g}% of requests met them, a goodput of {row['goodput (req/s)']:g} "
            "requests/s" for row, _ in judged) + ".")
    for row, record in zip(rows, records):
        if len(rows) == 1:
            speed = f" ({row['throughput (tok/s)']} tok/s)" if row["throughput (tok/s)"] else ""
            parts.append(f"{mode_name(row['mode'])}: {row['requests']} requests, {row['output tokens']} output tokens "
                         f"in {row['wall time (s)']} s{speed}, a mean of {row['mean batch size'] or 0} sequences "
                         f"per step (at most {record.max_num_seqs}); median TTFT {row['TTFT p50 (ms)']} ms, median "
                         f"latency {row['latency p50 (s)']} s.")
        if row["preemptions"]:
            count = f"{row['preemptions']} preemption" + ("s" if row["preemptions"] > 1 else "")
            parts.append(f"{row['mode']}: {count}: the pool's {record.num_blocks} blocks "
                         "ran out, so the scheduler took the KV of the latest-admitted request back and it "
                         "recomputed it later (red in the timeline).")
    return " ".join(parts)


def mode_points(record: RunRecord, config, weights_bytes: float, kv_bytes_per_token: float) -> list[dict]:
    """A mode's run as roofline points (`inference_core.roofline.steps_point`): its decode steps as one, the steps
    that computed prompts (mixed ones too) as another, like a race lane's two. Each step's sequences are taken at
    the context they had, walked through the reports (a preempted request starts again from an empty cache). Useful
    work only: static batching's padding is time, not work, so it lowers the points."""
    cached: dict[int, int] = {}
    steps: dict[str, list] = {"prefill": [], "decode": []}
    for step in list(record.steps):
        report, work = step.report, []
        for request_id, kind, tokens in report.work:
            work.append((cached.get(request_id, 0), tokens, tokens if kind == "speculative" else 1))
            cached[request_id] = cached.get(request_id, 0) + tokens
        for request_id in report.preempted:
            cached[request_id] = 0
        phase = "prefill" if any(kind == "prefill" for _, kind, _ in report.work) else "decode"
        steps[phase].append((report.duration_ms / 1e3, work))
    points = [steps_point(config, weights_bytes, kv_bytes_per_token, phase_steps, phase)
              for phase, phase_steps in steps.items()]
    return [point for point in points if point is not None]
