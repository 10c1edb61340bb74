"""The race's roofline: the device's two roofs (memory bandwidth, matmul throughput, measured once per host by
`EnginePool.ceilings`; a known GPU's datasheet bandwidth beside the measured one, `inference_core.cards`) and each
finished lane's prefill and decode as points (`Engine.roofline_points`: FLOPs and bytes from the model's
configuration over the lane's measured times). Decode sits far left, against the memory roof; prefill climbs toward
the compute roof; a batched or quantized lane moves its decode point. Drawn on request, from the visitor's last race
(`RaceMemory`), so it costs nothing while a race streams.
"""

from __future__ import annotations

import gradio as gr
import plotly.graph_objects as go

from inference_core.cards import card
from inference_core.roofline import weights_read_per_step
from serving.pool import EnginePool
from ui.batching_view import mode_name, mode_points
from ui.figures import LANE_COLOURS
from ui.race_panels import RaceMemory

PHASE_SYMBOLS = {"prefill": "triangle-up", "decode": "circle"}
EMPTY_NOTE = "Run a race, then draw it here: each lane's prefill and decode become points under the device's roofs."
LAB_NOTE = ("Run the lab, then draw it here: each mode's prefill steps and decode steps become points (their useful "
            "FLOPs and bytes over their measured time). More sequences per decode step move its point right and up.")


PALETTE = ("#2563eb", "#ea580c", "#16a34a", "#9333ea", "#dc2626", "#0891b2", "#ca8a04", "#db2777", "#475569")


def roofline_figure(ceilings: dict, lanes: dict[str, list[dict]]) -> go.Figure:
    """`ceilings`: {"bandwidth_bytes_per_s", "peak_flops_per_s", "device", "dtype"}; `lanes`: a label (a race
    lane's starts with its name, "A: ...") -> its points ({"phase", "intensity", "flops_per_s", "bytes_per_s"}).
    Log-log: intensity (FLOPs per byte) against GFLOP/s."""
    bandwidth, peak = ceilings["bandwidth_bytes_per_s"], ceilings["peak_flops_per_s"]
    intensities = [point["intensity"] for points in lanes.values() for point in points]
    ridge = peak / bandwidth
    low = min([ridge / 100, *intensities]) / 2
    high = max([ridge * 10, *intensities]) * 2
    xs = [low, ridge, high]
    figure = go.Figure()
    figure.add_trace(go.Scatter(
        x=xs, y=[min(bandwidth * x, peak) / 1e9 for x in xs], mode="lines", name="roofs", showlegend=False,
        line={"color": "#475569", "width": 2},
        hovertemplate="the roof at %{x:.2f} FLOP/byte: %{y:.1f} GFLOP/s<extra></extra>"))
    known = card(ceilings["device"])  # a GPU whose datasheet we know: the measured bandwidth against its figure
    datasheet = f" ({bandwidth / known.bandwidth_bytes_per_s:.0%} of the datasheet's " \
                f"{known.bandwidth_bytes_per_s / 1e9:.0f})" if known else ""
    figure.add_annotation(x=0.02, y=0.98, xref="paper", yref="paper", xanchor="left", yanchor="top", showarrow=False,
                          text=f"{ceilings['device']} ({ceilings['dtype']}): memory {bandwidth / 1e9:.1f} GB/s"
                               f"{datasheet}, "
                               f"matmul {peak / 1e9:.0f} GFLOP/s, ridge at {ridge:.1f} FLOP/byte",
                          font={"size": 11})
    for index, (label, points) in enumerate(lanes.items()):
        colour = LANE_COLOURS.get(label.split(":")[0], PALETTE[index % len(PALETTE)])
        for point in points:
            figure.add_trace(go.Scatter(
                x=[point["intensity"]], y=[point["flops_per_s"] / 1e9], mode="markers",
                name=f"{label} {point['phase']}",
                marker={"color": colour, "size": 12, "symbol": PHASE_SYMBOLS.get(point["phase"], "circle")},
                hovertemplate=(f"{label} {point['phase']}: %{{x:.2f}} FLOP/byte, %{{y:.2f}} GFLOP/s, "
                               f"{point['bytes_per_s'] / 1e9:.1f} GB/s<extra></extra>")))
    figure.update_xaxes(type="log", title="arithmetic intensity (FLOPs per byte moved)")
    figure.update_yaxes(type="log", title="achieved GFLOP/s")
    figure.update_layout(height=360, margin={"l": 60, "r": 20, "t": 30, "b": 50}, legend={"orientation": "h"})
    return figure


