"""The soak's report: one row per kind of action (how many ended how, waits and end-to-end times against their
bounds), the checks with their verdicts, and docs/soak.md, which states what ran, on what, how each bound is derived
and each check's result with the figures behind it. Reads what `run.soak` returned; measures nothing itself.
"""

from __future__ import annotations

from dataclasses import asdict

import numpy as np

from server.soak.checks import GRACE_S, SLACK, Action, add_bounds, log_problems, over_bound, rss_summary, service_s


def percentiles(values: list[float]) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {"p50": None, "p95": None, "max": None}
    return {"p50": round(float(np.percentile(values, 50)), 2), "p95": round(float(np.percentile(values, 95)), 2),
            "max": round(max(values), 2)}


def kind_rows(actions: list[Action], solo: dict, users: int) -> list[dict]:
    """One row per kind of soak action: how many ended how, waits, end-to-end times (s) and tokens, the solo figures'
    range, the largest bounds, and the worst end-to-end time over its fair share (U x its service time)."""
    rows = []
    for kind in ("race", "turn", "api"):
        group = [a for a in actions if a.phase == "soak" and a.kind == kind]
        timed = [a for a in group if a.outcome == "finished"]
        keys = sorted({a.key for a in actions if a.kind == kind} & set(solo))
        services = [(a.e2e_s, service_s(solo[a.key], a.tokens)) for a in timed if a.key in solo]
        shares = [e2e / (users * service) for e2e, service in services if service > 0]
        rows.append({"kind": kind, "actions": len(group),
                     **{outcome: sum(a.outcome == outcome for a in group)
                        for outcome in ("finished", "refused", "dropped", "bad", "problem")},
                     "wait_s": percentiles([a.wait_s for a in timed]), "e2e_s": percentiles([a.e2e_s for a in timed]),
                     "tokens": percentiles([a.tokens for a in timed]),
                     "solo_keys": len(keys),
                     "solo_wait_s": max((solo[k]["wait_s"] or 0.0 for k in keys), default=None),
                     "solo_e2e_s": max((solo[k]["e2e_s"] for k in keys), default=None),
                     "solo_tokens": sorted({solo[k]["tokens"] for k in keys if solo[k]["tokens"] is not None}),
                     "bound_wait_s": max((a.bound_wait_s for a in timed if a.bound_wait_s), default=None),
                     "bound_e2e_s": max((a.bound_e2e_s for a in timed if a.bound_e2e_s), default=None),
                     "worst_e2e_over_fair_share": round(max(shares), 2) if shares else None,
                     "over_bound": sum(over_bound(a) for a in timed)})
    return rows


def build_checks(actions: list[Action], api: dict, live: dict, rss: dict, tracebacks: list | None, users: int,
                 limit: float) -> dict:
    """Each check's name and verdict (None: not run)."""
    page = [a for a in actions if a.kind in ("race", "turn")]

    def all_good(kind: str) -> bool:
        ran = [a for a in page if a.kind == kind]
        return all(a.outcome in ("finished", "refused") for a in ran) and any(a.outcome == "finished" for a in ran)

    return {
        "every race ends Finished, both lanes hold text, the table is filled and agrees with the status (refusals "
        "counted)": all_good("race"),
        "every chat turn's reply is in the log and the stats table gains its row": all_good("turn"),
        f"no wait over {SLACK:g} x U x solo wait + {GRACE_S:g} s, no end-to-end time over {SLACK:g} x U x service + "
        f"{GRACE_S:g} s (U = {users}; service: the solo time scaled to the tokens generated)": not any(
            over_bound(a) for a in actions if a.phase == "soak") and any(a.bound_e2e_s for a in actions),
        **{f"API: {name}": passed for name, passed in api["checks"].items() if name != "no KV block held at the end"},
        "no KV block held, nothing queued or running at the end (/metrics, read from the pool)":
            (live["kv_blocks_in_use"], live["running_requests"], live["queue_length"]) == (0, 0, 0),
        "no traceback in the server's log": None if tracebacks is None else not tracebacks,
        f"RSS flat (the median of the soak's four quarter slopes <= {limit:g} MiB/min)": rss["flat"],
    }


