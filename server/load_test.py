"""`python -m server.load_test`: many concurrent clients against the OpenAI-compatible API, checking what must hold
under load and measuring latency and throughput.

`clients` workers share `requests` requests (a fixed, seeded plan): /v1/completions and /v1/chat/completions, whole
and streamed, over the shipped benchmark prompts; a fraction are streamed and dropped after their first 1-3 content
chunks (the client closes the connection), and a fraction are bad bodies. The checks: no 5xx (as the clients saw it
and as the server counted it); every good request a complete 200; every bad body a 400 whose `error.message` names
the problem; every dropped stream ended on the server (`playground_requests_total{source="api"}`: cancelled, or
finished when the request ended before the server saw the disconnect, counted apart as "late"); at the end no KV
block held (`playground_kv_blocks_in_use` on /metrics and, in-process, the pool itself). The counters are read as
differences, so the server under test should have no other traffic.

Without --url the app is served in-process on loopback over the bundled model (CPU, fp32) and stopped at the end.
Latency is end to end at the client; TTFT (streamed requests) is the time to the first chunk that carries text.
Throughput counts the good requests and their generated tokens (`usage.completion_tokens`) over the run's wall time.
The exit status is 1 when a check fails, 2 when the server cannot be reached.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass

import gradio as gr
import httpx
import numpy as np
import pandas as pd
import torch
from prometheus_client.parser import text_string_to_metric_families

from inference_core import load_model
from inference_core.bench.prompts import load_prompts
from inference_core.bench.speed import machine_info, write_report
from server.app import create_app, serve_in_thread
from serving.policy import ServePolicy
from serving.pool import EnginePool

# (what is wrong, endpoint, body given the served model's id (bytes go as they are), a word its 400 must name)
BAD_BODIES = (
    ("missing model", "completions", lambda model: {"prompt": "Hello", "max_tokens": 4}, "model"),
    ("prompt of the wrong type", "completions", lambda model: {"model": model, "prompt": 3}, "prompt"),
    ("temperature of the wrong type", "chat", lambda model: {"model": model, "temperature": "hot",
                                                              "messages": [{"role": "user", "content": "Hi"}]},
     "temperature"),
    ("unknown field", "completions", lambda model: {"model": model, "prompt": "Hi", "frobnicate": 1}, "frobnicate"),
    ("invalid JSON", "chat", lambda model: b'{"model": "' + model.encode() + b'", "messages": [', "JSON"),
    ("negative max_tokens", "completions", lambda model: {"model": model, "prompt": "Hi", "max_tokens": -5},
     "max_tokens"),
    ("messages not a list", "chat", lambda model: {"model": model, "messages": "Hi"}, "messages"),
    ("unknown role", "chat", lambda model: {"model": model, "messages": [{"role": "wizard", "content": "Hi"}]},
     "role"),
    ("stream not a boolean", "completions", lambda model: {"model": model, "prompt": "Hi", "stream": "yes"},
     "stream"),
    ("body not an object", "chat", lambda model: [{"model": model}], "object"),
    ("top_p out of range", "completions", lambda model: {"model": model, "prompt": "Hi", "top_p": 3}, "top_p"),
    ("empty stop string", "chat", lambda model: {"model": model, "stop": [""],
                                                  "messages": [{"role": "user", "content": "Hi"}]}, "stop"),
)
MODES = ("whole", "stream", "disconnect", "bad")


@dataclass
class Planned:
    index: int
    endpoint: str  # "completions" or "chat"
    mode: str  # one of MODES
    prompt_id: str
    disconnect_after: int = 0  # content chunks read before closing (mode "disconnect")
    bad: int = -1  # index into BAD_BODIES (mode "bad")
    temperature: float = 0.0


@dataclass
class Outcome:
    planned: Planned
    status: int | None = None
    latency_s: float | None = None
    ttft_s: float | None = None
    generated_tokens: int = 0
    problem: str | None = None  # what was not as expected; None when all was
    ended_before_disconnect: bool = False  # the stream's final chunk came before the client closed it


def make_plan(requests: int, disconnect_fraction: float, bad_fraction: float, prompt_ids: list[str],
              seed: int = 0) -> list[Planned]:
    """`requests` requests in a seeded random order: round(fraction x requests) dropped and bad ones, the rest good
    (whole or streamed, completions or chat, greedy or sampled)."""
    rng = random.Random(seed)
    bad, dropped = round(requests * bad_fraction), round(requests * disconnect_fraction)
    if bad + dropped > requests:
        raise ValueError("--disconnect-fraction and --bad-fraction add up to more than every request.")
    modes = ["bad"] * bad + ["disconnect"] * dropped + [rng.choice(("whole", "stream")) for _ in
                                                       range(requests - bad - dropped)]
    rng.shuffle(modes)
    plan, bad_sent = [], 0
    for index, mode in enumerate(modes):
        planned = Planned(index, rng.choice(("completions", "chat")), mode, rng.choice(prompt_ids),
                          temperature=rng.choice((0.0, 0.7)))
        if mode == "disconnect":
            planned.disconnect_after = rng.randint(1, 3)
        if mode == "bad":
            planned.bad, bad_sent = bad_sent % len(BAD_BODIES), bad_sent + 1  # each kind in turn
            planned.endpoint = BAD_BODIES[planned.bad][1]
        plan.append(planned)
    return plan


def good_body(planned: Planned, row: dict, model: str, max_tokens: int) -> dict:
    body = {"model": model, "max_tokens": max_tokens, "temperature": planned.temperature, "seed": planned.index}
    if planned.endpoint == "chat":
        system = [{"role": "system", "content": row["system"]}] if row.get("system") else []
        body["messages"] = system + [{"role": "user", "content": row["prompt"]}]
    else:
        body["prompt"] = row["prompt"]
    if planned.mode != "whole":
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


async def send_bad(client: httpx.AsyncClient, planned: Planned, model: str, outcome: Outcome) -> None:
    what, _, make, word = BAD_BODIES[planned.bad]
    body = make(model)
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = await client.post(url_of(planned), content=content, headers={"Content-Type": "application/json"})
    outcome.status = response.status_code
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = None
    if response.status_code != 400 or not isinstance(message, str) or word.lower() not in message.lower():
        outcome.problem = f"{what}: {response.status_code} {response.text[:200]!r} (expected a 400 naming {word!r})"


async def send_whole(client: httpx.AsyncClient, body: dict, planned: Planned, outcome: Outcome) -> None:
    response = await client.post(url_of(planned), json=body)
    outcome.status = response.status_code
    try:
        reply = response.json()
        outcome.generated_tokens = reply["usage"]["completion_tokens"]
        complete = len(reply["choices"]) == 1 and reply["choices"][0]["finish_reason"] in ("stop", "length")
    except (ValueError, KeyError, TypeError, IndexError):
        complete = False
    if response.status_code != 200 or not complete:
        outcome.problem = f"{response.status_code} {response.text[:200]!r}"


async def send_stream(client: httpx.AsyncClient, body: dict, planned: Planned, outcome: Outcome,
                      start: float) -> None:
    """Read the stream to [DONE], or close it after `disconnect_after` content chunks."""
    chunks, done, final = 0, False, False
    async with client.stream("POST", url_of(planned), json=body) as response:
        outcome.status = response.status_code
        if response.status_code != 200:
            await response.aread()
            outcome.problem = f"{response.status_code} {response.text[:200]!r}"
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            payload = json.loads(line[len("data: "):])
            if "error" in payload:
                outcome.problem = f"error in the stream: {payload['error']}"
                return
            if payload.get("usage"):
                outcome.generated_tokens = payload["usage"]["completion_tokens"]
            for choice in payload["choices"]:
                text = choice.get("text") or choice.get("delta", {}).get("content")
                final = final or choice["finish_reason"] is not None
                if text:
                    chunks += 1
                    outcome.ttft_s = outcome.ttft_s or time.perf_counter() - start
            if planned.mode == "disconnect" and chunks >= planned.disconnect_after:
                outcome.ended_before_disconnect = final
                return  # leaving the block closes the connection mid-stream
    if planned.mode == "disconnect":
        outcome.ended_before_disconnect = True
    elif not (done and final):
        outcome.problem = "the stream ended without a final chunk and [DONE]"


def url_of(planned: Planned) -> str:
    return "/v1/chat/completions" if planned.endpoint == "chat" else "/v1/completions"


async def run_one(client: httpx.AsyncClient, planned: Planned, rows: dict, model: str, max_tokens: int) -> Outcome:
    outcome, start = Outcome(planned), time.perf_counter()
    try:
        if planned.mode == "bad":
            await send_bad(client, planned, model, outcome)
        elif planned.mode == "whole":
            await send_whole(client, good_body(planned, rows[planned.prompt_id], model, max_tokens), planned, outcome)
        else:
            await send_stream(client, good_body(planned, rows[planned.prompt_id], model, max_tokens), planned,
                              outcome, start)
    # A timeout, a dropped connection, an answer that is not JSON or not in OpenAI's shape: a problem, not a crash.
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as error:
        outcome.problem = f"{type(error).__name__}: {error}"
    outcome.latency_s = time.perf_counter() - start
    return outcome


def read_metrics(text: str) -> dict:
    """The counters and gauges the checks read, from Prometheus text."""
    out = {"finished": 0.0, "cancelled": 0.0, "failed": 0.0, "http_5xx": 0.0, "kv_blocks_in_use": None}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name == "playground_requests_total" and labels.get("source") == "api":
                out[labels["outcome"]] = out.get(labels["outcome"], 0.0) + sample.value
            elif sample.name == "playground_http_requests_total" and labels.get("status", "").startswith("5"):
                out["http_5xx"] += sample.value
            elif sample.name == "playground_kv_blocks_in_use":
                out["kv_blocks_in_use"] = sample.value
    return out


async def settle(client: httpx.AsyncClient, before: dict, ended: int, pool, settle_s: float) -> tuple[dict, dict]:
    """Poll /metrics (up to `settle_s`) until `ended` more API requests have ended and no KV block is held; the
    counters' differences from `before`, and the final gauges."""
    deadline = time.monotonic() + settle_s
    while True:
        now = read_metrics((await client.get("/metrics")).text)
        delta = {name: now[name] - before[name] for name in ("finished", "cancelled", "failed", "http_5xx")}
        in_pool = await asyncio.to_thread(lambda: pool.loop.call(
            lambda: (pool.blocks_in_use(), pool.active_requests()))) if pool is not None else (0, 0)
        settled = delta["finished"] + delta["cancelled"] + delta["failed"] >= ended and now["kv_blocks_in_use"] == 0 \
            and in_pool == (0, 0)
        if settled or time.monotonic() > deadline:
            return delta, {"kv_blocks_in_use": now["kv_blocks_in_use"], "pool_blocks_in_use": in_pool[0],
                           "pool_active_requests": in_pool[1], "in_process": pool is not None}
        await asyncio.sleep(0.1)


