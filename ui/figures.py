"""Plotly figures as pure functions of measured values (no engine, no state): the race's tokens/s over time.

The x axis is each lane's own busy time (the clock the engine runs only while working on that lane's request), so a
lane's curve shows its own speed even though the two lanes take turns on one device.
"""

from __future__ import annotations

import plotly.graph_objects as go

LANE_COLOURS = {"A": "#2563eb", "B": "#ea580c"}
ROLLING_TOKENS = 8  # tokens/s at a point is measured over the last this-many tokens


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
    marked on each curve."""
    figure = go.Figure()
    for name, lane in lanes.items():
        colour = LANE_COLOURS.get(name, "#475569")
        times = lane["times_s"]
        xs, ys = rolling_tokens_per_s(times)
        figure.add_trace(go.Scatter(x=xs, y=ys, mode="lines", name=f"{name}: {lane['label']}",
                                    line={"color": colour, "width": 2},
                                    hovertemplate="%{y:.1f} tok/s at %{x:.2f} s<extra>" + name + "</extra>"))
        if times:
            figure.add_trace(go.Scatter(
                x=[times[0]], y=[ys[0] if ys else 0], mode="markers+text", name=f"{name} TTFT",
                marker={"color": colour, "size": 11, "symbol": "diamond"}, text=[f"TTFT {times[0] * 1e3:.0f} ms"],
                textposition="top right", cliponaxis=False, showlegend=False,
                hovertemplate=f"lane {name} first token at %{{x:.3f}} s<extra></extra>"))
    figure.update_layout(
        height=330, margin={"l": 50, "r": 20, "t": 40, "b": 80}, template="plotly_white",
        legend={"orientation": "h", "y": -0.3, "x": 0},
        xaxis_title="lane's own device time (s)", yaxis_title=f"tokens/s (last {ROLLING_TOKENS} tokens)",
        yaxis={"rangemode": "tozero"}, xaxis={"rangemode": "tozero"})
    return figure
