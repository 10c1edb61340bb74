"""The race: one prompt, two lanes with their own settings, both streaming from one device.

`run_race` is the streaming handler behind the Run button, a plain generator that can be driven without a browser.
Before anything runs it estimates the race's device time from step costs measured on this device and refuses a race
over the app's limit with a message that says what to change. It interleaves the two requests with
`inference_core.race.interleave` (the lane that has used less device time steps next; each lane is timed by its own
steps only; the first step alternates between races) and yields, in `RACE_OUTPUTS` order: each lane's text, the
tokens/s chart, the acceptance chart, the summary table (a DataFrame), the speed-up line and notes under it, the
identical-output check, the KV view, a status line and the Run button's state; when it ends it returns the lanes'
traces (None when the race did not start or failed), which the `race` API endpoint (`ui.api`) reads. What the
panels show is built in `ui.race_view` and `ui.race_table`. Text is refreshed every TEXT_REFRESH_S,
the charts, table, lane numbers and KV view every PANEL_REFRESH_S (twice a second, never per token), and a panel
that has not changed is not sent again: the browser and the server share the device's CPU with the lanes, so every
redraw saved is time the lanes keep.

Stop (`ui.control`) and the device-time limit end both lanes after their step in flight, and the race then sends
one last update in which every panel shows the final state; closing the generator (a closed tab) cancels both
requests at once. Either way their KV blocks go back to the pool.
"""

from __future__ import annotations

import logging
import queue
import time

import gradio as gr
import pandas as pd

from inference_core import ConfigError, FinishEvent, SamplingParams
from inference_core.engine_loop import merge
from inference_core.race import interleave
from ui.control import RunControl, caller_of
from ui.figures import acceptance_figure, speed_figure
from ui.race_table import summary_frame, summary_notes_html
from ui.race_view import LaneTrace, identical_html, kv_view_html, lane_html
from server.remote import submit_remote
from ui.settings import (PAGE_WORDS, EnginePool, LaneSettings, admit, check_run_cost, duration, external_lane,
                         waiting_note)

TEXT_REFRESH_S = 0.25
WAIT_NOTE_S = 1.0  # a run that has had no event for this long says what it waits for
PANEL_REFRESH_S = 0.45
RACE_OUTPUTS = ("lane_a", "lane_b", "chart", "acceptance", "summary", "summary_notes", "identical", "kv_view", "status",
                "run_button")