async def run_load(url: str, requests: int = 200, clients: int = 16, disconnect_fraction: float = 0.2,
                   bad_fraction: float = 0.1, max_tokens: int = 16, seed: int = 0, timeout_s: float = 120.0,
                   settle_s: float = 5.0, pool=None) -> dict:
    """Run the plan against `url` and return the report: per-request outcomes, summary numbers and checks. `pool`:
    the in-process server's EnginePool, whose own KV accounting is then checked too."""
    rows = {row["id"]: row for row in load_prompts()}
    plan = make_plan(requests, disconnect_fraction, bad_fraction, sorted(rows), seed)
    limits = httpx.Limits(max_connections=clients + 2, max_keepalive_connections=clients + 2)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        before = read_metrics((await client.get("/metrics")).text)
        pending, outcomes = iter(plan), []

        async def worker() -> None:
            for planned in pending:  # one iterator shared by every worker: each request is sent once
                outcomes.append(await run_one(client, planned, rows, model, max_tokens))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        wall_s = time.perf_counter() - start
        good = [o for o in outcomes if o.planned.mode in ("whole", "stream")]
        dropped = [o for o in outcomes if o.planned.mode == "disconnect"]
        delta, gauges = await settle(client, before, len(good) + len(dropped), pool, settle_s)
    outcomes.sort(key=lambda o: o.planned.index)
    return summarize(outcomes, good, dropped, delta, gauges, wall_s, model,
                     {"url": url, "requests": requests, "clients": clients, "disconnect_fraction": disconnect_fraction,
                      "bad_fraction": bad_fraction, "max_tokens": max_tokens, "seed": seed, "timeout_s": timeout_s})


