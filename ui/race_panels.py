"""The race's panels built from the lanes' traces (`RacePanels`), and what a visitor's page keeps of its last race
(`RaceMemory`: the colour mode its lanes are drawn in, and the finished lanes' traces, which the colour mode's redraw
and the logit lens read; see `ui.race_inspect`).

A panel that has not changed is not sent again: `RacePanels` remembers what it last sent of each output (HTML, a
table, the acceptance chart's version). Updates are tuples in `RACE_OUTPUTS` order (`frame`); outputs not named are
left as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import gradio as gr
import pandas as pd

from ui.figures import acceptance_figure, speed_figure
from ui.race_table import summary_frame, summary_notes_html
from ui.race_view import LaneTrace, identical_html, kv_view_html, lane_html

RACE_OUTPUTS = ("lane_a", "lane_b", "chart", "acceptance", "summary", "summary_notes", "identical", "kv_view", "status",
                "run_button")


@dataclass
class RaceMemory:
    """One visitor's last race, kept in a `gr.State`: the colour mode of the lanes' text (`ui.token_view.COLOUR_MODES`)
    and the lanes' traces once the race has ended (None while one runs, or when it did not start)."""

    mode: str = "draft"
    traces: list[LaneTrace] | None = None


def frame(**values) -> tuple:
    """One update in RACE_OUTPUTS order; outputs not named are left as they are."""
    return tuple(values.get(name, gr.skip()) for name in RACE_OUTPUTS)


class RacePanels:
    """The race's panels built from the lanes' traces, and what was last sent of each (HTML, a table, the acceptance
    chart's version), so that a panel that has not changed is not sent again."""

    def __init__(self, traces: list[LaneTrace], memory: RaceMemory | None = None):
        self.traces = traces
        self.memory = memory if memory is not None else RaceMemory()  # its colour mode may change mid-race
        self.by_name = {trace.name: trace for trace in traces}
        self.speculates = any(trace.acceptance is not None for trace in traces)
        self.sent: dict = {}

    @property
    def started(self) -> bool:
        return bool(self.sent)

    def _lanes(self) -> dict:
        return lanes_html(self.traces, self.memory.mode)

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
        self.sent.update(**self._lanes(), **self._panels())
        return frame(**{**self.sent, "acceptance": self._acceptance()}, chart=speed_figure(_chart_lanes(self.traces)),
                     status=status, run_button=gr.update(interactive=False))

    def update(self, with_panels: bool) -> dict:
        """The outputs whose value changed since last sent: the lanes' text, and with `with_panels` the charts,
        table, lane numbers and KV view. The acceptance chart is drawn only when its version changed (a
        verification step was counted, or a lane finished)."""
        if with_panels:
            self._refresh()
        values = self._lanes()
        if with_panels:
            values.update(self._panels())
        changed = {name: value for name, value in values.items() if not _same(self.sent.get(name), value)}
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
        return frame(**self._lanes(), chart=speed_figure(_chart_lanes(traces)), acceptance=self._acceptance(),
                     summary=summary_frame(traces), summary_notes=summary_notes_html(traces),
                     identical=identical_html(traces, True), kv_view=kv_view_html(traces), status=status,
                     run_button=gr.update(interactive=True))


def lanes_html(traces: list[LaneTrace], mode: str) -> dict:
    """Both lanes' HTML in colour mode `mode`, by output name."""
    return {"lane_a": lane_html(traces[0], "A", mode), "lane_b": lane_html(traces[1], "B", mode)}


def _same(sent, value) -> bool:
    """Whether an output's new value equals the one last sent (tables compared cell by cell)."""
    if isinstance(value, pd.DataFrame):
        return isinstance(sent, pd.DataFrame) and sent.equals(value)
    return sent == value


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


