"""The Batching tab, a lab: N requests from the benchmark prompts arrive (all at once, or Poisson at R per second,
seeded) at an engine of their own in one batching mode, or in two modes one after the other on the same requests,
and the page shows each request's life, the engine's steps and the KV pool as it runs, then a results table.

`run_batching` is the streaming handler behind Run, a plain generator that can be driven without a browser. It
refuses (saying what to change) a run over MAX_TOTAL_NEW_TOKENS or one the engine could never serve; then, per mode,
it makes a fresh paged `Engine`, listens to its steps (`EngineLoop.on_step`), and a submitter thread hands each
request to the pool's engine loop at its arrival time (so the run shares the device with other visitors like any
other request), then drains the engine. It yields, in `LAB_OUTPUTS` order, the timeline, the activity chart, the
KV pool, the results table, a status line and the Run button's state, at most every PANEL_REFRESH_S and only what
changed. What the panels show is built in `ui.batching_view` from the engine's `StepReport`s.

The prefix cache is off in the lab's engines: a repeated prompt would otherwise be a cache hit in one mode and not
in another (requests that run at once cannot share blocks not yet written), and the comparison is about batching.
Stop (`ui.control`) and the device-time limit end every request after its step in flight and skip the second mode;
closing the generator (a closed tab) cancels every request. Either way the engine's blocks go back.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from dataclasses import dataclass
from functools import partial

import gradio as gr

from inference_core import ConfigError, Engine, EngineConfig, SamplingParams, TokenEvent
from inference_core.bench.latency import LatencyTargets
from inference_core.bench.prompts import load_prompts
from inference_core.engine.compiled import compile_unavailable
from serving.cost import duration
from serving.pool import EnginePool
from serving.zero_gpu import gpu_task
from ui.batching_view import (RESULT_COLUMNS, RESULT_NOTES, Arrival, RunRecord, StepRecord, activity_figure,
                              compiled_words, mode_name, results_frame, timeline_figure, verdict)
from ui.control import RunControl
from ui.kv_view import render_pool
from ui.profile_view import build_profile_panel, profile_lab
from ui.race import PANEL_REFRESH_S
from ui.roofline_view import build_lab_roofline_panel
from ui.words import PAGE_WORDS, widget_number

LAB_OUTPUTS = ("timeline", "chart", "pool", "results", "status", "run_button")
MAX_REQUESTS = 32
MAX_TOTAL_NEW_TOKENS = 4096  # new tokens one run may ask for (both modes of a race together): a shared CPU
MAX_KV_POOL_MIB = 256  # KV memory one run's engine may set aside
STOP_GRACE_S = 10.0  # after Stop, requests not ended by then are cancelled
LAB_WORDS = {**PAGE_WORDS, "kv_cache_tokens": "'KV pool (tokens)'"}
MODES = {"continuous": "continuous", "dynamic": "dynamic", "static": "static", "none (one at a time)": "none",
         "race: continuous vs static": "continuous,static", "race: continuous vs dynamic": "continuous,dynamic",
         "race: continuous vs none": "continuous,none", "race: dynamic vs static": "dynamic,static"}
MODE_ABOUT = {"continuous": "requests join the running batch at any step and leave it the step they finish",
              "dynamic": "a batch forms once the previous one has finished, when max_num_seqs wait or the oldest "
                         f"has waited {EngineConfig().batch_window_ms:g} ms, and runs to completion",
              "static": "fixed, padded batches of max_num_seqs in arrival order: a batch starts when full and the "
                        "previous one has finished, every prompt is computed as long as the batch's longest, and "
                        "every member's row runs until the longest answer ends",
              "none": "one request at a time, in arrival order"}
ARRIVALS = {"all at once (burst)": "burst", "Poisson arrivals": "poisson"}
LENGTHS = {"varied (1/8 to all of max new tokens, seeded)": "varied", "max new tokens for every request": "same"}
TYPED = "your prompts (one per line, in the settings)"
# The results table's column widths in pixels, one per RESULT_COLUMNS, with no header broken inside a word (the two
# long words get more). At 1440 px the table has 1214 px: since TPOT, goodput and 'SLO met' joined, its 16 columns
# (1468 px) scroll sideways there, with the mode pinned and the last two columns (padding, device time) beyond the
# edge, as on a phone. (Widths in % of the table squeezed each column to 25 px on a phone, headers letter by letter.)
WIDE_RESULT_COLUMNS = {"mode": 100, "throughput (tok/s)": 112, "preemptions": 112}  # px; the others 88 px
RESULT_WIDTHS = [f"{WIDE_RESULT_COLUMNS.get(column, 88)}px" for column in RESULT_COLUMNS]
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LabPreset:
    prompt_ids: tuple[str, ...]  # benchmark prompt ids, repeated in turn up to N requests
    num_requests: int
    max_new_tokens: int
    kv_pool_tokens: int  # 0: room for every request at once
    arrival: str  # "burst" | "poisson"
    lengths: str  # "varied" | "same"


LAB_PRESETS = {
    "8 mixed chat/code prompts": LabPreset(("chat-short-1", "code-1", "chat-med-1", "code-2", "chat-short-2",
                                            "code-3", "chat-med-2", "chat-short-3"), 8, 32, 0, "poisson", "varied"),
    "16 short chats": LabPreset(("chat-short-1", "chat-short-2", "chat-short-3", "chat-short-4", "chat-med-1",
                                 "chat-med-2", "chat-med-3", "chat-med-4"), 16, 16, 0, "poisson", "varied"),
    # Each grounded prompt fills 10 blocks of 16: three fill the pool's 30, and the first that needs an 11th block
    # (grounded-2, after 12 new tokens) preempts the latest admitted. Measured on the bundled model: 3 preemptions in
    # continuous mode, 2 in static (max_num_seqs 4 or 8).
    "small KV pool: 8 long prompts at once, forces preemption": LabPreset(
        ("grounded-1", "grounded-2", "grounded-3", "grounded-4"), 8, 16, 480, "burst", "same"),
    TYPED: LabPreset((), 4, 32, 0, "burst", "varied"),
}


@dataclass(frozen=True)
class LabPlan:
    """One run, checked: the modes in order, each request's (label, prompt ids), arrival offset and sampling
    settings (greedy; its own max new tokens), and the engine's limits."""

    modes: tuple[str, ...]
    prompts: tuple[tuple[str, tuple[int, ...]], ...]
    offsets: tuple[float, ...]
    params: tuple[SamplingParams, ...]
    max_num_seqs: int
    kv_cache_tokens: int
    about: str  # the settings in words
    targets: LatencyTargets = LatencyTargets()  # the latency targets goodput counts (none: no goodput)
    compile: bool = False  # every mode's steps through the compiled step (`inference_core.engine.compiled`)

    def config(self, pool: EnginePool, mode: str) -> EngineConfig:
        """The settings of this run's engine in `mode`."""
        return EngineConfig(kv_mode="paged", prefix_cache=False, batching=mode, max_num_seqs=self.max_num_seqs,
                            kv_cache_tokens=self.kv_cache_tokens, max_seq_len=pool.max_seq_len,
                            compile=self.compile)

    def engine(self, pool: EnginePool, mode: str) -> tuple[Engine, list]:
        """A fresh engine in `mode` and this run's requests made (and so checked) by it."""
        engine = Engine(pool.loaded, self.config(pool, mode))
        return engine, [engine.make_request(list(ids), params) for (_, ids), params in zip(self.prompts, self.params)]