def _ms(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1e3, 1) if values else None


def summarize(outcomes, good, dropped, delta, gauges, wall_s, model, arguments) -> dict:
    bad = [o for o in outcomes if o.planned.mode == "bad"]
    late = len(dropped) - delta["cancelled"]  # dropped requests the server had finished before it saw the drop
    dropped_problems = [o for o in dropped if o.problem]
    checks = {
        "no 5xx (clients)": all((o.status or 0) < 500 for o in outcomes),
        "no 5xx (server's count)": delta["http_5xx"] == 0,
        "every good request a complete 200 (dropped: a 200 stream)": not any(o.problem for o in good)
        and not dropped_problems,
        "every bad body a 400 naming the problem": not any(o.problem for o in bad),
        "every dropped stream ended on the server": delta["cancelled"] <= len(dropped)
        and delta["finished"] + delta["cancelled"] == len(good) + len(dropped) and delta["failed"] == 0,
        "no KV block held at the end": gauges["kv_blocks_in_use"] == 0 and gauges["pool_blocks_in_use"] == 0
        and gauges["pool_active_requests"] == 0,
    }
    tokens = sum(o.generated_tokens for o in good)
    summary = {"wall_s": round(wall_s, 2), "good_requests": len(good), "dropped_streams": len(dropped),
               "bad_bodies": len(bad), "cancelled": int(delta["cancelled"]), "late_disconnects": int(late),
               "ended_before_client_closed": sum(o.ended_before_disconnect for o in dropped),
               "requests_per_s": round(len(good) / wall_s, 2), "generated_tokens": tokens,
               "generated_tokens_per_s": round(tokens / wall_s, 1),
               "latency_ms_p50": _ms([o.latency_s for o in good], 50),
               "latency_ms_p95": _ms([o.latency_s for o in good], 95),
               "ttft_ms_p50": _ms([o.ttft_s for o in good if o.ttft_s is not None], 50),
               "ttft_ms_p95": _ms([o.ttft_s for o in good if o.ttft_s is not None], 95),
               "server_counters": delta, **gauges}
    return {"arguments": arguments, "model": model, "checks": checks, "passed": all(checks.values()),
            "summary": summary, "problems": [f"#{o.planned.index} {o.planned.mode} {o.planned.endpoint}: {o.problem}"
                                             for o in outcomes if o.problem],
            "rows": rows_by_kind(outcomes), "requests": [record(o) for o in outcomes]}


