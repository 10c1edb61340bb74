"""The race: one prompt, two lanes with their own settings, both streaming from one device.

`run_race` is the streaming handler behind the Run button, a plain generator that can be driven without a browser.
It hands the race to the pool's one admission path (`serving.admission`: engines, tokens, caps, the device-time
estimate, the caller's limits, external lanes), which refuses a race over the app's limit with a message that says
what to change; the engine loop then takes the two lanes' steps in turn (the lane that has used less device time
steps next; each lane is timed by its own steps only; the first step alternates between races). It yields, in
`RACE_OUTPUTS` order: each lane's text, the tokens/s chart, the acceptance chart, the summary table (a DataFrame),
the speed-up line and notes under it, the identical-output check, the KV view, a status line and the Run button's
state; when it ends it returns the lanes' traces (None when the race did not start or failed), which the `race` API
endpoint (`ui.api`) reads. What the panels show is built in `ui.race_view` and `ui.race_table`. Text is refreshed
every TEXT_REFRESH_S, the charts, table, lane numbers and KV view every PANEL_REFRESH_S (twice a second, never per
token), and a panel that has not changed is not sent again: the browser and the server share the device's CPU with
the lanes, so every redraw saved is time the lanes keep.

Stop (`ui.control`) and the device-time limit end both lanes after their step in flight, and the race then sends
one last update in which every panel shows the final state; closing the generator (a closed tab) cancels both
requests at once. Either way their KV blocks go back to the pool.
"""

from __future__ import annotations

import logging
import time

import gradio as gr
import pandas as pd

from inference_core.config import ConfigError
from inference_core.engine.request import FinishEvent
from inference_core.settings import SETTINGS, LaneSettings
from serving.admission import Job, Run
from serving.cost import duration
from serving.pool import EnginePool
from ui.control import RunControl, caller_of
from ui.figures import acceptance_figure, speed_figure
from ui.race_table import summary_frame, summary_notes_html
from ui.race_view import LaneTrace, identical_html, kv_view_html, lane_html
from ui.words import refusal, waiting_note

TEXT_REFRESH_S = 0.25
WAIT_NOTE_S = 1.0  # a run that has had no event for this long says what it waits for
PANEL_REFRESH_S = 0.45
RACE_OUTPUTS = ("lane_a", "lane_b", "chart", "acceptance", "summary", "summary_notes", "identical", "kv_view", "status",
                "run_button")
# The lane settings the page offers, in the order the widgets' values arrive (`ui.layout`): the whole table.
LANE_SETTING_FIELDS = tuple(SETTINGS)
WARM_UP_TOKENS = 8
log = logging.getLogger(__name__)


def settings_from_values(values) -> LaneSettings:
    """A lane's LaneSettings from its widgets' values, in LANE_SETTING_FIELDS order."""
    return LaneSettings(**dict(zip(LANE_SETTING_FIELDS, values, strict=True)))


def _frame(**values) -> tuple:
    """One update in RACE_OUTPUTS order; outputs not named are left as they are."""
    return tuple(values.get(name, gr.skip()) for name in RACE_OUTPUTS)


def warm_up_race(pool: EnginePool, lanes: dict[str, LaneSettings], prompt: str, system: str | None) -> None:
    """Run a race once, untimed, before the app serves: the engines the page's first race will use, the same prompt,
    through the engine loop as a race runs. The first race a visitor runs then finds every engine, kernel and cache
    as any later race finds it instead of paying one-time costs in its first steps, and the pool's cost estimates
    have probed the figures behind it and seen its steps."""
    job = Job("race", {name: (f"lane-{name}", settings) for name, settings in lanes.items()}, (prompt,),
              system=system or None, max_new_tokens=WARM_UP_TOKENS, ignore_eos=True)
    run = pool.submit(job)
    try:
        run.start(first=pool.first_lane())
        for _ in run.events():
            pass
    finally:
        run.close()


def run_race(pool: EnginePool, control: RunControl | None, prompt: str, system: str, max_new_tokens, *lane_values):
    """Streaming handler. `control`: the visitor's Stop switch (None: no Stop); `lane_values`: lane A's then lane
    B's LANE_SETTING_FIELDS values. Returns the lanes' traces once the race has run (None when it did not start or
    failed: the last update's status says why)."""
    control = control if control is not None else RunControl()
    try:
        return (yield from _race(pool, control, prompt, system, max_new_tokens, lane_values))
    finally:
        control.end()