def race_points(memory: RaceMemory) -> dict[str, list[dict]]:
    """Each finished local lane of the visitor's last race -> its roofline points."""
    lanes = {}
    for trace in memory.traces or []:
        if trace.engine is not None and trace.stats is not None:
            lanes[f"{trace.name}: {trace.settings.describe()}"] = trace.engine.roofline_points(trace.stats)
    return lanes


def draw_roofline(pool: EnginePool, memory: RaceMemory):
    """The roofline of the visitor's last race, and a sentence on where its points sit."""
    lanes = race_points(memory)
    if not lanes:
        return gr.skip(), EMPTY_NOTE
    ceilings = pool.ceilings()
    return roofline_figure(vars(ceilings), lanes), point_notes(ceilings, lanes)


def point_notes(ceilings, lanes: dict[str, list[dict]]) -> str:
    """Where each point sits: its share of the roof above it, and which side of the ridge it is on."""
    notes = []
    for label, points in lanes.items():
        for point in points:
            roof = min(ceilings.bandwidth_bytes_per_s * point["intensity"], ceilings.peak_flops_per_s)
            bound = "memory" if point["intensity"] < ceilings.ridge else "compute"
            notes.append(f"{label.split(':')[0]} {point['phase']}: {100 * point['flops_per_s'] / roof:.0f}% of its "
                         f"roof ({bound}-bound side)")
    return "; ".join(notes) + "."


def draw_lab_roofline(pool: EnginePool, records) -> tuple:
    """Each finished mode of the visitor's last lab run (`ui.batching_view.RunRecord`s) as two points, its prefill
    and its decode steps' useful work over their measured time (`mode_points`)."""
    loaded = pool.loaded
    weights, kv = weights_read_per_step(loaded.model), loaded.config.kv_bytes_per_token(loaded.dtype)
    lanes = {mode_name(record.mode): points for record in records or [] if record.ended
             and (points := mode_points(record, loaded.config, weights, kv))}
    if not lanes:
        return gr.skip(), LAB_NOTE
    ceilings = pool.ceilings()
    return roofline_figure(vars(ceilings), lanes), point_notes(ceilings, lanes)


def build_lab_roofline_panel(pool: EnginePool, memory: gr.State, listener: dict) -> None:
    """The batching lab's closed roofline accordion (`memory`: the visitor's `ui.batching.LabMemory`)."""
    _panel("Roofline: each mode of the last run as points", "batching", "Draw the last run on the roofline", LAB_NOTE,
           lambda state: draw_lab_roofline(pool, state.records), memory, listener)


def build_roofline_panel(pool: EnginePool, memory: gr.State, listener: dict) -> None:
    """A closed accordion under the race: a button draws the last race on the device's roofline."""
    _panel("Roofline: is each lane bound by memory or by arithmetic?", "race", "Draw the last race on the roofline",
           EMPTY_NOTE, lambda state: draw_roofline(pool, state), memory, listener)


def _panel(title: str, prefix: str, button: str, note: str, draw, memory: gr.State, listener: dict) -> None:
    """A closed accordion: a button, a note and the plot `draw(memory)` fills (elements `{prefix}-roofline...`)."""
    with gr.Accordion(title, open=False, elem_id=f"{prefix}-roofline-panel"):
        click = gr.Button(button, elem_id=f"{prefix}-roofline-draw", size="sm")
        text = gr.Markdown(note, elem_id=f"{prefix}-roofline-note")
        plot = gr.Plot(label="roofline", elem_id=f"{prefix}-roofline")
    click.click(draw, memory, [plot, text], **listener)
