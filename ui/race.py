"""The race: one prompt, two lanes with their own settings, both streaming from one device.

`run_race` is the streaming handler behind the Run button, a plain generator that can be driven without a browser.
It interleaves the two requests with `inference_core.race.interleave` (the lane that has used less device time steps
next; each lane is timed by its own steps only) and yields, in `RACE_OUTPUTS` order: each lane's text, the tokens/s
chart, the acceptance chart, the summary table, the identical-output check, the KV view, a status line and the Run
button's state. A speculating lane's text is highlighted by where each token came from (`ui.speculation`), and its
acceptance is counted live from the events and checked against the engine's count at the end. Text is refreshed
every TEXT_REFRESH_S, the charts, table and KV view every PANEL_REFRESH_S (twice a second, never per token), and a
panel that has not changed is not sent again: the browser and the server share the device's CPU with the lanes, so
every redraw saved is time the lanes keep. Closing the generator (Stop, a closed tab) closes both requests, which
returns their KV blocks.
"""

from __future__ import annotations

import html
import logging
import time
from dataclasses import dataclass, field, fields

import gradio as gr

from inference_core import Engine, FinishEvent, GenerationStats
from inference_core.race import interleave
from ui.figures import LANE_COLOURS, acceptance_figure, speed_figure
from ui.kv_view import render_pool
from ui.settings import EnginePool, LaneSettings
from ui.speculation import AcceptanceCount, HighlightedText, legend_html, speculation_summary_rows

TEXT_REFRESH_S = 0.25
PANEL_REFRESH_S = 0.45
RACE_OUTPUTS = ("lane_a", "lane_b", "chart", "acceptance", "summary", "identical", "kv_view", "status", "run_button")
LANE_SETTING_FIELDS = tuple(f.name for f in fields(LaneSettings))  # the widgets' values arrive in this order
log = logging.getLogger(__name__)


@dataclass
class LaneTrace:
    """What one lane has produced so far: plain values only."""

    name: str
    settings: LaneSettings
    engine: Engine
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    times_s: list[float] = field(default_factory=list)  # own-clock time of each token
    stats: GenerationStats | None = None
    kv_html: str = ""
    highlighted: HighlightedText | None = None  # speculating lanes only, like `acceptance`
    acceptance: AcceptanceCount | None = None

    def __post_init__(self) -> None:
        if self.settings.speculates:
            self.highlighted = HighlightedText(self.engine.tokenizer.decode)
            self.acceptance = AcceptanceCount()

    def add(self, event) -> None:
        if isinstance(event, FinishEvent):
            self.text, self.token_ids, self.stats = event.text, list(event.token_ids), event.stats
            if self.highlighted is not None:
                self.highlighted.finish(event.text)
                self.acceptance.finish(event.stats.spec)
        else:
            self.text += event.text
            self.token_ids.append(event.token_id)
            self.times_s.append(event.time_s)
            if self.highlighted is not None:
                self.highlighted.add(event)
                self.acceptance.add(event)

    @property
    def decode_tokens_per_s(self) -> float | None:
        if self.stats is not None:
            return self.stats.decode_tokens_per_s
        if len(self.times_s) < 2 or self.times_s[-1] <= self.times_s[0]:
            return None
        return (len(self.times_s) - 1) / (self.times_s[-1] - self.times_s[0])

    def snapshot_kv(self) -> None:
        snapshot = self.engine.kv_snapshot()
        if snapshot is not None:
            labels = {request["seq_id"]: f"Lane {self.name}" for request in snapshot["requests"]}
            note = "at its last token" if self.stats else "live"
            self.kv_html = render_pool(snapshot, self.engine.tokenizer.decode,
                                       f"Lane {self.name} paged pool ({note})", labels)


def lane_html(trace: LaneTrace | None, name: str, message: str = "") -> str:
    colour = LANE_COLOURS[name]
    if trace is None:
        return f'<div class="lane" style="border-left:4px solid {colour};padding-left:8px"><b>Lane {name}</b>' \
               f'<div class="lane-text" style="color:#64748b">{html.escape(message)}</div></div>'
    speed = trace.decode_tokens_per_s
    numbers = f"{len(trace.token_ids)} tokens"
    if trace.times_s:
        numbers += f", TTFT {trace.times_s[0] * 1e3:.0f} ms"
    if speed:
        numbers += f", {speed:.1f} tok/s"
    numbers += _acceptance_note(trace)
    if trace.stats:
        numbers += f", done ({trace.stats.finish_reason})"
    legend, text = "", html.escape(trace.text)
    if trace.highlighted is not None:
        legend, text = legend_html(), trace.highlighted.html()
    return (f'<div class="lane" data-done="{"true" if trace.stats else "false"}" style="border-left:4px solid '
            f'{colour};padding-left:8px"><b>Lane {name}</b>: {html.escape(trace.settings.describe())}'
            f'<div style="font-size:12px;color:#475569">{numbers}</div>{legend}'
            f'<div class="lane-text" style="white-space:pre-wrap;margin-top:6px">{text}</div></div>')