def race_job(control: RunControl, prompt: str, system: str, max_new_tokens, lane_values) -> Job:
    """The race as the admission path takes it: lane A's and lane B's settings, each on its own pool slot."""
    count = len(LANE_SETTING_FIELDS)
    lanes = {"A": settings_from_values(lane_values[:count]), "B": settings_from_values(lane_values[count:2 * count])}
    return Job("race", {name: (f"lane-{name}", settings) for name, settings in lanes.items()}, (prompt or "",),
               system=(system or "").strip() or None, max_new_tokens=int(max_new_tokens), caller=control.caller,
               cache_salt=control.visitor, keep_final_kv_snapshot=True)  # the KV view's picture at the last token


def _race(pool: EnginePool, control: RunControl, prompt: str, system: str, max_new_tokens, lane_values):
    idle = gr.update(interactive=True)
    if control.stop_requested:  # Stop was pressed while the race waited for the device
        yield _frame(status="Stopped before the race started: nothing ran.", run_button=idle)
        return
    try:
        run = pool.submit(race_job(control, prompt, system, max_new_tokens, lane_values))
    except ConfigError as error:  # bad settings or prompt, or too much work: say what to change on the page
        yield _frame(status=f"**Cannot start the race:** {refusal(error)}", run_button=idle)
        return
    except (ValueError, TypeError) as error:
        yield _frame(status=f"**Cannot start the race:** {error}", run_button=idle)
        return
    try:
        for name in run.to_compile():  # a compiled lane's one-time warm-up, before anything is timed
            yield _frame(status=f"Compiling lane {name}'s decode step, once for this configuration (a minute or two "
                                "on a CPU; a second start loads it from the disk cache in seconds); the race starts "
                                "when it is done.", run_button=gr.update(interactive=False))
            run.compile(name)
        panels = RacePanels([LaneTrace(name, settings, run.engines.get(name), len(run.prompt_ids[0]),
                                       loop=pool.loop, request=next(iter(run.requests.get(name, [])), None))
                             for name, (_, settings) in run.job.lanes.items()])
        first = pool.first_lane()
        status = _start_status(pool, run, first)
        pool.settle_before_timed_work()
        run.start(first=first)
        try:
            yield from _stream(pool, run, control, panels, status)
        except Exception as error:  # the page gets a message, the log gets the traceback
            log.exception("race failed")
            yield _frame(status=f"**The race failed:** {type(error).__name__}: {error}", run_button=idle)
            return
        panels.finish()
        yield panels.final_frame(_end_status(pool, run, control, panels.traces))
        return panels.traces
    finally:
        run.close()


def _start_status(pool: EnginePool, run: Run, first: str) -> str:
    estimates = run.estimates
    return (f"Racing on {pool.loaded.device}: prompt of {len(run.prompt_ids[0])} tokens, up to {run.new_tokens[0]} "
            f"new tokens per lane. Estimated device time (from steps measured on this device): lane A "
            f"{duration(estimates[0])}, lane B {duration(estimates[1])}. The lane that has used less device time "
            f"steps next; lane {first} takes the first step this time (it alternates between races).")


def _stream(pool: EnginePool, run: Run, control: RunControl, panels: "RacePanels", status: str):
    """Every lane's events into its trace, the page updated as often as the refresh intervals allow."""
    last_text = last_panels = 0.0
    for handle, event in run.events(should_stop=lambda: control.stop_requested, heartbeat_s=WAIT_NOTE_S):
        if handle is None:  # nothing for a while: the device is busy with other visitors' work
            if not panels.started:
                yield _frame(status=status + " " + waiting_note(pool, run.engines.values()))
            continue
        trace = panels.by_name[handle.tag]
        trace.add(event)
        finished = isinstance(event, FinishEvent)
        if finished:
            trace.snapshot_kv()  # the picture the engine took at the last token, before the blocks went back
        if not panels.started:
            # The first update waits until both lanes have taken their first step: the browser draws it on the
            # same CPU, and drawing it during a lane's first step would slow that lane's TTFT.
            if all(trace.times_s or trace.over for trace in panels.traces):
                yield panels.start_frame(status)
                last_text = last_panels = time.perf_counter()
            continue
        now = time.perf_counter()
        panels_due = now - last_panels >= PANEL_REFRESH_S
        if not (finished or panels_due or now - last_text >= TEXT_REFRESH_S):
            continue
        last_text = now
        if panels_due or finished:
            last_panels = now
        changed = panels.update(with_panels=panels_due or finished)
        if changed:
            yield _frame(**changed)


