"""Plotly figures as pure functions of measured values (no engine, no state): the race's tokens/s over time,
speculative decoding's acceptance by draft position and over the verification steps, and the logit lens (a token's
probability after each layer).

The speed chart's x axis is each lane's own busy time (the clock the engine runs only while working on that lane's
request), so a lane's curve shows its own speed even though the two lanes take turns on one device. Each lane's TTFT
is a dotted vertical line labelled in the margin above the plot, a line of its own per lane in order of arrival (the
first token's label on top, each later one a line lower, starting at its own TTFT): whichever lane comes first, the
labels never draw on top of each other, and never over the curves.
"""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

LANE_COLOURS = {"A": "#2563eb", "B": "#ea580c"}
ROLLING_TOKENS = 8  # tokens/s at a point is measured over the last this-many tokens
TTFT_FONT_PX = 12
TTFT_LINE_PX = 20  # one TTFT label's line: its 12 px text is about 17 px tall with the box's padding, plus a gap
PAGE_LABEL_PX = 30  # the page draws the chart's label over its top-left corner: the TTFT lines start below it


def rolling_tokens_per_s(times_s: list[float]) -> tuple[list[float], list[float]]:
    """Token-ready times (own clock) -> (x, tokens/s) points, one per token after the first: the rate over the
    window of up to ROLLING_TOKENS tokens that ends at that token."""
    xs, ys = [], []
    for index in range(1, len(times_s)):
        start = max(0, index - ROLLING_TOKENS)
        elapsed = times_s[index] - times_s[start]
        if elapsed > 0:
            xs.append(times_s[index])
            ys.append((index - start) / elapsed)
    return xs, ys


def speed_figure(lanes: dict[str, dict]) -> go.Figure:
    """`lanes`: name -> {"label": str, "times_s": [own-clock time of each token]}. TTFT (the first token's time) is
    marked on each curve and by a labelled vertical line; with no lanes, the empty chart says what will appear."""
    figure = go.Figure()
    # Lines from the top, in order of arrival: the earliest first token on the top line; a tie keeps the lanes' order.
    arrivals = sorted((lane["times_s"][0], index) for index, lane in enumerate(lanes.values()) if lane["times_s"])
    line_of = {index: line for line, (_, index) in enumerate(arrivals)}
    lines = max(2, len(lanes))  # the race's two lanes: the margin keeps its height as the labels arrive
    for index, (name, lane) in enumerate(lanes.items()):
        colour = LANE_COLOURS.get(name, "#475569")
        times = lane["times_s"]
        xs, ys = rolling_tokens_per_s(times)
        figure.add_trace(go.Scatter(x=xs, y=ys, mode="lines", name=f"{name}: {lane['label']}",
                                    line={"color": colour, "width": 2},
                                    hovertemplate="%{y:.1f} tok/s at %{x:.2f} s<extra>" + name + "</extra>"))
        if times:
            figure.add_trace(go.Scatter(
                x=[times[0]], y=[ys[0] if ys else 0], mode="markers", name=f"{name} TTFT",
                marker={"color": colour, "size": 11, "symbol": "diamond"}, cliponaxis=False, showlegend=False,
                hovertemplate=f"lane {name} first token at %{{x:.3f}} s<extra></extra>"))
            figure.add_vline(x=times[0], line={"color": colour, "width": 1, "dash": "dot"})
            figure.add_annotation(x=times[0], y=1.0, xref="x", yref="paper", xanchor="left", yanchor="bottom",
                                  yshift=TTFT_LINE_PX * (lines - 1 - line_of[index]), showarrow=False,
                                  text=f"{name}: TTFT {times[0] * 1e3:.0f} ms",
                                  font={"color": colour, "size": TTFT_FONT_PX}, bgcolor="rgba(255,255,255,0.85)")
    if not lanes:
        figure.add_annotation(text="Each lane's tokens/s appears here as the race runs.", xref="paper",
                              yref="paper", x=0.5, y=0.5, showarrow=False, font={"color": "#64748b"})
    figure.update_layout(
        height=290, margin={"l": 50, "r": 20, "t": PAGE_LABEL_PX + TTFT_LINE_PX * lines, "b": 70},
        template="plotly_white",
        legend={"orientation": "h", "y": -0.35, "x": 0},
        xaxis_title="lane's own device time (s)", yaxis_title=f"tokens/s (last {ROLLING_TOKENS} tokens)",
        yaxis={"rangemode": "tozero"}, xaxis={"rangemode": "tozero"})
    return figure


