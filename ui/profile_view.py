"""The profile action of the race and the batching lab: where an engine step's time goes.

For each lane of the visitor's last race (or each mode of their last lab run), a fresh engine with the same settings
takes the same prompts at once and `inference_core.bench.profile` records a few of its steps with the torch profiler
(`EnginePool.profile`, in the engine loop's thread: the device is the profile's alone meanwhile). The page shows the
mean step split by category (projections, attention, norms and RoPE, sampling, KV writes, the compiled graph, the
scheduler's and the runner's Python, other), which sums to the step time the profile measured, and offers each
lane's Chrome trace for download, gzipped (it opens in ui.perfetto.dev as it is).
"""

from __future__ import annotations

import gzip
import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import gradio as gr
import plotly.graph_objects as go

from inference_core import ConfigError, SamplingParams
from inference_core.bench.profile import CATEGORIES, IDLE
from inference_core.quant.linear import QuantConfig
from serving.pool import EnginePool
from ui.race_panels import RaceMemory
from ui.words import widget_number

DEFAULT_STEPS = 8
MAX_STEPS = 32
KEEP_TRACES = 32  # trace files kept on the server's disk (Gradio serves its own copy of each)
CATEGORY_COLOURS = dict(zip((*CATEGORIES, IDLE), ("#2563eb", "#ea580c", "#16a34a", "#9333ea", "#0891b2", "#ca8a04",
                                                  "#64748b", "#cbd5e1", "#f1f5f9")))
log = logging.getLogger(__name__)
EMPTY_NOTE = ("Record a few steps of each lane with the torch profiler: the mean step split by what it spends its "
              "time on, and a trace to open in ui.perfetto.dev.")


def breakdown_figure(profiles: dict[str, dict]) -> go.Figure:
    """One horizontal bar per profile (label -> `record_steps` report), stacked by category in ms per step."""
    figure = go.Figure()
    labels = list(profiles)
    for category in (*CATEGORIES, IDLE):
        values = [next((row["ms"] for row in profiles[label]["breakdown"] if row["category"] == category), 0.0)
                  for label in labels]
        shares = [next((row["share"] for row in profiles[label]["breakdown"] if row["category"] == category), 0.0)
                  for label in labels]
        if not any(values):
            continue
        figure.add_trace(go.Bar(y=labels, x=values, orientation="h", name=category, customdata=shares,
                                marker={"color": CATEGORY_COLOURS[category]},
                                hovertemplate=f"{category}: %{{x:.2f}} ms a step (%{{customdata:.0%}})<extra></extra>"))
    figure.update_layout(barmode="stack", height=120 + 60 * len(labels), xaxis_title="ms per step (mean)",
                         margin={"l": 20, "r": 20, "t": 20, "b": 50}, legend={"orientation": "h", "y": -0.35})
    figure.update_yaxes(autorange="reversed")
    return figure


def breakdown_note(label: str, report: dict) -> str:
    """One line: the step time measured, what the profiler added, and the three largest categories."""
    top = sorted(report["breakdown"], key=lambda row: -row["ms"])[:3]
    without = report.get("unprofiled_step_ms")
    return (f"**{label}**: {report['steps']} steps of {report['batch_size']:.1f} sequences on average, "
            f"{report['step_ms']:.1f} ms a step" + (f" ({without:.1f} ms without the profiler)" if without else "")
            + "; " + ", ".join(f"{row['category']} {row['share']:.0%}" for row in top) + ".")


def trace_path(label: str) -> str:
    """A fresh file for one profile's trace, in a folder that keeps the newest KEEP_TRACES."""
    folder = Path(tempfile.gettempdir()) / "inference-core-profiles"
    folder.mkdir(exist_ok=True)
    for old in sorted(folder.glob("*.json*"), key=lambda path: path.stat().st_mtime)[:-KEEP_TRACES + 1]:
        old.unlink(missing_ok=True)
    slug = re.sub(r"[^A-Za-z0-9]+", "-", label).strip("-")[:40] or "profile"
    return str(folder / f"{slug}-{time.strftime('%H%M%S')}-{time.perf_counter_ns() % 10 ** 6}.json")


