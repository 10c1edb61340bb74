"""The soak's run: `python app.py` in a process of its own on a free loopback port (the server package never imports
the page, so the soak drives the real app from outside, its output into a log the soak reads), its resident memory
(RSS, /proc) sampled every few seconds, and the actors: the browser visitors (`visitors`) and API clients that reuse
`server.load_test`'s requests (whole and streamed, completions and chat, a fraction dropped after 1-3 chunks, a
fraction bad bodies). `soak()` runs every actor alone once (the solo times), then everyone at once until the
deadline, waits for the server to settle, and returns what the checks read.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import subprocess
import socket
import sys
import time
from pathlib import Path

import httpx
from playwright.async_api import async_playwright
from prometheus_client.parser import text_string_to_metric_families

from inference_core.bench.prompts import load_prompts
from server.load_test import Planned, make_plan, read_metrics, run_one, settle, summarize
from server.soak.checks import Action
from server.soak.visitors import CHROMIUM, CHROMIUM_ARGS, Clock, chatter, open_visitors, racer

ROOT = Path(__file__).resolve().parents[2]
API_PROMPTS = ("chat-short", "chat-med", "plain")  # short benchmark prompts: an API request takes about a second


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        kib = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return kib / 1024


async def api_client(client: httpx.AsyncClient, name: str, plan, rows: dict, model: str, max_tokens: int,
                     clock: Clock, until: float, actions: list[Action], outcomes: list, phase: str) -> None:
    """`server.load_test`'s requests from the shared `plan` until `until` (or, solo, until the plan ends). A request's
    solo figures are its endpoint's and prompt's; its tokens are the usage the server reported."""
    for planned in plan:
        start = time.time()
        outcome = await run_one(client, planned, rows, model, max_tokens)
        outcomes.append(outcome)
        kind = {"disconnect": "dropped", "bad": "bad"}.get(planned.mode, "finished")
        wait_s = None if outcome.ttft_s is None else round(outcome.ttft_s, 3)
        actions.append(Action(name, "api", phase, f"api {planned.endpoint} {planned.prompt_id}", clock.since(start),
                              wait_s, round(outcome.latency_s, 3), "problem" if outcome.problem else kind,
                              f"{planned.mode} {planned.endpoint} {planned.prompt_id}: {outcome.problem or ''}",
                              outcome.generated_tokens or None))
        if phase == "soak" and time.monotonic() >= until:
            return


async def sample_rss(pid: int, every_s: float, clock: Clock, samples: list, stop: asyncio.Event) -> None:
    while not stop.is_set():
        samples.append((clock.since(time.time()), rss_mib(pid)))
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except asyncio.TimeoutError:
            pass


def live_metrics(text: str) -> dict:
    """The gauges and page counters the end checks read from /metrics."""
    out = {"kv_blocks_in_use": None, "running_requests": None, "queue_length": None, "page_finished": 0.0,
           "page_cancelled": 0.0, "page_failed": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removeprefix("playground_")
            if name in ("kv_blocks_in_use", "running_requests", "queue_length"):
                out[name] = sample.value
            elif sample.name == "playground_requests_total" and sample.labels.get("source") == "page":
                out[f"page_{sample.labels['outcome']}"] += sample.value
    return out


async def wait_idle(client: httpx.AsyncClient, settle_s: float) -> dict:
    """/metrics until no KV block is held and nothing queued or running (up to `settle_s`)."""
    deadline = time.monotonic() + settle_s
    while True:
        live = live_metrics((await client.get("/metrics")).text)
        if (live["kv_blocks_in_use"], live["running_requests"], live["queue_length"]) == (0, 0, 0) \
                or time.monotonic() > deadline:
            return live
        await asyncio.sleep(0.2)


async def soak(args, url: str, pid: int | None, clock: Clock) -> dict:
    """1. open the visitors; 2. every actor alone once (solo times); 3. everyone at once until the deadline;
    4. wait for the server to settle and read what the checks need."""
    rows = {row["id"]: row for row in load_prompts()}
    api_ids = sorted(prompt_id for prompt_id in rows if prompt_id.startswith(API_PROMPTS))
    actions, outcomes, samples, stop = [], [], [], asyncio.Event()
    limits = httpx.Limits(max_connections=args.api_clients + 4, max_keepalive_connections=args.api_clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout, limits=limits) as client, \
            async_playwright() as playwright:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        sampler = asyncio.create_task(sample_rss(pid, args.rss_every, clock, samples, stop)) if pid else None
        browser = await playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        racers, chatters = await open_visitors(browser, url, args)
        # 2. Alone: each racer's race, each chatter's conversation, a streamed request per API prompt and endpoint.
        solo_start = clock.since(time.time())
        for index, page in enumerate(racers):
            for _ in range(2):
                await racer(page, f"racer-{index + 1}", clock, 0, args.race_max_new_tokens, actions, "solo")
        for index, page in enumerate(chatters):
            await chatter(page, f"chatter-{index + 1}", clock, 0, args.chat_turns, actions, "solo")
        solo_plan = [Planned(i, endpoint, "stream", prompt_id)
                     for i, (prompt_id, endpoint) in enumerate(itertools.product(api_ids, ("completions", "chat")))]
        await api_client(client, "api-solo", iter(solo_plan), rows, model, args.max_tokens, clock, 0, actions, [],
                         "solo")
        await wait_idle(client, args.settle)
        # 3. Everyone at once until the deadline; actions in flight then finish.
        before, live_before = (read_metrics(text := (await client.get("/metrics")).text), live_metrics(text))
        plan = iter(make_plan(20_000, args.disconnect_fraction, args.bad_fraction, api_ids, args.seed))
        soak_start, until = clock.since(time.time()), time.monotonic() + args.minutes * 60
        await asyncio.gather(
            *(racer(page, f"racer-{i + 1}", clock, until, args.race_max_new_tokens, actions, "soak")
              for i, page in enumerate(racers)),
            *(chatter(page, f"chatter-{i + 1}", clock, until, args.chat_turns, actions, "soak")
              for i, page in enumerate(chatters)),
            *(api_client(client, f"api-{i + 1}", plan, rows, model, args.max_tokens, clock, until, actions, outcomes,
                         "soak") for i in range(args.api_clients)))
        soak_end = clock.since(time.time())
        # 4. Settle: every API request ended on the server, no block held, nothing queued or running.
        good = [o for o in outcomes if o.planned.mode in ("whole", "stream")]
        dropped = [o for o in outcomes if o.planned.mode == "disconnect"]
        delta, gauges = await settle(client, before, len(good) + len(dropped), None, args.settle)
        live = await wait_idle(client, args.settle)
        stop.set()
        if sampler:
            await sampler
        await browser.close()
    outcomes.sort(key=lambda o: o.planned.index)
    gauges.update(pool_blocks_in_use=live["kv_blocks_in_use"],
                  pool_active_requests=live["running_requests"] + live["queue_length"])
    api = summarize(outcomes, good, dropped, delta, gauges, soak_end - soak_start, model, {})
    page_ended = {name: live[name] - live_before[name] for name in ("page_finished", "page_cancelled", "page_failed")}
    return {"model": model, "actions": actions, "api": api, "live": live, "page_requests": page_ended,
            "samples": samples, "times": {"solo_start_s": solo_start, "soak_start_s": soak_start,
                                          "soak_end_s": soak_end}}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_app(args, log) -> tuple[subprocess.Popen, str]:
    """`python app.py` on a free loopback port, its output into `log`; returns once /health answers."""
    port = free_port()
    command = [sys.executable, "app.py", "--device", "cpu", "--dtype", args.dtype, "--host", "127.0.0.1", "--port",
               str(port)]
    process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    process.terminate()
    raise RuntimeError(f"app.py did not answer on {url} within 300 s (exit status {process.poll()})")