@dataclass
class LabMemory:
    """One visitor's last lab run, kept in a `gr.State` for the roofline and the profile: its plan and its modes'
    records (None until a run has started)."""

    plan: LabPlan | None = None
    records: list[RunRecord] | None = None


def arrival_offsets(count: int, arrival: str, rate: float, seed: int) -> list[float]:
    """Seconds after the run's start at which each request arrives: all at 0 (burst), or a Poisson process at `rate`
    per second (exponential gaps from a generator seeded with `seed`), the first request at 0."""
    if arrival == "burst":
        return [0.0] * count
    rng, offsets = random.Random(seed), [0.0]
    while len(offsets) < count:
        offsets.append(offsets[-1] + rng.expovariate(rate))
    return offsets


def output_limits(count: int, max_new_tokens: int, lengths: str, seed: int) -> list[int]:
    """Each request's max new tokens: all `max_new_tokens`, or (varied) drawn uniformly from 1/8 of it to all of it
    by a generator seeded with `seed`, as real requests want answers of different lengths."""
    if lengths == "same":
        return [max_new_tokens] * count
    rng = random.Random(seed)
    return [max(1, round(max_new_tokens * rng.uniform(0.125, 1.0))) for _ in range(count)]


def latency_targets(slo_ttft_ms, slo_tpot_ms) -> LatencyTargets:
    """The two target boxes, checked: empty or 0 is no target (the browser sends an emptied number box as 0); else a
    number of milliseconds from 1 to 10^6."""
    values = [None if value is None or str(value).strip() in ("", "0", "0.0") else
              widget_number(value, name, 1, 10 ** 6, whole=False)
              for value, name in ((slo_ttft_ms, "TTFT target (ms)"), (slo_tpot_ms, "TPOT target (ms)"))]
    return LatencyTargets(*values)


