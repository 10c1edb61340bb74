"""The soak's pure checks: what makes a race's or a chat turn's panels inconsistent, the wait bounds from the solo
times and the tokens each action generated, the RSS slope after the warm-up, and the tracebacks in the server's log.
Nothing here touches a browser, a socket or a clock, so tests/server/test_soak.py checks each one with exact values.

The bound. Before the soak every actor runs alone once; an action's service time is read from its key's solo action
(the same racer, the same chat turn, the same API prompt and endpoint) and scaled to the tokens it generated, since a
reply of 40 tokens takes longer than one of 8 for reasons that have nothing to do with sharing the device:
service = solo wait + (solo end to end - solo wait) / (solo tokens - 1) x (tokens - 1), the solo wait standing for the
prefill and the page's first update, the rest for one decode step per token after the first. With at most U requests
in flight on one device (two per racer, its lanes; one per chatter and API client) an action's fair share is U x its
service time (the engine shares the device between requests: each gets at least 1/U of it; batching only does
better). A race's solo time already has its two lanes sharing, so its bound is the more generous. The check allows
as much again plus GRACE_S for the page's refresh and polling:
measured <= SLACK x U x service + GRACE_S, for the end-to-end time, and SLACK x U x solo wait + GRACE_S for the wait
(the first text comes after the prefill, which the reply's length does not change).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SLACK, GRACE_S = 2.0, 1.0  # measured <= SLACK x U x service + GRACE_S (see the docstring)
# RSS: the slope is fitted after the first WARMUP_FRACTION of the soak. The big warm-up step (engines built, about
# +100 MiB) happens in the solo phase, before the soak; a leak shows as a steady climb through both halves (before
# ui.session_state: 10-13 MiB a minute in every quarter of a 5-minute soak, 7 over 10 minutes).
WARMUP_FRACTION = 0.5


@dataclass
class Action:
    """One visitor action or API request, timed at the client (wall clock, seconds)."""
    actor: str  # racer-1, chatter-1, api-1
    kind: str  # race, turn, api
    phase: str  # solo (the service-time measurement) or soak
    key: str  # what its solo time is looked up by: the racer, the chat turn, or the API endpoint and prompt
    started_s: float  # since the run began
    wait_s: float | None = None  # to the first text (page) or the first chunk with text (streamed API request)
    e2e_s: float | None = None  # to the end: the race's or turn's final status, the request's last byte
    outcome: str = "finished"  # finished, refused, problem, dropped (API, by plan), bad (API, by plan)
    note: str = ""
    tokens: int | None = None  # generated: a race's longer lane, a turn's table row, a request's usage
    bound_wait_s: float | None = None
    bound_e2e_s: float | None = None


def lane_figures(headers: list[str], rows: list[list[str]]) -> dict[str, dict[str, str]]:
    """Each lane's figures from the race summary table (a row per figure: a `figure` column, then one per lane)."""
    return {lane: {row[0]: row[i] for row in rows if i < len(row)} for i, lane in enumerate(headers) if i}


def race_tokens(figures: dict[str, dict[str, str]]) -> int | None:
    """The longer lane's tokens generated (the race ends when both lanes have), or None when a lane's is not a count."""
    counts = [values.get("tokens generated", "") for lane, values in figures.items() if lane.startswith("Lane")]
    return max(int(count) for count in counts) if counts and all(c.isdigit() for c in counts) else None


def turn_tokens(headers: list[str], rows: list[list[str]]) -> int | None:
    """The last row's tokens generated in the chat stats table, or None when the table has no such count."""
    headers = [" ".join(header.split()) for header in headers]  # a header drawn on two lines reads as one
    if not rows or "tokens generated" not in headers:
        return None
    column = headers.index("tokens generated")
    value = rows[-1][column] if column < len(rows[-1]) else ""
    return int(value) if value.isdigit() else None


def race_problem(status: str, lane_texts: list[str], figures: dict[str, dict[str, str]],
                 max_new_tokens: int) -> str | None:
    """What is inconsistent in a finished race's panels, or None: both lanes hold text, the table has both lanes
    with tokens generated (1..max_new_tokens), a finish reason and a TTFT, and the status names the same counts."""
    if not status.startswith("Finished"):
        return f"status {status[:160]!r}"
    if len(lane_texts) != 2 or not all(text.strip() for text in lane_texts):
        return "a lane's output panel is empty"
    lanes = sorted(name for name in figures if name.startswith("Lane"))
    if lanes != ["Lane A", "Lane B"]:
        return f"the summary table's lanes are {sorted(figures)}"
    for lane in lanes:
        values = figures[lane]
        tokens, finish = values.get("tokens generated", ""), values.get("finish reason", "")
        if not tokens.isdigit() or not 0 < int(tokens) <= max_new_tokens:
            return f"{lane}: tokens generated {tokens!r}"
        if finish not in ("length", "stop") or not values.get("TTFT (ms)"):
            return f"{lane}: finish reason {finish!r}, TTFT {values.get('TTFT (ms)')!r}"
        if f"{lane}: {tokens} tokens" not in status:
            return f"the status does not say {lane}'s {tokens} tokens: {status[:160]!r}"
    return None