def summary_html(traces: list[LaneTrace]) -> str:
    def kv(trace: LaneTrace, attribute: str) -> str:
        if trace.stats is None:
            return "at the end"
        return f"{getattr(trace.stats, attribute) / 2 ** 20:.2f} MiB"

    rows = [
        ("configuration", lambda t: html.escape(t.settings.describe())),
        ("TTFT", lambda t: f"{t.times_s[0] * 1e3:.0f} ms" if t.times_s else "-"),
        ("decode tokens/s", lambda t: f"{t.decode_tokens_per_s:.1f}" if t.decode_tokens_per_s else "-"),
        ("prefill tokens/s", lambda t: f"{t.stats.prefill_tokens_per_s:.0f}" if t.stats else "at the end"),
        ("tokens generated", lambda t: f"{len(t.token_ids)}" + (f" ({t.stats.finish_reason})" if t.stats else "")),
        ("prompt tokens (from prefix cache)",
         lambda t: f"{t.stats.prompt_tokens} ({t.stats.cached_prompt_tokens})" if t.stats else "at the end"),
        ("KV memory in use", lambda t: kv(t, "kv_bytes_in_use")),
        ("KV memory reserved", lambda t: kv(t, "kv_bytes_reserved")),
    ]
    if any(t.acceptance is not None for t in traces):
        rows += speculation_summary_rows()
    head = "".join(f'<th style="color:{LANE_COLOURS[t.name]}">Lane {t.name}</th>' for t in traces)
    body = "".join(f"<tr><td>{label}</td>{''.join(f'<td>{value(t)}</td>' for t in traces)}</tr>"
                   for label, value in rows)
    first, second = traces
    ratios = []
    if first.decode_tokens_per_s and second.decode_tokens_per_s:
        ratios.append(f"decode A/B: <b>{first.decode_tokens_per_s / second.decode_tokens_per_s:.2f}x</b>")
    if first.times_s and second.times_s:
        ratios.append(f"TTFT B/A: <b>{second.times_s[0] / first.times_s[0]:.2f}x</b>")
    speedup = f"<p>Speed-up of lane A over lane B, {', '.join(ratios)}</p>" if ratios else ""
    return f'<table class="race-summary"><tr><th></th>{head}</tr>{body}</table>{speedup}'


def identical_html(traces: list[LaneTrace], finished: bool) -> str:
    first, second = traces
    if not (first.settings.greedy and second.settings.greedy):
        return ('<p data-verdict="not-checked">Lossless check: not applicable, a lane samples (temperature > 0); '
                "set both temperatures to 0 to compare token ids.</p>")
    a, b = first.token_ids, second.token_ids
    common = min(len(a), len(b))
    mismatch = next((i for i in range(common) if a[i] != b[i]), None)
    decode = first.engine.tokenizer.decode
    if mismatch is not None:
        return (f'<p data-verdict="different">Lossless check: <b>different</b>. The token ids first differ at '
                f"position {mismatch}: lane A {a[mismatch]} {html.escape(repr(decode([a[mismatch]])))}, lane B "
                f"{b[mismatch]} {html.escape(repr(decode([b[mismatch]])))}.</p>")
    if not finished:
        return f'<p data-verdict="pending">Lossless check: identical so far ({common} tokens compared).</p>'
    if len(a) != len(b):
        return (f'<p data-verdict="different">Lossless check: <b>different</b> at position {common}: one lane '
                f"stopped after {common} tokens, the other went on to {max(len(a), len(b))}.</p>")
    return (f'<p data-verdict="identical">Lossless check: <b>identical</b>. Both greedy lanes produced the same '
            f"{common} token ids.</p>")


def kv_view_html(traces: list[LaneTrace]) -> str:
    views = [trace.kv_html for trace in traces if trace.kv_html]
    if not views and not any(trace.settings.kv_mode == "paged" for trace in traces):
        return "<p>Neither lane uses the paged KV cache; set a lane's KV mode to paged to watch its block pool.</p>"
    return "".join(views) or "<p>The paged pool appears here once the race starts.</p>"


def _frame(**values) -> tuple:
    """One update in RACE_OUTPUTS order; outputs not named are left as they are."""
    return tuple(values.get(name, gr.skip()) for name in RACE_OUTPUTS)