def plan_run(pool: EnginePool, preset: str, mode: str, num_requests, max_new_tokens, lengths: str, max_num_seqs,
             kv_pool_tokens, arrival: str, rate, seed, typed_prompts: str = "", slo_ttft_ms=None,
             slo_tpot_ms=None, compiled: bool = False) -> LabPlan:
    """Check the settings (ConfigError, in the page's words, for one to change) and tokenize the prompts."""
    if compiled and (reason := compile_unavailable(pool.loaded.device)) is not None:
        raise ConfigError(f"compiled steps are not available on this device ({reason}); untick 'compiled'.")
    if preset not in LAB_PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; pick one from the list.")
    if mode not in MODES:
        raise ConfigError(f"unknown batching mode {mode!r}; pick one from the list.")
    modes = tuple(MODES[mode].split(","))
    count = widget_number(num_requests, "requests", 1, MAX_REQUESTS)
    new_tokens = widget_number(max_new_tokens, "max new tokens", 1, pool.max_seq_len)
    seqs = widget_number(max_num_seqs, "max sequences per step", 1, 256)
    pool_tokens = widget_number(kv_pool_tokens, "KV pool (tokens)", 0, 10 ** 7)
    arrival = ARRIVALS.get(arrival, arrival)
    if arrival not in ARRIVALS.values():
        raise ConfigError(f"unknown arrival pattern {arrival!r}; pick one from the list.")
    rate = widget_number(rate, "Poisson rate (requests/s)", 0.01, 100, whole=False) if arrival == "poisson" else 1.0
    seed = widget_number(seed, "seed", 0, 2 ** 31)
    targets = latency_targets(slo_ttft_ms, slo_tpot_ms)
    lengths = LENGTHS.get(lengths, lengths)
    if lengths not in LENGTHS.values():
        raise ConfigError(f"unknown output lengths {lengths!r}; pick one from the list.")
    total = count * new_tokens * len(modes)
    if total > MAX_TOTAL_NEW_TOKENS:
        race = " x 2 modes" if len(modes) > 1 else ""
        raise ConfigError(f"this run asks for {total} new tokens ({count} requests x {new_tokens}{race}), over this "
                          f"tab's limit of {MAX_TOTAL_NEW_TOKENS} on a shared CPU; lower 'requests' or 'max new "
                          f"tokens'" + (" or run one mode." if race else "."))
    if preset == TYPED:
        texts = [("typed", line.strip(), None) for line in (typed_prompts or "").splitlines() if line.strip()]
        if not texts:
            raise ConfigError("no prompts typed: write one prompt per line in the settings, or pick a preset.")
    else:
        rows = {row["id"]: row for row in load_prompts()}
        texts = [(i, rows[i]["prompt"], rows[i].get("system")) for i in LAB_PRESETS[preset].prompt_ids]
    tokenizer = pool.loaded.tokenizer
    prompts = []
    for index in range(count):
        name, text, system = texts[index % len(texts)]
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        prompts.append((f"#{index + 1} {name}", tuple(tokenizer.encode_chat(messages))))
    block_size = EngineConfig().block_size
    bytes_per_token = pool.loaded.config.kv_bytes_per_token(pool.loaded.dtype)
    most = MAX_KV_POOL_MIB * 2 ** 20 // bytes_per_token // block_size * block_size
    if pool_tokens > most:
        raise ConfigError(f"a KV pool of {pool_tokens} tokens would take {pool_tokens * bytes_per_token / 2 ** 20:.0f}"
                          f" MiB; this tab allows {most} tokens ({MAX_KV_POOL_MIB} MiB). Lower 'KV pool (tokens)'.")
    limits = output_limits(count, new_tokens, lengths, seed)
    room = sum(-(-(len(ids) + limit - 1) // block_size) * block_size for (_, ids), limit in zip(prompts, limits))
    kv_tokens = pool_tokens or min(room, most)
    arrivals = "all at once" if arrival == "burst" else f"Poisson arrivals at {rate:g}/s (seed {seed})"
    pool_words = (f"a KV pool of {kv_tokens} tokens" + (" (room for every request at once)" if not pool_tokens
                                                        and kv_tokens == room else ""))
    length_words = (f"{new_tokens} new tokens each" if lengths == "same"
                    else f"{min(limits)} to {max(limits)} new tokens")
    about = (f"{count} requests of up to {length_words} (greedy), {arrivals}, at most {seqs} sequences per step, "
             f"{pool_words}" + (", every step compiled" if compiled else "")
             + (f"; goodput counts {targets.describe()}" if targets.given else ""))
    return LabPlan(modes, tuple(prompts), tuple(arrival_offsets(count, arrival, rate, seed)),
                   tuple(SamplingParams(max_new_tokens=limit) for limit in limits), seqs, kv_tokens, about, targets,
                   bool(compiled))


class StepTokenSink(queue.Queue):
    """The run's shared event queue. In the loop thread, as the engine delivers each event of a step, it counts the
    step's tokens and notes whose first token each is; the step listener takes the counts when the step ends."""

    def __init__(self):
        super().__init__()
        self._tokens, self._first_tokens, self._by_request = 0, [], {}

    def put(self, item, block=True, timeout=None):
        handle, event = item
        if isinstance(event, TokenEvent):
            self._tokens += 1
            self._by_request[handle.request_id] = self._by_request.get(handle.request_id, 0) + 1
            if event.index == 0:
                self._first_tokens.append(handle.request_id)
        super().put(item, block, timeout)

    def take_step(self) -> tuple[int, tuple[int, ...], tuple[tuple[int, int], ...]]:
        """The step's tokens, whose first token each was, and (request id, tokens) per request."""
        counts = self._tokens, tuple(self._first_tokens), tuple(self._by_request.items())
        self._tokens, self._first_tokens, self._by_request = 0, [], {}
        return counts


class Submitter(threading.Thread):
    """Hands each request to the engine loop at its arrival time, then drains the engine (a static batch that is not
    full may start). Requests due at once (a burst, or Poisson arrivals the thread is late for) are queued in one
    loop command, between two steps, so they meet the scheduler together. `halt()` submits nothing more and returns
    the handles submitted so far."""

    def __init__(self, pool: EnginePool, engine: Engine, requests: list, plan: LabPlan, sink, record: RunRecord):
        super().__init__(name="batching-submitter", daemon=True)
        self.pool, self.engine, self.requests, self.plan, self.sink, self.record = (pool, engine, requests, plan,
                                                                                    sink, record)
        self.handles, self.error, self.finished = [], None, False
        self._halted, self._lock = threading.Event(), threading.Lock()

    def run(self) -> None:
        loop, due_at = self.pool.loop, [self.record.started_at + offset for offset in self.plan.offsets]
        try:
            index = 0
            while index < len(self.requests):
                if self._halted.wait(max(0.0, due_at[index] - time.perf_counter())):
                    return
                now = time.perf_counter()
                group = [i for i in range(index, len(self.requests)) if due_at[i] <= now]
                index = group[-1] + 1
                with self._lock:
                    if self._halted.is_set():
                        return
                    self.record.arrivals.extend(Arrival(self.requests[i].request_id, self.plan.prompts[i][0], now)
                                                for i in group)
                    self.handles.extend(loop.call(self._enqueue, group, index == len(self.requests)))
        except Exception as error:  # the handler raises it
            self.error = error
        finally:
            try:
                loop.drain(self.engine)
            finally:
                self.finished = True

    def _enqueue(self, group: list[int], last: bool) -> list:  # in the loop thread
        handles = [self.pool.loop.enqueue(self.engine, self.requests[i], tag=self.plan.prompts[i][0], sink=self.sink)
                   for i in group]
        if last:
            self.pool.loop.drain(self.engine)
        return handles

    def halt(self) -> list:
        self._halted.set()
        with self._lock:
            return list(self.handles)


def _frame(**values) -> tuple:
    """One update in LAB_OUTPUTS order; outputs not named are left as they are."""
    return tuple(values.get(name, gr.skip()) for name in LAB_OUTPUTS)


def _device_s(records: list[RunRecord]) -> float:
    return sum(step.report.duration_ms for record in records for step in list(record.steps)) / 1e3


def run_batching(pool: EnginePool, control: RunControl | None, preset: str, mode: str, num_requests,
                 max_new_tokens, lengths: str, max_num_seqs, kv_pool_tokens, arrival: str, rate, seed,
                 typed_prompts: str = "", slo_ttft_ms=None, slo_tpot_ms=None, memory: LabMemory | None = None,
                 compiled: bool = False):
    """Streaming handler; `control`: the visitor's Stop switch (None: no Stop); the latency targets in ms (None or
    empty: none); `memory`: where the visitor's last run is kept (its plan and records); `compiled`: every mode's
    steps compiled. Yields LAB_OUTPUTS tuples."""
    control = control if control is not None else RunControl()
    try:
        yield from _lab(pool, control, (preset, mode, num_requests, max_new_tokens, lengths, max_num_seqs,
                                        kv_pool_tokens, arrival, rate, seed, typed_prompts, slo_ttft_ms, slo_tpot_ms,
                                        compiled),
                        memory if memory is not None else LabMemory())
    finally:
        control.end()


def _lab(pool: EnginePool, control: RunControl, settings: tuple, memory: LabMemory):
    idle = gr.update(interactive=True)
    if control.stop_requested:  # Stop was pressed while the run waited in the queue
        yield _frame(status="Stopped before the run started: nothing ran.", run_button=idle)
        return
    try:
        plan = plan_run(pool, *settings)
        engine, requests = plan.engine(pool, plan.modes[0])
    except ConfigError as error:
        yield _frame(status=f"**Cannot start the run:** {error.in_words(LAB_WORDS)}", run_button=idle)
        return
    except (ValueError, TypeError) as error:
        yield _frame(status=f"**Cannot start the run:** {error}", run_button=idle)
        return
    records: list[RunRecord] = []
    memory.plan, memory.records = plan, records
    pools: dict[str, str] = {}  # mode -> its pool picture at its fullest, once the mode has run
    yield _frame(timeline=timeline_figure([], 0.0), chart=activity_figure([]), pool="",
                 results=results_frame([], 0.0), status=f"Starting: {plan.about}.",
                 run_button=gr.update(interactive=False))
    pool.settle_before_timed_work()
    try:
        for index, mode in enumerate(plan.modes):
            if index:
                engine, requests = plan.engine(pool, mode)
            if engine.decoder is not None:
                yield _frame(status=f"Readying {mode_name(mode)}'s compiled steps (batch sizes "
                                    f"{', '.join(map(str, engine.decoder.buckets))}, and prompts): loaded from disk "
                                    f"where this host built them before, else compiled now, about a minute each. "
                                    f"This time is not in the figures.")
                ready_s = pool.loop.call(engine.warm_up_compiled, tuple(engine.decoder.buckets))
                log.info("batching lab: %s's compiled steps ready in %.1f s", mode, ready_s)
                if control.stop_requested:
                    break
            record = RunRecord(mode, plan.max_num_seqs, engine.config.num_kv_blocks(pool.loaded.config), 0.0,
                               targets=plan.targets)
            records.append(record)
            yield from _run_mode(pool, control, plan, engine, requests, records, pools)
            if control.stop_requested or _device_s(records) > pool.max_run_s:
                break
    except Exception as error:  # the page gets a message, the log the traceback
        log.exception("batching run failed")
        yield _frame(status=f"**The run failed:** {type(error).__name__}: {error}", run_button=idle)
        return
    now = time.perf_counter()
    if control.stop_requested:
        done = "Stopped: every request ended after its step in flight and returned its blocks."
    elif _device_s(records) > pool.max_run_s:
        done = (f"Stopped at this app's limit of {duration(pool.max_run_s)} of device time per run; lower "
                "'requests' or 'max new tokens' to finish within it.")
    else:
        done = "Finished."
    yield _frame(timeline=timeline_figure(records, now), chart=activity_figure(records), pool="".join(pools.values()),
                 results=results_frame(records, now),
                 status=" ".join(filter(None, (done, verdict(records, now), compiled_words(records)))),
                 run_button=idle)


def _run_mode(pool: EnginePool, control: RunControl, plan: LabPlan, engine: Engine, requests: list,
              records: list[RunRecord], pools: dict[str, str]):
    """Run one mode's requests to the end (or Stop), yielding the changed panels at most every PANEL_REFRESH_S."""
    record = records[-1]
    labels = {request.seq.seq_id: label for request, (label, _) in zip(requests, plan.prompts)}
    # The listener reaches the engine through `pictures`, which lets go of it at the end: the loop thread keeps the
    # last listener it called, and with it whatever the listener holds, until it steps another engine with one.
    sink, pictures = StepTokenSink(), {"engine": engine, "peak": None, "live": None, "live_at": 0.0}

    def on_step(report) -> None:  # in the loop thread, between steps: the engine may be read
        tokens, first_tokens, request_tokens = sink.take_step()
        record.steps.append(StepRecord(report, tokens, first_tokens, request_tokens))
        peak = pictures["peak"]
        if peak is None or report.blocks_in_use > peak[0].blocks_in_use:
            pictures["peak"] = (report, pictures["engine"].kv_snapshot())
        if report.started_at - pictures["live_at"] >= PANEL_REFRESH_S:
            pictures["live"], pictures["live_at"] = (report, pictures["engine"].kv_snapshot()), report.started_at

    def pool_html(which: str, title: str) -> str:
        report, snapshot = pictures[which]
        return render_pool(snapshot, engine.tokenizer.decode, f"{title}, step {report.index}: "
                           f"{report.blocks_in_use} of {record.num_blocks} blocks in use", labels)

    unsubscribe = pool.loop.on_step(engine, on_step)
    record.started_at = time.perf_counter()
    submitter = Submitter(pool, engine, requests, plan, sink, record)
    submitter.start()
    sent, stop_at, last_panels = {}, None, time.perf_counter()
    step_of = f", mode {len(records)} of {len(plan.modes)}" if len(plan.modes) > 1 else ""
    try:
        while not (submitter.finished and all(handle.done for handle in submitter.handles)):
            if submitter.error is not None:
                raise submitter.error
            now = time.perf_counter()
            if stop_at is None and (control.stop_requested or _device_s(records) > pool.max_run_s):
                stop_at = now
                for handle in submitter.halt():
                    handle.stop()
            if stop_at is not None and now - stop_at > STOP_GRACE_S:
                break
            try:
                handle, event = sink.get(timeout=0.05)
                handle.received(event)  # raises the error of a failed step
            except queue.Empty:
                pass
            if now - last_panels < PANEL_REFRESH_S:
                continue
            last_panels = now
            last = record.steps[-1].report if record.steps else None
            state = (f"step {last.index}: {last.num_running} running, {last.num_waiting} waiting, "
                     f"{last.blocks_in_use} of {record.num_blocks} KV blocks in use" if last else "no step yet")
            frame = {"status": f"Running {mode_name(record.mode)}{step_of} ({MODE_ABOUT[record.mode]}): "
                               f"{len(record.arrivals)} of {len(plan.prompts)} requests arrived; {state}; device "
                               f"time {_device_s(records):.1f} s of at most {duration(pool.max_run_s)}.",
                     "steps": (len(record.steps), len(record.arrivals))}
            if pictures["live"] is not None:
                frame["pool"] = "".join(pools.values()) + pool_html("live", f"{record.mode} pool (live)")
            changed = {name: value for name, value in frame.items() if sent.get(name) != value}
            sent.update(changed)
            if changed.pop("steps", None) is not None:
                changed.update(timeline=timeline_figure(records, now), chart=activity_figure(records),
                               results=results_frame(records, now))
            if changed:
                yield _frame(**changed)
    finally:
        for handle in submitter.halt():
            handle.cancel()  # nothing to do for a request that has ended
        submitter.join()
        unsubscribe()
        held = pool.loop.call(engine.blocks_in_use)  # the loop forgets an engine once it is idle
        if engine.decoder is not None:
            record.compile_stats = pool.loop.call(engine.decoder.stats.as_dict)
        pictures.pop("engine")
        record.ended = True
    picture = pool_html("peak", f"{record.mode} pool at its fullest") if pictures["peak"] is not None else ""
    pools[record.mode] = picture + (f"<p>After the {record.mode} run: {held} blocks held"
                                    + (" (every request returned its blocks).</p>" if not held else ".</p>"))


def arm_batching(control: RunControl):
    """Run, before the run is queued: arm the visitor's Stop and disable Run at once."""
    control.arm()
    return "Waiting for the device...", gr.update(interactive=False)


def stop_batching(control: RunControl) -> None:
    control.request_stop()


def settings_summary(num_requests, max_new_tokens, lengths, max_num_seqs, kv_pool_tokens, arrival, rate,
                     seed, compiled=False) -> str:
    """The folded settings' one-line label, in the widgets' order."""
    try:
        pattern = ("all at once" if ARRIVALS.get(arrival, arrival) == "burst"
                   else f"Poisson {float(rate):g}/s")
        varied = LENGTHS.get(lengths, lengths) == "varied"
        kv = "room for all" if not kv_pool_tokens else f"{int(kv_pool_tokens)} tokens"
        return (f"Settings: {int(num_requests)} requests x {'up to ' if varied else ''}{int(max_new_tokens)} new "
                f"tokens{' (varied)' if varied else ''}, {pattern}, seed {int(seed)}, max {int(max_num_seqs)} "
                f"sequences per step, KV pool {kv}" + (", compiled" if compiled else ""))
    except (TypeError, ValueError):  # a half-typed value
        return "Settings"


def preset_values(name: str) -> tuple:
    """A preset's widget values: requests, max new tokens, output lengths, KV pool tokens, arrivals (as the radios
    show them)."""
    preset = LAB_PRESETS[name]
    label = {value: label for label, value in {**ARRIVALS, **LENGTHS}.items()}
    return (preset.num_requests, preset.max_new_tokens, label[preset.lengths], preset.kv_pool_tokens,
            label[preset.arrival])


def _apply_preset(name: str, max_num_seqs, rate, seed, compiled=False) -> tuple:
    """A preset's widget values and the settings' summary (unfolded for typed prompts, whose box is inside)."""
    requests, new_tokens, lengths, kv_tokens, arrival = preset_values(name)
    label = settings_summary(requests, new_tokens, lengths, max_num_seqs, kv_tokens, arrival, rate, seed, compiled)
    return (requests, new_tokens, lengths, kv_tokens, arrival,
            gr.update(label=label, open=True) if name == TYPED else gr.update(label=label))


def build_batching_tab(pool: EnginePool) -> None:
    """The first screen (1440x900) holds the preset, the mode, Run and Stop, the folded settings' one-line summary,
    the status and the timeline; the results table, the activity chart and the KV pool follow."""
    control, memory = gr.State(RunControl()), gr.State(LabMemory())
    first = next(iter(LAB_PRESETS))
    requests, new_tokens, lengths_label, kv_tokens, arrival_label = preset_values(first)
    with gr.Row(equal_height=True):
        preset = gr.Dropdown(list(LAB_PRESETS), value=first, label="Requests (from the benchmark prompts)",
                             elem_id="batching-preset", scale=3)
        mode = gr.Dropdown(list(MODES), value="race: continuous vs static", label="Batching mode",
                           elem_id="batching-mode", scale=2)
        with gr.Column(scale=1, min_width=140):
            run = gr.Button("Run", variant="primary", elem_id="batching-run")
            stop = gr.Button("Stop", variant="stop", elem_id="batching-stop")
    summary = settings_summary(requests, new_tokens, lengths_label, 4, kv_tokens, arrival_label, 4.0, 0)
    with gr.Accordion(summary, open=False, elem_id="batching-settings") as fold:
        with gr.Row():
            num_requests = gr.Slider(1, MAX_REQUESTS, value=requests, step=1, label="requests (N)",
                                     elem_id="batching-num-requests")
            max_new_tokens = gr.Slider(4, 256, value=new_tokens, step=4, label="max new tokens per request",
                                       elem_id="batching-max-new-tokens")
            lengths = gr.Radio(list(LENGTHS), value=lengths_label, label="output lengths", elem_id="batching-lengths")
        with gr.Row():
            max_num_seqs = gr.Slider(1, MAX_REQUESTS, value=4, step=1, label="max sequences per step (max_num_seqs)",
                                     elem_id="batching-max-num-seqs")
            kv_pool = gr.Number(kv_tokens, precision=0, minimum=0, label="KV pool (tokens; 0 = room for all)",
                                elem_id="batching-kv-pool")
            arrival = gr.Radio(list(ARRIVALS), value=arrival_label, label="arrivals", elem_id="batching-arrival")
            rate = gr.Slider(0.5, 20, value=4.0, step=0.5, label="Poisson rate (requests/s)", elem_id="batching-rate")
            seed = gr.Number(0, precision=0, minimum=0, label="seed (arrivals, lengths)", elem_id="batching-seed")
            # Shown only where compiled steps run on this device.
            compiled = gr.Checkbox(False, label="compiled (every step)", elem_id="batching-compile",
                                   visible=compile_unavailable(pool.loaded.device) is None,
                                   info="each mode's decode, prompt and mixed steps through the compiled step; "
                                        "its packages are readied before the mode's timed run")
        with gr.Row():
            # No `minimum`: Gradio checks it against the 0 an empty box arrives as, and refuses the whole run.
            slo_ttft = gr.Number(None, label="TTFT target (ms; empty or 0 = none)", elem_id="batching-slo-ttft",
                                 info="goodput counts the requests whose first token came within this")
            slo_tpot = gr.Number(None, label="TPOT target (ms; empty or 0 = none)", elem_id="batching-slo-tpot",
                                 info="and whose later tokens came this often on average: (latency - TTFT) / "
                                      "(tokens - 1)")
        typed = gr.Textbox("", lines=3, label=f"Your prompts, one per line (preset '{TYPED}')",
                           elem_id="batching-prompts")
    status = gr.Markdown(f"Each mode runs on a fresh engine of its own; a run may use up to "
                         f"{duration(pool.max_run_s)} of device time and {MAX_TOTAL_NEW_TOKENS} new tokens.",
                         elem_id="batching-status")
    timeline = gr.Plot(timeline_figure([], 0.0), show_label=False, elem_id="batching-timeline")
    results = gr.DataFrame(results_frame([], 0.0), interactive=False, wrap=True, label="Results per mode",
                           buttons=["copy", "fullscreen"],
                           column_widths=RESULT_WIDTHS, pinned_columns=1, elem_id="batching-results")
    gr.Markdown(f"<small>{RESULT_NOTES}</small>", elem_id="batching-results-notes")
    with gr.Row(equal_height=False):  # side by side on a laptop, one above the other on a phone
        chart = gr.Plot(activity_figure([]), show_label=False, elem_id="batching-chart", min_width=340)
        pool_view = gr.HTML(elem_id="batching-pool", min_width=340)
    private = {"api_visibility": "private", "concurrency_id": "engine"}
    build_lab_roofline_panel(pool, memory, private)
    build_profile_panel("Profile: where a step of each mode goes", "batching", partial(profile_lab, pool), [memory],
                        private)

    quick = {"queue": False, "show_progress": "hidden", "api_visibility": "private"}  # the page's own events
    # The one-line summary follows the person's edits (`input`, not `change`: a preset sets several widgets at once,
    # and their change events would race each other with half-updated values) and the preset's own values.
    widgets = [num_requests, max_new_tokens, lengths, max_num_seqs, kv_pool, arrival, rate, seed, compiled]
    for widget in widgets:
        widget.input(lambda *values: gr.update(label=settings_summary(*values)), widgets, fold, **quick)
    preset.change(_apply_preset, [preset, max_num_seqs, rate, seed, compiled],
                  [num_requests, max_new_tokens, lengths, kv_pool, arrival, fold], **quick)
    outputs = {"timeline": timeline, "chart": chart, "pool": pool_view, "results": results, "status": status,
               "run_button": run}
    # The same concurrency group as the playground's other generations: they only hand requests to the engine loop.
    run.click(arm_batching, control, [status, run], **quick).then(
        gpu_task(pool, partial(run_batching, pool)),
        [control, preset, mode, num_requests, max_new_tokens, lengths, max_num_seqs, kv_pool, arrival, rate, seed,
         typed, slo_ttft, slo_tpot, memory, compiled],
        [outputs[name] for name in LAB_OUTPUTS], show_progress="hidden", concurrency_limit=8,
        concurrency_id="engine", api_visibility="private")
    stop.click(stop_batching, control, None, **quick)
