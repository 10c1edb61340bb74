"""The one way a request reaches the device: what the race, the chat and the HTTP API each ask for (`Job`), and what
happens before it runs (`admit`, behind `EnginePool.submit`), in this order:

1. each lane's engine from the pool (its slot and settings); 2. every prompt as token ids (text through the chat
template, messages, or ids as given); 3. the new tokens each may generate (asked, or a default capped by the room
left); 4. every request made, which the engine checks (the settings, the context, the KV pool); 5. the deployment's
caps on prompt and output size; 6. the estimated device time against the deployment's limit; 7. the queue cap;
8. each external lane's URL (against the policy) and model; 9. the caller's limits, charged for every token the run
may use.

A `Run` is the admitted work: `compile` a compiled lane's graph, `start` it (requests into the engine loop, external
lanes streamed from their server), then read its events; `events` (or `note`, for a caller reading the sink itself)
keeps the device time and stops the run past the deployment's limit. `close` cancels whatever has not ended (every KV
block goes back) and refunds the caller the tokens that were not used. The front ends keep only streaming and
rendering.
"""

from __future__ import annotations

import math
import queue
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator

from inference_core.engine.engine import Engine
from inference_core.engine.loop import EventHandle, LoopHandle, merge
from inference_core.engine.request import FinishEvent, Request, TokenEvent
from inference_core.settings import LaneSettings
from serving.cost import check_run_cost
from serving.policy import LimitExceeded
from serving.remote import resolve_endpoint, submit_remote

QUEUE_RETRY_STEPS = 32  # a full queue's Retry-After: this many of the busy engines' recent steps


class QueueFull(LimitExceeded):
    """More requests are queued or running than the deployment allows (the API answers 429 with Retry-After)."""


@dataclass(frozen=True)
class Job:
    """What a front end asks to run: every prompt on every lane, `copies` requests of each (the API's `n`; copy i
    samples with seed + i)."""

    what: str  # "race", "turn", "request": how a refusal names the run
    lanes: dict[str, tuple[str, LaneSettings]]  # lane name -> (the pool's slot, its settings)
    prompts: tuple  # each a text, a list of chat messages, or a list of token ids
    system: str | None = None  # the system message of a text prompt
    chat: bool = True  # a text prompt goes through the chat template
    max_new_tokens: int | None = None  # None: `default_new_tokens`, capped by the room left and the deployment
    default_new_tokens: int | None = None  # with max_new_tokens None; None: all the room left
    copies: int = 1
    top_k: int = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    sampling: dict = field(default_factory=dict)  # more SamplingParams fields (penalties, logprobs, constraint, ...)
    caller: str | None = None  # who is charged (a client address); None: the local user
    cache_salt: str | None = None  # whose prefix cache the requests may hit
    keep_final_kv_snapshot: bool = False  # the requests keep a picture of their KV at the last token (the KV view)


@dataclass
class Run:
    """An admitted job: its engines, requests and estimates, then its handles once started."""

    pool: object  # the EnginePool it was admitted to
    job: Job
    engines: dict[str, Engine]  # local lanes only
    requests: dict[str, list[Request]]  # by local lane, in prompt then copy order
    prompt_ids: list[list[int]]  # by prompt
    new_tokens: list[int]  # by prompt: the new tokens each of its requests may generate
    estimates: list[float]  # estimated device seconds per lane, for the first prompt
    endpoints: dict[str, tuple[str, str]]  # external lanes: (URL, model id)
    budget: int  # tokens charged to the caller
    handles: list[EventHandle] = field(default_factory=list)
    _device_s: dict[int, float] = field(default_factory=dict)  # latest device time per local handle
    _used: int = 0  # tokens the finished requests used

    def to_compile(self) -> list[str]:
        """The local lanes whose compiled decode graph is not built yet (`compile` builds it)."""
        return [name for name, engine in self.engines.items()
                if self.pool.needs_compiling(engine, self.job.lanes[name][1].spec())]

    def compile(self, name: str) -> float:
        return self.pool.compile(self.engines[name], self.job.lanes[name][1].spec())

    def start(self, sink=None, first: str | None = None, tag=None) -> list[EventHandle]:
        """Hand every request to the engine loop and start every external lane, lane `first` first; `sink`: the
        queue the handles share (a fresh one by default); `tag`: every handle's tag (default: its lane's name)."""
        sink = sink if sink is not None else queue.Queue()
        for name in sorted(self.job.lanes, key=lambda lane: lane != first):
            if name in self.engines:
                self.handles += [self.pool.loop.enqueue(self.engines[name], request, tag=tag or name, sink=sink)
                                 for request in self.requests[name]]
            else:
                settings = self.job.lanes[name][1]
                self.handles.append(submit_remote(
                    *self.endpoints[name], self.messages(), max_tokens=self.new_tokens[0],
                    temperature=settings.temperature, top_p=settings.top_p, seed=settings.seed, tag=tag or name,
                    sink=sink))
        return self.handles

    def messages(self) -> list[dict]:
        """The first prompt as chat messages, for an external engine."""
        prompt = self.job.prompts[0]
        if not isinstance(prompt, str):
            return list(prompt)
        system = [{"role": "system", "content": self.job.system}] if self.job.system else []
        return system + [{"role": "user", "content": prompt}]

    def note(self, handle: EventHandle, event) -> None:
        """Count an event in: a local request's device time, a finished request's tokens."""
        if isinstance(event, TokenEvent) and isinstance(handle, LoopHandle):
            self._device_s[id(handle)] = event.time_s
        elif isinstance(event, FinishEvent):
            self._used += event.stats.prompt_tokens + event.stats.generated_tokens

    @property
    def device_s(self) -> float:
        """Device time used so far: each local lane's longest request (a lane's requests share its steps), summed
        over lanes (they take turns on the device)."""
        by_lane: dict[str, float] = {}
        for handle in self.handles:
            if id(handle) in self._device_s:
                by_lane[handle.tag] = max(by_lane.get(handle.tag, 0.0), self._device_s[id(handle)])
        return sum(by_lane.values())

    def over_limit(self) -> bool:
        return self.device_s > self.pool.max_run_s

    def stop(self) -> None:
        """End every request after its step in flight, with a final event."""
        for handle in self.handles:
            if not handle.done:
                handle.stop()

    def events(self, should_stop: Callable[[], bool] = lambda: False,
               heartbeat_s: float | None = None) -> Iterator[tuple[EventHandle | None, object]]:
        """(handle, event) as they arrive from a started run until every request has ended; stops every request
        once `should_stop()` is true or the run is over the device-time limit. With `heartbeat_s`, (None, None)
        whenever that long passed without an event. Closing it cancels what has not ended."""
        stream = merge(self.handles, should_stop=lambda: should_stop() or self.over_limit(), heartbeat_s=heartbeat_s)
        try:
            for handle, event in stream:
                if handle is not None:
                    self.note(handle, event)
                yield handle, event
        finally:
            stream.close()

    def close(self, wait: bool = True) -> None:
        """Cancel whatever has not ended (its KV goes back at once) and refund the caller the unused tokens.
        wait=False returns without waiting for the engine loop's next step (an asyncio handler must not block)."""
        for handle in self.handles:
            if handle.done:
                continue
            if isinstance(handle, LoopHandle) and not wait:
                if not handle.request.finished:
                    handle.loop.cancel(handle, wait=False)
            else:
                handle.cancel()
            handle.done = True
        self.pool.limits.refund(self.job.caller or "local", self.budget - self._used)
        self.budget = self._used