def gzip_file(path: str) -> str:
    """`path` gzipped beside it (the original removed): a trace of 8 steps is about 11 MB of JSON and 1 MB gzipped,
    and Perfetto opens it as it is."""
    with open(path, "rb") as source, gzip.open(path + ".gz", "wb") as target:
        shutil.copyfileobj(source, target)
    os.remove(path)
    return path + ".gz"


def show_profiles(pool: EnginePool, jobs: dict[str, tuple], steps) -> tuple:
    """Profile each job (label -> `EnginePool.profile`'s arguments but the steps and the trace) and return the
    figure, the note and the trace files; a refusal or a failure becomes the note."""
    try:
        count = widget_number(steps, "steps to record", 1, MAX_STEPS)
        profiles, files = {}, []
        for label, arguments in jobs.items():
            path = trace_path(label)
            profiles[label] = pool.profile(*arguments[:4], count, path, *arguments[4:])
            files.append(gzip_file(path))
    except ConfigError as error:
        return gr.skip(), f"**Cannot profile:** {error}", gr.skip()
    except Exception as error:  # the page gets a message, the log the traceback
        log.exception("profile failed")
        return gr.skip(), f"**The profile failed:** {type(error).__name__}: {error}", gr.skip()
    note = "\n\n".join(breakdown_note(label, report) for label, report in profiles.items())
    return breakdown_figure(profiles), note, files


def race_jobs(memory: RaceMemory) -> dict[str, tuple]:
    """Each local lane of the visitor's last race: its engine's settings, weights, prompt, sampling and drafts."""
    jobs = {}
    for trace in memory.traces or []:
        if trace.engine is not None and trace.request is not None:
            prompt = trace.request.seq.token_ids[:trace.prompt_tokens]
            jobs[f"{trace.name}: {trace.settings.describe()}"] = (
                trace.engine.config, trace.settings.quant(), [prompt], trace.request.params, trace.settings.spec())
    if not jobs:
        raise ConfigError("run a race first (a lane on this device: an external lane has nothing to profile here).")
    return jobs


def lab_jobs(pool: EnginePool, plan) -> dict[str, tuple]:
    """Each mode of the visitor's last lab run (`ui.batching.LabPlan`), every request at once, greedy."""
    prompts = [list(ids) for _, ids in plan.prompts]
    return {mode: (plan.config(pool, mode), QuantConfig(), prompts, SamplingParams(max_new_tokens=1))
            for mode in plan.modes}


def profile_race(pool: EnginePool, memory: RaceMemory, steps) -> tuple:
    """The race's profile action: each local lane of the visitor's last race."""
    try:
        jobs = race_jobs(memory)
    except ConfigError as error:
        return gr.skip(), f"**Cannot profile:** {error}", gr.skip()
    return show_profiles(pool, jobs, steps)


def profile_lab(pool: EnginePool, memory, steps) -> tuple:
    """The lab's profile action: each mode of the visitor's last run (`ui.batching.LabMemory`)."""
    if memory.plan is None:
        return gr.skip(), "**Cannot profile:** run the lab first: each of its modes is profiled on the same " \
                          "requests.", gr.skip()
    return show_profiles(pool, lab_jobs(pool, memory.plan), steps)


def build_profile_panel(title: str, prefix: str, handler, inputs: list, listener: dict) -> None:
    """A closed accordion: steps to record, the button, the note, the breakdown chart and the trace files."""
    with gr.Accordion(title, open=False, elem_id=f"{prefix}-profile-panel"):
        with gr.Row(equal_height=True):
            steps = gr.Slider(1, MAX_STEPS, value=DEFAULT_STEPS, step=1, label="steps to record",
                              elem_id=f"{prefix}-profile-steps", scale=3)
            button = gr.Button("Profile", elem_id=f"{prefix}-profile-run", size="sm", scale=1)
        note = gr.Markdown(EMPTY_NOTE, elem_id=f"{prefix}-profile-note")
        plot = gr.Plot(label="where a step's time goes", elem_id=f"{prefix}-profile-chart")
        files = gr.File(label="Chrome traces (open in ui.perfetto.dev)", file_count="multiple",
                        elem_id=f"{prefix}-profile-traces")
    button.click(handler, [*inputs, steps], [plot, note, files], **listener)