def acceptance_figure(lanes: dict[str, dict]) -> go.Figure:
    """Speculative decoding's acceptance, per speculating lane. `lanes`: name -> {"label": str,
    "accepted_by_position": [...], "drafted_by_position": [...], "running_rate": [accepted / drafted after each
    verification step]}. Left: the share of drafts accepted at each draft position (accepted / drafted); right: the
    running acceptance rate over the verification steps."""
    figure = make_subplots(rows=1, cols=2, column_widths=[0.45, 0.55], horizontal_spacing=0.14,
                           subplot_titles=("accepted / drafted by draft position", "acceptance rate so far"))
    for name, lane in lanes.items():
        colour = LANE_COLOURS.get(name, "#475569")
        accepted, drafted = lane["accepted_by_position"], lane["drafted_by_position"]
        positions = [index + 1 for index, count in enumerate(drafted) if count]
        rates = [accepted[p - 1] / drafted[p - 1] for p in positions]
        counts = [[accepted[p - 1], drafted[p - 1]] for p in positions]
        figure.add_trace(go.Bar(x=positions, y=rates, customdata=counts, name=f"{name}: {lane['label']}",
                                marker_color=colour, legendgroup=name,
                                hovertemplate="position %{x}: %{customdata[0]} of %{customdata[1]} drafts accepted"
                                              f"<extra>{name}</extra>"), row=1, col=1)
        steps = list(range(1, len(lane["running_rate"]) + 1))
        figure.add_trace(go.Scatter(x=steps, y=lane["running_rate"], mode="lines", name=f"{name} running rate",
                                    line={"color": colour, "width": 2}, legendgroup=name, showlegend=False,
                                    hovertemplate="after step %{x}: %{y:.0%} accepted" + f"<extra>{name}</extra>"),
                         row=1, col=2)
    figure.update_layout(height=330, margin={"l": 50, "r": 20, "t": 60, "b": 80}, template="plotly_white",
                         barmode="group", legend={"orientation": "h", "y": -0.3, "x": 0})
    figure.update_xaxes(title_text="draft position", dtick=1, row=1, col=1)
    figure.update_xaxes(title_text="verification step", rangemode="tozero", row=1, col=2)
    figure.update_yaxes(range=[0, 1.05], tickformat=".0%")
    return figure


def lens_figure(rows: list[dict], token_label: str, marked_layer: int | None = None,
                marked_note: str = "") -> go.Figure:
    """The logit lens of one token. `rows`: per layer {"layer", "token_prob", "token_rank", "top_prob", "top_name"}
    (the layer's own top token and its probability). The chosen token's probability over the layers, the layer's top
    probability beside it, and a dotted line at `marked_layer` (an early-exit draft's depth) labelled `marked_note`."""
    layers = [row["layer"] for row in rows]
    figure = go.Figure()
    figure.add_trace(go.Scatter(
        x=layers, y=[row["token_prob"] for row in rows], mode="lines+markers", name=f"p({token_label})",
        line={"color": LANE_COLOURS["A"], "width": 2}, customdata=[row["token_rank"] + 1 for row in rows],
        hovertemplate="layer %{x}: p %{y:.3f}, rank %{customdata}<extra></extra>"))
    figure.add_trace(go.Scatter(
        x=layers, y=[row["top_prob"] for row in rows], mode="lines", name="the layer's top token",
        line={"color": "#94a3b8", "width": 1, "dash": "dash"}, customdata=[row["top_name"] for row in rows],
        hovertemplate="layer %{x}: top %{customdata} p %{y:.3f}<extra></extra>"))
    if marked_layer is not None:
        figure.add_vline(x=marked_layer, line={"color": LANE_COLOURS["B"], "width": 1, "dash": "dot"})
        figure.add_annotation(x=marked_layer, y=1.0, yref="paper", xanchor="left", yanchor="bottom", showarrow=False,
                              text=marked_note, font={"color": LANE_COLOURS["B"], "size": 11})
    figure.update_layout(height=300, margin={"l": 50, "r": 20, "t": 40, "b": 70}, template="plotly_white",
                         legend={"orientation": "h", "y": -0.3, "x": 0}, xaxis_title="after layer",
                         yaxis_title="probability", yaxis={"range": [0, 1.05]})
    return figure