def run_race(pool: EnginePool, prompt: str, system: str, max_new_tokens, *lane_values):
    """Streaming handler. `lane_values`: lane A's then lane B's LANE_SETTING_FIELDS values."""
    count = len(LANE_SETTING_FIELDS)
    idle = gr.update(interactive=True)
    try:
        settings = [LaneSettings(*lane_values[:count]), LaneSettings(*lane_values[count:2 * count])]
        traces = [LaneTrace(name, s, pool.get(f"lane-{name}", s)) for name, s in zip("AB", settings)]
        prompt_ids = traces[0].engine.prompt_ids(prompt or "", (system or "").strip() or None)
        requests = {t.name: t.engine.generate(prompt_ids, t.settings.sampling(max_new_tokens), spec=t.settings.spec())
                    for t in traces}
    except (ValueError, TypeError) as error:  # ConfigError is a ValueError: bad settings or prompt
        yield _frame(status=f"**Cannot start the race:** {error}", run_button=idle)
        return
    by_name = {trace.name: trace for trace in traces}
    status = f"Racing on {pool.loaded.device}: prompt of {len(prompt_ids)} tokens, up to {int(max_new_tokens)} new " \
             "tokens per lane; the lane that has used less device time steps next."
    # What was last sent, by output (HTML, or the acceptance chart's version), so that unchanged panels are not resent.
    sent = {"lane_a": lane_html(traces[0], "A"), "lane_b": lane_html(traces[1], "B"), "summary": summary_html(traces),
            "identical": identical_html(traces, False), "kv_view": kv_view_html(traces),
            "acceptance": _acceptance_version(traces)}
    yield _frame(**{**sent, "acceptance": acceptance_figure(_acceptance_lanes(traces))}, chart=speed_figure({}),
                 status=status, run_button=gr.update(interactive=False))
    last_text = last_panels = time.perf_counter()

    def changed_only(frame: dict) -> dict:
        """Drop the outputs whose value equals the one last sent. The acceptance chart is represented by its
        version, and drawn only when that changed (a verification step was counted, or a lane finished)."""
        changed = {name: value for name, value in frame.items() if sent.get(name) != value}
        sent.update(changed)
        if "acceptance" in changed:
            changed["acceptance"] = acceptance_figure(_acceptance_lanes(traces))
        return changed

    race = interleave(requests)
    try:
        for name, event in race:
            trace = by_name[name]
            trace.add(event)
            finished = isinstance(event, FinishEvent)
            if finished:
                trace.snapshot_kv()  # the request still holds its blocks until the race moves on
            now = time.perf_counter()
            panels_due = now - last_panels >= PANEL_REFRESH_S
            if not (finished or panels_due or now - last_text >= TEXT_REFRESH_S):
                continue
            last_text = now
            frame = {"lane_a": lane_html(traces[0], "A"), "lane_b": lane_html(traces[1], "B")}
            if panels_due or finished:
                last_panels = now
                for other in traces:
                    if other.stats is None:
                        other.snapshot_kv()
                frame.update(summary=summary_html(traces), identical=identical_html(traces, False),
                             kv_view=kv_view_html(traces), acceptance=_acceptance_version(traces))
            changed = changed_only(frame)
            if panels_due or finished:
                changed["chart"] = speed_figure(_chart_lanes(traces))
            if changed:
                yield _frame(**changed)
    except Exception as error:  # the page gets a message, the log gets the traceback
        log.exception("race failed")
        yield _frame(status=f"**The race failed:** {type(error).__name__}: {error}", run_button=idle)
        return
    finally:
        race.close()
    done = "Finished. " + " ".join(_lane_result(t) for t in traces)
    yield _frame(lane_a=lane_html(traces[0], "A"), lane_b=lane_html(traces[1], "B"),
                 chart=speed_figure(_chart_lanes(traces)), acceptance=acceptance_figure(_acceptance_lanes(traces)),
                 summary=summary_html(traces), identical=identical_html(traces, True), kv_view=kv_view_html(traces),
                 status=done, run_button=idle)


def _lane_result(trace: LaneTrace) -> str:
    return (f"Lane {trace.name}: {trace.stats.generated_tokens} tokens at {trace.stats.decode_tokens_per_s:.1f} "
            f"tok/s{_acceptance_note(trace)}.")


def _acceptance_note(trace: LaneTrace) -> str:
    """The status clause giving a lane's share of drafts accepted; empty until it has drafted something."""
    if trace.acceptance is None or not trace.acceptance.drafted:
        return ""
    return f", {trace.acceptance.shown()['acceptance_rate']:.0%} of drafts accepted"


def _chart_lanes(traces: list[LaneTrace]) -> dict[str, dict]:
    return {t.name: {"label": t.settings.describe(), "times_s": t.times_s} for t in traces}


def _acceptance_version(traces: list[LaneTrace]) -> tuple:
    """Changes exactly when the acceptance chart would: a step counted, or a lane finished."""
    return tuple((t.acceptance.steps, t.acceptance.agrees) if t.acceptance else None for t in traces)


def _acceptance_lanes(traces: list[LaneTrace]) -> dict[str, dict]:
    lanes = {}
    for trace in traces:
        if trace.acceptance is not None:
            counts = trace.acceptance.shown()
            lanes[trace.name] = {"label": trace.settings.describe(), "running_rate": trace.acceptance.running_rate,
                                 "accepted_by_position": counts["accepted_by_position"],
                                 "drafted_by_position": counts["drafted_by_position"]}
    return lanes


def stop_race():
    """Stop button: the race event is cancelled by Gradio (which closes `run_race`); reset the controls."""
    return "Stopped. Both requests were cancelled and their KV blocks returned.", gr.update(interactive=True)