def _end_status(pool: EnginePool, run: Run, control: RunControl, traces: list[LaneTrace]) -> str:
    results = " ".join(_lane_result(t) for t in traces)
    if control.stop_requested:
        return f"Stopped. {results} Both requests ended and returned their KV blocks."
    if run.over_limit():
        return (f"Stopped at this app's limit of {duration(pool.max_run_s)} of device time per race. {results} "
                "Lower 'max new tokens' or shorten the prompt to finish within it.")
    return f"Finished. {results}"


class RacePanels:
    """The race's panels built from the lanes' traces, and what was last sent of each (HTML, a table, the acceptance
    chart's version), so that a panel that has not changed is not sent again."""

    def __init__(self, traces: list[LaneTrace]):
        self.traces = traces
        self.by_name = {trace.name: trace for trace in traces}
        self.speculates = any(trace.acceptance is not None for trace in traces)
        self.sent: dict = {}

    @property
    def started(self) -> bool:
        return bool(self.sent)

    def _panels(self) -> dict:
        traces = self.traces
        return dict(summary=summary_frame(traces), summary_notes=summary_notes_html(traces),
                    identical=identical_html(traces, False), kv_view=kv_view_html(traces),
                    acceptance=_acceptance_version(traces))

    def _refresh(self) -> None:
        for trace in self.traces:
            trace.refresh()
            if trace.stats is None:
                trace.snapshot_kv()

    def _acceptance(self) -> dict:
        return gr.update(value=acceptance_figure(_acceptance_lanes(self.traces)) if self.speculates else None,
                         visible=self.speculates)

    def start_frame(self, status: str) -> tuple:
        self._refresh()
        self.sent.update(lane_a=lane_html(self.traces[0], "A"), lane_b=lane_html(self.traces[1], "B"),
                         **self._panels())
        return _frame(**{**self.sent, "acceptance": self._acceptance()}, chart=speed_figure(_chart_lanes(self.traces)),
                      status=status, run_button=gr.update(interactive=False))

    def update(self, with_panels: bool) -> dict:
        """The outputs whose value changed since last sent: the lanes' text, and with `with_panels` the charts,
        table, lane numbers and KV view. The acceptance chart is drawn only when its version changed (a
        verification step was counted, or a lane finished)."""
        if with_panels:
            self._refresh()
        frame = {"lane_a": lane_html(self.traces[0], "A"), "lane_b": lane_html(self.traces[1], "B")}
        if with_panels:
            frame.update(self._panels())
        changed = {name: value for name, value in frame.items() if not _same(self.sent.get(name), value)}
        self.sent.update(changed)
        if "acceptance" in changed:
            changed["acceptance"] = acceptance_figure(_acceptance_lanes(self.traces))
        if with_panels:
            changed["chart"] = speed_figure(_chart_lanes(self.traces))
        return changed

    def finish(self) -> None:
        """Every request has ended and returned its blocks: the traces' final figures."""
        for trace in self.traces:
            trace.over = True
        self._refresh()
        for trace in self.traces:
            trace.note_pool_after()

    def final_frame(self, status: str) -> tuple:
        """The final state of every panel (after `finish`)."""
        traces = self.traces
        return _frame(lane_a=lane_html(traces[0], "A"), lane_b=lane_html(traces[1], "B"),
                      chart=speed_figure(_chart_lanes(traces)), acceptance=self._acceptance(),
                      summary=summary_frame(traces), summary_notes=summary_notes_html(traces),
                      identical=identical_html(traces, True), kv_view=kv_view_html(traces), status=status,
                      run_button=gr.update(interactive=True))


def _same(sent, value) -> bool:
    """Whether an output's new value equals the one last sent (tables compared cell by cell)."""
    if isinstance(value, pd.DataFrame):
        return isinstance(sent, pd.DataFrame) and sent.equals(value)
    return sent == value


def _lane_result(trace: LaneTrace) -> str:
    figures = trace.shown
    if figures.stats is None:
        return f"Lane {trace.name} was stopped before its first step."
    speed = f" at {figures.decode_tokens_per_s:.1f} tok/s" if figures.decode_tokens_per_s else ""
    accepted = "" if figures.acceptance_rate is None else f", {figures.acceptance_rate:.0%} of drafts accepted"
    return f"Lane {trace.name}: {figures.tokens} tokens{speed}{accepted}."


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


def arm_race(control: RunControl, request: gr.Request):
    """Run, before the race is queued: arm the visitor's Stop (noting who the visitor is, for the deployment's
    per-caller limits) and disable Run at once."""
    control.arm(caller_of(request))
    return "Waiting for the device...", gr.update(interactive=False)


def stop_race(control: RunControl) -> None:
    """Stop: the race ends after the step in flight and sends its final update itself."""
    control.request_stop()
