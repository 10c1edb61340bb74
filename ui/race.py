"""The race: one prompt, two lanes with their own settings, both streaming from one device.

`run_race` is the streaming handler behind the Run button, a plain generator that can be driven without a browser.
It hands the race to the pool's one admission path (`serving.admission`: engines, tokens, caps, the device-time
estimate, the caller's limits, external lanes), which refuses a race over the app's limit with a message that says
what to change; the engine loop then takes the two lanes' steps in turn (the lane that has used less device time
steps next; each lane is timed by its own steps only; the first step alternates between races). It yields, in
`RACE_OUTPUTS` order: each lane's text, the tokens/s chart, the acceptance chart, the summary table (a DataFrame),
the speed-up line and notes under it, the identical-output check, the KV view, a status line and the Run button's
state; when it ends it returns the lanes' traces (None when the race did not start or failed), which the `race` API
endpoint (`ui.api`) reads and the visitor's `RaceMemory` keeps for the colour modes and the logit lens
(`ui.race_inspect`). Every lane request asks for its tokens' log-probabilities (`RACE_SAMPLING`). What the panels
show is built in `ui.race_panels`, `ui.race_view`, `ui.token_view` and `ui.race_table`. Text is refreshed
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

from inference_core.config import ConfigError
from inference_core.engine.request import FinishEvent
from inference_core.settings import SETTINGS, LaneSettings
from serving.admission import Job, Run
from serving.cost import duration
from serving.pool import EnginePool
from ui.control import RunControl, caller_of
from ui.race_panels import RACE_OUTPUTS, RaceMemory, RacePanels, frame  # noqa: F401 (RACE_OUTPUTS: re-exported)
from ui.race_view import LaneTrace
from ui.words import refusal, waiting_note

TEXT_REFRESH_S = 0.25
WAIT_NOTE_S = 1.0  # a run that has had no event for this long says what it waits for
PANEL_REFRESH_S = 0.45
# The lane settings the page offers, in the order the widgets' values arrive (`ui.layout`): the whole table.
LANE_SETTING_FIELDS = tuple(SETTINGS)
WARM_UP_TOKENS = 8
TOP_ALTERNATIVES = 5  # each lane token's top alternatives, with their log-probabilities (the tooltips, the lens)
# What every race request asks of the engine besides its lane's settings: its tokens' log-probabilities (the engine
# computes them only for the requests that ask).
RACE_SAMPLING = {"logprobs": TOP_ALTERNATIVES}
log = logging.getLogger(__name__)


def settings_from_values(values) -> LaneSettings:
    """A lane's LaneSettings from its widgets' values, in LANE_SETTING_FIELDS order."""
    return LaneSettings(**dict(zip(LANE_SETTING_FIELDS, values, strict=True)))


def warm_up_race(pool: EnginePool, lanes: dict[str, LaneSettings], prompt: str, system: str | None) -> None:
    """Run a race once, untimed, before the app serves: the engines the page's first race will use, the same prompt,
    through the engine loop as a race runs. The first race a visitor runs then finds every engine, kernel and cache
    as any later race finds it instead of paying one-time costs in its first steps, and the pool's cost estimates
    have probed the figures behind it and seen its steps."""
    job = Job("race", {name: (f"lane-{name}", settings) for name, settings in lanes.items()}, (prompt,),
              system=system or None, max_new_tokens=WARM_UP_TOKENS, ignore_eos=True, sampling=RACE_SAMPLING)
    run = pool.submit(job)
    try:
        run.start(first=pool.first_lane())
        for _ in run.events():
            pass
    finally:
        run.close()


def run_race(pool: EnginePool, control: RunControl | None, prompt: str, system: str, max_new_tokens, *lane_values,
             memory: RaceMemory | None = None):
    """Streaming handler. `control`: the visitor's Stop switch (None: no Stop); `lane_values`: lane A's then lane
    B's LANE_SETTING_FIELDS values; `memory`: the visitor's last race (its colour mode, read at every redraw, and
    where the traces are kept). Returns the lanes' traces once the race has run (None when it did not start or
    failed: the last update's status says why)."""
    control = control if control is not None else RunControl()
    memory = memory if memory is not None else RaceMemory()
    memory.traces = None
    try:
        memory.traces = yield from _race(pool, control, memory, prompt, system, max_new_tokens, lane_values)
        return memory.traces
    finally:
        control.end()


def run_remembered_race(pool: EnginePool, control: RunControl | None, memory: RaceMemory, prompt: str, system: str,
                        max_new_tokens, *lane_values):
    """The Run button's handler: `run_race` with the visitor's `RaceMemory` (a gr.State) as an input."""
    return (yield from run_race(pool, control, prompt, system, max_new_tokens, *lane_values, memory=memory))