# The lane settings the page offers, in the order the widgets' values arrive (`ui.layout`); any other LaneSettings
# field keeps its default.
LANE_SETTING_FIELDS = ("kv_mode", "block_size", "prefix_cache", "temperature", "top_p", "seed", "spec_method",
                       "spec_k", "spec_adaptive", "spec_tree_width", "draft_layers", "compile", "weights",
                       "quant_group", "kv_dtype", "sliding_window", "endpoint", "endpoint_model")
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
    interleaved as a race interleaves them. The first race a visitor runs then finds every engine, kernel and cache
    as any later race finds it (the prompt's full blocks in the paged lane's prefix cache included) instead of
    paying one-time costs in its first steps. Also measures the step costs behind the pre-race estimate."""
    engines = {name: pool.get(f"lane-{name}", settings) for name, settings in lanes.items()}
    prompt_ids = next(iter(engines.values())).prompt_ids(prompt, system)
    params = SamplingParams(max_new_tokens=WARM_UP_TOKENS, ignore_eos=True)
    requests = {name: engine.generate(prompt_ids, params) for name, engine in engines.items()}
    for _ in interleave(requests, first=pool.first_lane()):
        pass
    pool.costs.request_seconds("none", len(prompt_ids), 128)  # measures the steps behind the default race's estimate
    pool.costs.request_seconds("paged", len(prompt_ids), 128)


def run_race(pool: EnginePool, control: RunControl | None, prompt: str, system: str, max_new_tokens, *lane_values):
    """Streaming handler. `control`: the visitor's Stop switch (None: no Stop); `lane_values`: lane A's then lane
    B's LANE_SETTING_FIELDS values. Returns the lanes' traces once the race has run (None when it did not start or
    failed: the last update's status says why)."""
    control = control if control is not None else RunControl()
    try:
        return (yield from _race(pool, control, prompt, system, max_new_tokens, lane_values))
    finally:
        control.end()


def _race(pool: EnginePool, control: RunControl, prompt: str, system: str, max_new_tokens, lane_values):
    idle = gr.update(interactive=True)
    if control.stop_requested:  # Stop was pressed while the race waited for the device
        yield _frame(status="Stopped before the race started: nothing ran.", run_button=idle)
        return
    count = len(LANE_SETTING_FIELDS)
    try:
        settings = {"A": settings_from_values(lane_values[:count]),
                    "B": settings_from_values(lane_values[count:2 * count])}
        local = {name: s for name, s in settings.items() if not s.external}
        engines = {name: pool.get(f"lane-{name}", s) for name, s in local.items()}
        tokenizer = next(iter(engines.values()), None) or pool.get("lane-A", LaneSettings())
        prompt_ids = tokenizer.prompt_ids(prompt or "", (system or "").strip() or None)
        requests = {name: engines[name].make_request(prompt_ids, s.sampling(max_new_tokens), spec=s.spec(),
                                                     cache_salt=control.visitor)
                    for name, s in local.items()}
        for request in requests.values():
            request.keep_final_kv_snapshot = True  # the KV view's picture at the last token
        estimates = check_run_cost(pool, settings, len(prompt_ids), int(max_new_tokens), "race")
        admit(pool, control.caller, len(prompt_ids), int(max_new_tokens), requests=len(settings))
        externals = {name: external_lane(pool, s) for name, s in settings.items() if s.external}
    except ConfigError as error:  # bad settings or prompt, or too much work: say what to change on the page
        yield _frame(status=f"**Cannot start the race:** {error.in_words(PAGE_WORDS)}", run_button=idle)
        return
    except (ValueError, TypeError) as error:
        yield _frame(status=f"**Cannot start the race:** {error}", run_button=idle)
        return
    for name, engine in engines.items():  # a compiled lane's one-time warm-up, before anything is timed
        if pool.needs_compiling(engine):
            yield _frame(status=f"Compiling lane {name}'s decode step, once for this configuration (a minute or two "
                                "on a CPU; a second start loads it from the disk cache in seconds); the race starts "
                                "when it is done.",
                         run_button=gr.update(interactive=False))
            pool.compile(engine)
    traces = [LaneTrace(name, settings[name], engines.get(name), len(prompt_ids), loop=pool.loop,
                        request=requests.get(name)) for name in "AB"]
    by_name = {trace.name: trace for trace in traces}
    first = pool.first_lane()
    speculates = any(trace.acceptance is not None for trace in traces)
    status = (f"Racing on {pool.loaded.device}: prompt of {len(prompt_ids)} tokens, up to {int(max_new_tokens)} new "
              f"tokens per lane. Estimated device time (from steps measured on this device): lane A "
              f"{duration(estimates[0])}, lane B {duration(estimates[1])}. The lane that has used less device time "
              f"steps next; lane {first} takes the first step this time (it alternates between races).")
    # What was last sent by output (HTML, a table, the acceptance chart's version): unchanged panels are not resent.
    sent = {}

    def start_frame() -> tuple:
        for trace in traces:
            trace.refresh()
            if trace.stats is None:
                trace.snapshot_kv()
        sent.update(lane_a=lane_html(traces[0], "A"), lane_b=lane_html(traces[1], "B"), summary=summary_frame(traces),
                    summary_notes=summary_notes_html(traces), identical=identical_html(traces, False),
                    kv_view=kv_view_html(traces),
                    acceptance=_acceptance_version(traces))
        acceptance = gr.update(value=acceptance_figure(_acceptance_lanes(traces)) if speculates else None,
                               visible=speculates)
        return _frame(**{**sent, "acceptance": acceptance}, chart=speed_figure(_chart_lanes(traces)), status=status,
                      run_button=gr.update(interactive=False))

    def changed_only(frame: dict) -> dict:
        """Drop the outputs whose value equals the one last sent. The acceptance chart is represented by its
        version, and drawn only when that changed (a verification step was counted, or a lane finished)."""
        changed = {name: value for name, value in frame.items() if not _same(sent.get(name), value)}
        sent.update(changed)
        if "acceptance" in changed:
            changed["acceptance"] = acceptance_figure(_acceptance_lanes(traces))
        return changed

    def over_limit() -> bool:
        return sum(trace.times_s[-1] for trace in traces if trace.times_s and trace.engine is not None) \
            > pool.max_run_s

    pool.settle_before_timed_work()
    sink = queue.Queue()
    messages = ([{"role": "system", "content": system.strip()}] if (system or "").strip() else []) \
        + [{"role": "user", "content": prompt}]
    handles = [pool.loop.enqueue(engines[name], requests[name], tag=name, sink=sink) if name in engines else
               submit_remote(*externals[name], messages, max_tokens=int(max_new_tokens),
                             temperature=settings[name].temperature, top_p=settings[name].top_p,
                             seed=settings[name].seed, tag=name, sink=sink)
               for name in sorted("AB", key=lambda lane: lane != first)]
    race = merge(handles, should_stop=lambda: control.stop_requested or over_limit(), heartbeat_s=WAIT_NOTE_S)
    try:
        for handle, event in race:
            if handle is None:  # nothing for a while: the device is busy with other visitors' work
                if not sent:
                    yield _frame(status=status + " " + waiting_note(pool, engines.values()))
                continue
            name = handle.tag
            trace = by_name[name]
            trace.add(event)
            finished = isinstance(event, FinishEvent)
            if finished:
                trace.snapshot_kv()  # the picture the engine took at the last token, before the blocks went back
            if not sent:
                # The first update waits until both lanes have taken their first step: the browser draws it on the
                # same CPU, and drawing it during a lane's first step would slow that lane's TTFT.
                if not all(trace.times_s or trace.over for trace in traces):
                    continue
                yield start_frame()
                last_text = last_panels = time.perf_counter()
                continue
            now = time.perf_counter()
            panels_due = now - last_panels >= PANEL_REFRESH_S
            if not (finished or panels_due or now - last_text >= TEXT_REFRESH_S):
                continue
            last_text = now
            if panels_due or finished:
                last_panels = now
                for other in traces:
                    other.refresh()
                    if other.stats is None:
                        other.snapshot_kv()
            frame = {"lane_a": lane_html(traces[0], "A"), "lane_b": lane_html(traces[1], "B")}
            if panels_due or finished:
                frame.update(summary=summary_frame(traces), summary_notes=summary_notes_html(traces),
                             identical=identical_html(traces, False),
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
    for trace in traces:  # every request has ended and returned its blocks: the final state of every panel
        trace.over = True
        trace.refresh()
        if trace.stats is None:
            trace.snapshot_kv()
        trace.note_pool_after()
    results = " ".join(_lane_result(t) for t in traces)
    if control.stop_requested:
        done = f"Stopped. {results} Both requests ended and returned their KV blocks."
    elif over_limit():
        done = (f"Stopped at this app's limit of {duration(pool.max_run_s)} of device time per race. {results} "
                "Lower 'max new tokens' or shorten the prompt to finish within it.")
    else:
        done = f"Finished. {results}"
    yield _frame(lane_a=lane_html(traces[0], "A"), lane_b=lane_html(traces[1], "B"),
                 chart=speed_figure(_chart_lanes(traces)),
                 acceptance=gr.update(value=acceptance_figure(_acceptance_lanes(traces)) if speculates else None,
                                      visible=speculates),
                 summary=summary_frame(traces), summary_notes=summary_notes_html(traces),
                 identical=identical_html(traces, True), kv_view=kv_view_html(traces), status=done, run_button=idle)
    return traces


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
