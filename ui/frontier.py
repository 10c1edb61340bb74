"""The goodput frontier: a `batch-bench --rates` sweep drawn as throughput against p95 latency, a line per batching
mode through its request rates, as a pure function of the sweep's plain rows (the JSON's `sweep` list). A point up
and to the left serves more tokens per second at a lower tail latency; along a mode's line the rate rises, and where
the line turns right the mode has stopped keeping up. Plain rows in, a figure out (no engine, no clock), so a page
and the docs draw a sweep the same way:

    python -m ui.frontier SWEEP.json OUT.html   # the chart of a saved sweep, as a standalone HTML page
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import plotly.graph_objects as go

from ui.batching_view import MODE_COLOURS

PEER_COLOUR = "#94a3b8"


def _hover(row: dict) -> str:
    goodput = row.get("goodput_requests_per_s")
    judged = ("no latency target" if goodput is None else
              f"goodput {goodput:g} requests/s, {row['slo_attainment_pct']:g}% met the targets")
    tpot = row.get("tpot_ms_p95")
    return (f"{row['name']} at {row['rate_requests_per_s']:g} requests/s<br>{row['throughput_tokens_per_s']:g} "
            f"tok/s, p95 latency {row['latency_ms_p95'] / 1e3:.2f} s, p95 TTFT {row['ttft_ms_p95'] / 1e3:.2f} s"
            + (f", p95 TPOT {tpot:g} ms" if tpot is not None else "") + f"<br>{judged}")


def frontier_figure(sweep: list[dict], title: str | None = None) -> go.Figure:
    """One line per row name (our modes coloured as in the lab, transformers rows grey and dashed), its points in
    order of rate, each labelled with its rate; the hover gives goodput and attainment."""
    figure = go.Figure()
    names = list(dict.fromkeys(row["name"] for row in sweep))
    for name in names:
        rows = sorted((row for row in sweep if row["name"] == name), key=lambda row: row["rate_requests_per_s"])
        ours = name in MODE_COLOURS
        colour = MODE_COLOURS.get(name, PEER_COLOUR)
        figure.add_trace(go.Scatter(
            x=[row["latency_ms_p95"] / 1e3 for row in rows], y=[row["throughput_tokens_per_s"] for row in rows],
            mode="lines+markers+text", name=name, text=[f"{row['rate_requests_per_s']:g}/s" for row in rows],
            textposition="top left", textfont={"size": 10, "color": colour},
            line={"color": colour, "width": 2, "dash": "solid" if ours else "dash"}, marker={"size": 8},
            hovertext=[_hover(row) for row in rows], hoverinfo="text"))
    if not sweep:
        figure.add_annotation(text="A request-rate sweep (batch-bench --rates) draws each batching mode here.",
                              xref="paper", yref="paper", x=0.5, y=0.5, showarrow=False, font={"color": "#64748b"})
    figure.update_layout(
        title=title or "Throughput against p95 latency, one point per request rate (labels: requests/s)",
        template="plotly_white", height=420, margin={"l": 60, "r": 20, "t": 50, "b": 50},
        legend={"orientation": "h", "y": -0.18, "x": 0},
        xaxis={"title": {"text": "p95 latency (s, arrival to last token)"}, "rangemode": "tozero"},
        yaxis={"title": {"text": "throughput (output tokens/s)"}, "rangemode": "tozero"})
    return figure


def main(argv: list[str]) -> int:
    """Write a saved sweep's chart as a standalone HTML page (plotly.js from its CDN)."""
    if len(argv) != 2:
        print("usage: python -m ui.frontier SWEEP.json OUT.html", file=sys.stderr)
        return 2
    report = json.loads(Path(argv[0]).read_text())
    if "sweep" not in report:
        print(f"{argv[0]} has no `sweep` list: write it with batch-bench --rates ... --json PATH.", file=sys.stderr)
        return 2
    arguments = report["arguments"]
    title = (f"{arguments['model']} on {arguments['device']} ({arguments['dtype']}), {arguments['requests']} "
             f"requests: throughput against p95 latency by request rate")
    frontier_figure(report["sweep"], title).write_html(argv[1], include_plotlyjs="cdn", full_html=True)
    print(f"wrote {argv[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