def admit(pool, job: Job) -> Run:
    """Everything before `job` runs, in the module docstring's order; a ConfigError (in `{setting}` words, see
    `inference_core.settings.words`) or a `LimitExceeded` says why it cannot."""
    # The serving settings run eager while their compiled steps are built in the background (`serving.build`).
    job = replace(job, lanes={name: (slot, pool.runnable(settings)) for name, (slot, settings) in job.lanes.items()})
    engines = {name: pool.get(slot, settings) for name, (slot, settings) in job.lanes.items() if not settings.external}
    prompt_ids, new_tokens = _token_counts(pool, job)
    requests: dict[str, list[Request]] = {name: [] for name in engines}
    estimates: list[float] = []
    for ids, new in zip(prompt_ids, new_tokens):
        for name, engine in engines.items():
            settings = job.lanes[name][1]
            params = settings.sampling(new, top_k=job.top_k, stop=job.stop, ignore_eos=job.ignore_eos,
                                       **job.sampling)
            copies = [params if copy == 0 or params.seed is None else replace(params, seed=params.seed + copy)
                      for copy in range(job.copies)]
            for request in engine.make_copies(ids, copies, spec=settings.spec(), cache_salt=job.cache_salt):
                request.keep_final_kv_snapshot = job.keep_final_kv_snapshot
                requests[name].append(request)
        pool.policy.check_sizes(len(ids), new)
        lane_estimates = check_run_cost(pool, {name: s for name, (_, s) in job.lanes.items()}, len(ids), new,
                                        job.what)
        estimates = estimates or lane_estimates
    _check_queue(pool)
    endpoints = {name: resolve_endpoint(pool.policy, settings) for name, (_, settings) in job.lanes.items()
                 if settings.external}
    budget = sum(len(ids) + new for ids, new in zip(prompt_ids, new_tokens)) * job.copies * len(job.lanes)
    pool.limits.admit(job.caller or "local", budget)
    return Run(pool, job, engines, requests, prompt_ids, new_tokens, estimates, endpoints, budget)


def job_seconds(pool, job: Job) -> float | None:
    """The estimated device seconds of all of `job` (every prompt on every lane, every copy) from the figures the
    pool's cost model already has, without probing the device; None where a figure it needs is missing."""
    prompt_ids, new_tokens = _token_counts(pool, job)
    total = 0.0
    for ids, new in zip(prompt_ids, new_tokens):
        for _, settings in job.lanes.values():
            seconds = 0.0 if settings.external else pool.costs.request_seconds(settings.kv_mode, len(ids), new,
                                                                                probe=False)
            if seconds is None:
                return None
            total += seconds * job.copies
    return total


def _token_counts(pool, job: Job) -> tuple[list[list[int]], list[int]]:
    """Each prompt's token ids and the new tokens it asks for (`max_new_tokens`, else as `Job` says)."""
    tokenizer = pool.loaded.tokenizer
    prompt_ids = [list(prompt) if _token_ids(prompt) else tokenizer.prompt_ids(prompt, job.system, job.chat)
                  for prompt in job.prompts]
    new_tokens = [int(job.max_new_tokens) if job.max_new_tokens is not None else
                  max(1, min(job.default_new_tokens or room, pool.policy.max_new_tokens, room))
                  for room in (pool.max_seq_len - len(ids) for ids in prompt_ids)]
    return prompt_ids, new_tokens


def _token_ids(prompt) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], int)


def _check_queue(pool) -> None:
    """Refuse a run while the engines hold as many requests as the deployment allows; Retry-After from the busy
    engines' measured steps."""
    queued = pool.active_requests()
    if queued >= pool.policy.max_queue:
        steps = [status["mean_step_ms"] or 0 for status in pool.loop.status()]
        raise QueueFull(f"the server is busy: {queued} requests are queued or running, the limit is "
                        f"{pool.policy.max_queue}.", max(1.0, math.fsum(steps) / 1e3 * QUEUE_RETRY_STEPS))