def race_job(control: RunControl, prompt: str, system: str, max_new_tokens, lane_values) -> Job:
    """The race as the admission path takes it: lane A's and lane B's settings, each on its own pool slot."""
    count = len(LANE_SETTING_FIELDS)
    lanes = {"A": settings_from_values(lane_values[:count]), "B": settings_from_values(lane_values[count:2 * count])}
    return Job("race", {name: (f"lane-{name}", settings) for name, settings in lanes.items()}, (prompt or "",),
               system=(system or "").strip() or None, max_new_tokens=int(max_new_tokens), caller=control.caller,
               cache_salt=control.visitor, sampling=RACE_SAMPLING,
               keep_final_kv_snapshot=True)  # the KV view's picture at the last token


def _race(pool: EnginePool, control: RunControl, memory: RaceMemory, prompt: str, system: str, max_new_tokens,
          lane_values):
    idle = gr.update(interactive=True)
    if control.stop_requested:  # Stop was pressed while the race waited for the device
        yield frame(status="Stopped before the race started: nothing ran.", run_button=idle)
        return
    try:
        run = pool.submit(race_job(control, prompt, system, max_new_tokens, lane_values))
    except ConfigError as error:  # bad settings or prompt, or too much work: say what to change on the page
        yield frame(status=f"**Cannot start the race:** {refusal(error)}", run_button=idle)
        return
    except (ValueError, TypeError) as error:
        yield frame(status=f"**Cannot start the race:** {error}", run_button=idle)
        return
    try:
        for name in run.to_compile():  # a compiled lane's one-time warm-up, before anything is timed
            yield frame(status=f"Compiling lane {name}'s decode step, once for this configuration (a minute or two "
                                "on a CPU; a second start loads it from the disk cache in seconds); the race starts "
                                "when it is done.", run_button=gr.update(interactive=False))
            run.compile(name)
        panels = RacePanels([LaneTrace(name, settings, run.engines.get(name), len(run.prompt_ids[0]),
                                       loop=pool.loop, request=next(iter(run.requests.get(name, [])), None))
                             for name, (_, settings) in run.job.lanes.items()], memory)
        first = pool.first_lane()
        status = _start_status(pool, run, first)
        pool.settle_before_timed_work()
        run.start(first=first)
        try:
            yield from _stream(pool, run, control, panels, status)
        except Exception as error:  # the page gets a message, the log gets the traceback
            log.exception("race failed")
            yield frame(status=f"**The race failed:** {type(error).__name__}: {error}", run_button=idle)
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


def _stream(pool: EnginePool, run: Run, control: RunControl, panels: RacePanels, status: str):
    """Every lane's events into its trace, the page updated as often as the refresh intervals allow."""
    last_text = last_panels = 0.0
    for handle, event in run.events(should_stop=lambda: control.stop_requested, heartbeat_s=WAIT_NOTE_S):
        if handle is None:  # nothing for a while: the device is busy with other visitors' work
            if not panels.started:
                yield frame(status=status + " " + waiting_note(pool, run.engines.values()))
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
            yield frame(**changed)


def _end_status(pool: EnginePool, run: Run, control: RunControl, traces: list[LaneTrace]) -> str:
    results = " ".join(_lane_result(t) for t in traces)
    if control.stop_requested:
        return f"Stopped. {results} Both requests ended and returned their KV blocks."
    if run.over_limit():
        return (f"Stopped at this app's limit of {duration(pool.max_run_s)} of device time per race. {results} "
                "Lower 'max new tokens' or shorten the prompt to finish within it.")
    return f"Finished. {results}"


def _lane_result(trace: LaneTrace) -> str:
    figures = trace.shown
    if figures.stats is None:
        return f"Lane {trace.name} was stopped before its first step."
    speed = f" at {figures.decode_tokens_per_s:.1f} tok/s" if figures.decode_tokens_per_s else ""
    accepted = "" if figures.acceptance_rate is None else f", {figures.acceptance_rate:.0%} of drafts accepted"
    return f"Lane {trace.name}: {figures.tokens} tokens{speed}{accepted}."


def arm_race(control: RunControl, request: gr.Request):
    """Run, before the race is queued: arm the visitor's Stop (noting who the visitor is, for the deployment's
    per-caller limits) and disable Run at once."""
    control.arm(caller_of(request))
    return "Waiting for the device...", gr.update(interactive=False)


def stop_race(control: RunControl) -> None:
    """Stop: the race ends after the step in flight and sends its final update itself."""
    control.request_stop()