def record(outcome: Outcome) -> dict:
    """One request's plan and outcome as one flat dict (the JSON report's `requests`)."""
    measured = asdict(outcome)
    del measured["planned"]
    return {**asdict(outcome.planned), **measured}


def rows_by_kind(outcomes: list[Outcome]) -> list[dict]:
    """One row per kind of request (endpoint x mode): how many, their status codes, latency and TTFT."""
    groups: dict[tuple[str, str], list[Outcome]] = {}
    for o in outcomes:
        groups.setdefault((o.planned.endpoint, o.planned.mode), []).append(o)
    rows = []
    for (endpoint, mode), group in sorted(groups.items(), key=lambda item: (MODES.index(item[0][1]), item[0][0])):
        statuses = Counter(str(o.status or "no answer") for o in group)
        rows.append({"endpoint": endpoint, "mode": mode, "requests": len(group),
                     "status": " ".join(f"{status}x{n}" for status, n in sorted(statuses.items())),
                     "problems": sum(bool(o.problem) for o in group),
                     "latency_ms_p50": _ms([o.latency_s for o in group], 50),
                     "latency_ms_p95": _ms([o.latency_s for o in group], 95),
                     "ttft_ms_p50": _ms([o.ttft_s for o in group if o.ttft_s is not None], 50),
                     "ttft_ms_p95": _ms([o.ttft_s for o in group if o.ttft_s is not None], 95),
                     "generated_tokens": sum(o.generated_tokens for o in group)})
    return rows