def build_report(result: dict, args, users: int, server_log: str | None) -> dict:
    actions, times, api, live = result["actions"], result["times"], result["api"], result["live"]
    solo = add_bounds(actions, users)
    rss = rss_summary(result["samples"], times["soak_start_s"], times["soak_end_s"], args.rss_slope_limit) \
        if result["samples"] else {"flat": None, "why": "a server given by --url: its memory is not sampled"}
    tracebacks = log_problems(server_log) if server_log is not None else None
    checks = build_checks(actions, api, live, rss, tracebacks, users, args.rss_slope_limit)
    problems = [f"{a.actor} {a.kind} at {a.started_s:.0f} s: {a.outcome}: {a.note}" for a in actions
                if a.outcome in ("problem", "refused")]
    problems += [f"over bound: {a.actor} {a.kind} at {a.started_s:.0f} s ({a.tokens} tokens): wait {a.wait_s} s "
                 f"(bound {a.bound_wait_s}), e2e {a.e2e_s} s (bound {a.bound_e2e_s})" for a in actions if over_bound(a)]
    return {"model": result["model"], "checks": checks, "passed": all(v is not False for v in checks.values()),
            "users": {"racers": args.racers, "chatters": args.chatters, "api_clients": args.api_clients,
                      "U": users},
            "times": {**times, "soak_s": round(times["soak_end_s"] - times["soak_start_s"], 1)},
            "kinds": kind_rows(actions, solo, users), "solo": solo, "rss": rss, "api_summary": api["summary"],
            "api_rows": api["rows"], "end_metrics": live, "page_requests_ended": result["page_requests"],
            "server_log": {"tracebacks": tracebacks, "lines": None if server_log is None
                           else len(server_log.splitlines())},
            "problems": problems + api["problems"], "rss_samples": result["samples"],
            "actions": [asdict(a) for a in actions]}