def turn_problem(turn: int, message: str, shown: dict, stats_rows: list[list[str]]) -> str | None:
    """What is wrong with a chat turn's panels, or None: the message and a non-empty reply at the end of the log, one
    stats row per turn ending with this turn's, and a status that names the turn."""
    if not shown["status"].startswith(f"Turn {turn}:"):
        return f"status {shown['status'][:160]!r}"
    if len(shown["users"]) != turn or shown["users"][-1] != message:
        return f"the log's messages are {shown['users']}"
    if len(shown["bots"]) != turn or not shown["bots"][-1]:
        return "no reply in the log" if len(shown["bots"]) == turn else f"{len(shown['bots'])} replies in the log"
    if [row[0] for row in stats_rows] != [str(n) for n in range(1, turn + 1)]:
        return f"the stats table's turns are {[row[0] for row in stats_rows]}"
    return None


def service_s(solo: dict, tokens: int | None) -> float:
    """An action's service time alone, from its key's solo figures scaled to the `tokens` it generated (see the
    docstring). With no solo wait (a stream whose chunks held no text) the whole solo time scales with the tokens;
    with either count unknown the solo end-to-end time is used as it is."""
    if tokens is None or not solo.get("tokens"):
        return solo["e2e_s"]
    if not solo.get("wait_s"):
        return solo["e2e_s"] * max(tokens, 1) / solo["tokens"]
    per_token_s = (solo["e2e_s"] - solo["wait_s"]) / max(solo["tokens"] - 1, 1)
    return solo["wait_s"] + per_token_s * max(tokens - 1, 0)


def add_bounds(actions: list[Action], users: int, slack: float = SLACK, grace_s: float = GRACE_S) -> dict:
    """Each soak action's bounds: slack x users x the solo wait + grace_s, and slack x users x its service time (its
    key's solo figures scaled to its tokens) + grace_s. A key's solo figures are its last finished solo action's (a
    racer races twice alone, and the second race is warm, as the soak's races are). Returns the solo figures."""
    solo: dict[str, dict] = {}
    for action in actions:
        if action.phase == "solo" and action.outcome == "finished":
            solo[action.key] = {"wait_s": action.wait_s, "e2e_s": action.e2e_s, "tokens": action.tokens}
    for action in actions:
        if action.phase == "soak" and action.key in solo:
            figures, wait_s = solo[action.key], solo[action.key]["wait_s"]
            action.bound_wait_s = round(slack * users * wait_s + grace_s, 3) if wait_s else None  # no text seen alone
            action.bound_e2e_s = round(slack * users * service_s(figures, action.tokens) + grace_s, 3)
    return solo


def over_bound(action: Action) -> bool:
    return action.outcome == "finished" and action.bound_e2e_s is not None and (
        action.e2e_s > action.bound_e2e_s
        or (action.wait_s is not None and action.bound_wait_s is not None and action.wait_s > action.bound_wait_s))


def rss_summary(samples: list[tuple[float, float]], start_s: float, end_s: float, limit_mib_per_min: float,
                warmup_fraction: float = WARMUP_FRACTION) -> dict:
    """RSS (MiB) at the soak's start, its peak and end, the least-squares slope (MiB/min) after the warm-up (the
    first `warmup_fraction` of the soak) and the slope of each quarter of the soak; flat when the median quarter's
    slope is at most the limit. A leak climbs in every quarter; a one-time step (the first long prefill's activations
    kept by the allocator, say) in one, which the median leaves out and a least-squares fit over a half does not.
    `samples`: (seconds since the run began, MiB)."""
    during = [(t, mib) for t, mib in samples if start_s <= t <= end_s]
    warmed = start_s + warmup_fraction * (end_s - start_s)
    after = [(t, mib) for t, mib in during if t >= warmed]
    if len(after) < 3:
        return {"samples": len(during), "flat": None, "why": "fewer than 3 samples after the warm-up"}
    quarters = []
    for index in range(4):
        low, high = start_s + index * (end_s - start_s) / 4, start_s + (index + 1) * (end_s - start_s) / 4
        part = [(t, mib) for t, mib in during if low <= t <= high]
        quarters.append(round(slope_mib_per_min(part), 2) if len(part) >= 3 else None)
    slope = slope_mib_per_min(after)
    median_quarter = float(np.median([q for q in quarters if q is not None])) if any(q is not None for q in quarters) \
        else slope
    return {"samples": len(during), "start_mib": round(during[0][1], 1),
            "peak_mib": round(max(mib for _, mib in during), 1), "end_mib": round(during[-1][1], 1),
            "warmup_s": round(warmed - start_s, 1), "slope_after_warmup_mib_per_min": round(slope, 2),
            "quarter_slopes_mib_per_min": quarters, "limit_mib_per_min": limit_mib_per_min,
            "median_quarter_slope_mib_per_min": round(median_quarter, 2), "flat": median_quarter <= limit_mib_per_min}


def slope_mib_per_min(samples: list[tuple[float, float]]) -> float:
    """The least-squares slope of (seconds, MiB) samples, in MiB per minute."""
    return float(np.polyfit([t / 60 for t, _ in samples], [mib for _, mib in samples], 1)[0])


def log_problems(text: str) -> list[str]:
    """Lines of the server's log that report a failure: a traceback's first line and the line that names it."""
    lines = text.splitlines()
    found = []
    for index, line in enumerate(lines):
        if line.startswith("Traceback"):
            last = next((later for later in lines[index + 1:] if later and not later.startswith(" ")), "")
            found.append(f"line {index + 1}: {line} ... {last}")
    return found