def start_in_process(loaded, clients: int, max_tokens: int):
    """The API over `loaded` on a free loopback port (no page): the server (`.url`, `.stop()`) and its pool. The
    queue cap leaves room for every client's request plus dropped ones not yet cancelled."""
    pool = EnginePool(loaded, max_seq_len=512, policy=ServePolicy(max_new_tokens=max_tokens,
                                                                  max_queue=max(64, 4 * clients)))
    with gr.Blocks() as demo:
        gr.Markdown("API load test")
    return serve_in_thread(create_app(demo, pool)), pool


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m server.load_test", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running server (default: serve the bundled model in-process on loopback)")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--disconnect-fraction", type=float, default=0.2)
    parser.add_argument("--bad-fraction", type=float, default=0.1)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    parser.add_argument("--json", dest="json_path", help="write the report here, e.g. docs/bench/api-load.json")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.clients < 1 or args.max_tokens < 1:
        parser.error("--requests, --clients and --max-tokens must be at least 1.")
    server = pool = loaded = None
    if args.url is None:
        loaded = load_model("bundled", "cpu", "float32")
        server, pool = start_in_process(loaded, args.clients, args.max_tokens)
    try:
        report = asyncio.run(run_load(args.url or server.url, args.requests, args.clients, args.disconnect_fraction,
                                      args.bad_fraction, args.max_tokens, args.seed, args.timeout, pool=pool))
    except httpx.HTTPError as error:  # the server could not be reached at all (its /v1/models or /metrics)
        print(f"the load test could not talk to {args.url or server.url}: {type(error).__name__}: {error}")
        return 2
    finally:
        if server is not None:
            server.stop()
    report["machine"] = {**machine_info(torch.device("cpu")), "cpu_count": os.cpu_count(),
                         "served": "in-process" if loaded else f"by {args.url} (this machine is the client's)",
                         "model": loaded.name if loaded else report["model"],
                         "dtype": str(loaded.dtype).removeprefix("torch.") if loaded else None}
    print(pd.DataFrame(report["rows"]).to_string(index=False))
    print(pd.Series({k: v for k, v in report["summary"].items() if not isinstance(v, dict)}).to_string())
    summary = report["summary"]
    if summary["late_disconnects"]:
        print(f"note: {summary['late_disconnects']} of {summary['dropped_streams']} dropped streams had ended on the "
              f"server before it saw the drop ({summary['ended_before_client_closed']} of them before the client "
              "closed): counted as finished, not cancelled")
    for problem in report["problems"]:
        print("problem:", problem)
    for name, passed in report["checks"].items():
        print(f"{'PASS' if passed else 'FAIL'}  {name}")
    write_report(report, args.json_path)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