def rss_by_minute(samples: list[tuple[float, float]], start_s: float, end_s: float) -> list[float]:
    """The median RSS (MiB) of each whole minute of the soak, for the trace in docs/soak.md."""
    minutes = []
    for minute in range(int((end_s - start_s) // 60)):
        part = [mib for t, mib in samples if start_s + 60 * minute <= t < start_s + 60 * (minute + 1)]
        if part:
            minutes.append(round(float(np.median(part)), 1))
    return minutes


def bounds_text(users: int) -> list[str]:
    return ["Wait: to the first text of a race's lanes or a chat reply (read in the page every 0.1 s), or to the first "
            "chunk with text of a streamed API request. End to end: to a race's or turn's final status, or a request's "
            "last byte. Tokens: generated, read from the race summary (the longer lane), the chat stats table's row, "
            "or the API's usage.", "",
            "Solo: before the soak every actor runs alone once (each racer twice, the second warm race counting; each "
            "chat turn of one conversation; each API endpoint and prompt streamed once), giving per key (racer, chat "
            "turn, API endpoint and prompt) a solo wait, end-to-end time and token count. Service time of a soak "
            "action: solo wait + (solo e2e - solo wait) / (solo tokens - 1) x (its tokens - 1), the solo time scaled "
            "to the length of its own reply. Bounds: wait <= "
            f"{SLACK:g} x U x solo wait + {GRACE_S:g} s; e2e <= {SLACK:g} x U x service + {GRACE_S:g} s, U = {users} "
            "requests in flight at most on one device (two per racer, its lanes; one per chatter and API client). "
            "The engine shares the device between requests, each getting at least 1/U of it, so U x service is the "
            f"fair share; as much again is allowed, and {GRACE_S:g} s for the page's refresh and polling. The "
            "browser and the soak's clients run on the same cores as the server, which the slack also covers."]


def markdown(report: dict, command: str) -> str:
    """docs/soak.md: what ran, on what, each check and the figures behind it."""
    machine, times, users, rss = report["machine"], report["times"], report["users"], report["rss"]
    lines = ["# Soak test", "", "Written by `python -m server.soak` (`server/soak/`: `checks.py` says how each bound "
             "is derived, `run.py` what runs).", "", f"    {command}", "",
             f"Host: {machine['processor']}, {machine['cpu_count']} cores, torch {machine['torch']} "
             f"({machine['cpu_capability']}, AVX-512 BF16 {machine['avx512_bf16']}, AMX {machine['amx']}); "
             f"{report['model']} served by `python app.py --device cpu --dtype {report['arguments']['dtype']}` in a "
             f"process of its own. Soak {times['soak_s']:.0f} s after the solo phase; {users['racers']} racing and "
             f"{users['chatters']} chatting browser visitors and {users['api_clients']} API clients (U = "
             f"{users['U']} requests in flight at most); {report['started']}.", "", "## Checks", "",
             "| check | result |", "|---|---|"]
    lines += [f"| {name} | {'not run' if passed is None else 'PASS' if passed else 'FAIL'} |"
              for name, passed in report["checks"].items()]
    lines += ["", "## Waits and end-to-end times (seconds, soak phase)", "", *bounds_text(users["U"]), "",
              "| kind | actions | finished | refused | dropped | bad | problems | wait p50 / p95 / max | "
              "e2e p50 / p95 / max | tokens p50 / max (solo) | solo wait / e2e (longest) | bound wait / e2e (largest) "
              "| worst e2e / fair share | over bound |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in report["kinds"]:
        wait, e2e, tokens = row["wait_s"], row["e2e_s"], row["tokens"]
        lines.append(f"| {row['kind']} | {row['actions']} | {row['finished']} | {row['refused']} | {row['dropped']} "
                     f"| {row['bad']} | {row['problem']} | {wait['p50']} / {wait['p95']} / {wait['max']} | "
                     f"{e2e['p50']} / {e2e['p95']} / {e2e['max']} | {tokens['p50']} / {tokens['max']} "
                     f"({', '.join(map(str, row['solo_tokens']))}) | {row['solo_wait_s']} / {row['solo_e2e_s']} | "
                     f"{row['bound_wait_s']} / {row['bound_e2e_s']} | {row['worst_e2e_over_fair_share']} | "
                     f"{row['over_bound']} |")
    api = report["api_summary"]
    lines += ["", f"API: {api['good_requests']} good requests, {api['dropped_streams']} dropped streams "
              f"({api['cancelled']} cancelled on the server, {api['late_disconnects']} had finished first), "
              f"{api['bad_bodies']} bad bodies; {api['generated_tokens']} tokens generated. Page requests that "
              f"ended in the soak: {report['page_requests_ended']}.", "", "## Server memory (RSS)", ""]
    if rss.get("start_mib") is not None:
        minutes = rss_by_minute(report["rss_samples"], times["soak_start_s"], times["soak_end_s"])
        lines += [f"{rss['samples']} samples, one every {report['arguments']['rss_every']:g} s: start "
                  f"{rss['start_mib']} MiB, peak {rss['peak_mib']} MiB, end {rss['end_mib']} MiB. Median of each "
                  f"minute: {' -> '.join(map(str, minutes))} MiB. Slope of each quarter of the soak: "
                  f"{' / '.join(map(str, rss['quarter_slopes_mib_per_min']))} MiB/min; the check's figure, their "
                  f"median: {rss['median_quarter_slope_mib_per_min']} MiB/min (limit {rss['limit_mib_per_min']:g}; "
                  "a leak climbs in every quarter, a one-time step in one). Least squares after the first "
                  f"{rss['warmup_s']:g} s: {rss['slope_after_warmup_mib_per_min']} MiB/min."]
    else:
        lines.append(f"Not measured: {rss.get('why')}.")
    end = report["end_metrics"]
    lines += ["", "## At the end", "", f"/metrics: {end['kv_blocks_in_use']:g} KV blocks in use, "
              f"{end['running_requests']:g} running, {end['queue_length']:g} queued. Server log: "
              f"{report['server_log']['lines']} lines, tracebacks: {report['server_log']['tracebacks']}.", "",
              "## Problems", ""]
    lines += [f"- {problem}" for problem in report["problems"]] or ["None."]
    return "\n".join(lines) + "\n"
