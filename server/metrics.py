"""Prometheus metrics of the engine as it serves, the page's requests and the API's alike (`GET /metrics`).

`Metrics` watches every request through the engine loop's observer hook (`EngineLoop.add_observer`), so a race
lane, a chat turn and an API completion count the same way, and reads the engines' live state (queue, KV blocks) when
scraped. Every name starts with `playground_`. It has a registry of its own, so two apps in one process (tests) never
share counters.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import GaugeMetricFamily

from inference_core import FinishEvent, TokenEvent
from inference_core.engine.loop import CANCELLED

disable_created_metrics()  # no `_created` twin of every counter: nothing here reads them
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 12.8, 25.6, 60.0)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


def source_of(handle) -> str:
    """'api' for the HTTP API's requests (their handles are tagged 'api'), 'page' for the rest."""
    return "api" if handle.tag == "api" else "page"


class Metrics:
    def __init__(self, pool):
        self.pool = pool
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("playground_requests", "Requests that ended, by where they came from and how they "
                                "ended (finished, cancelled, failed)", ["source", "outcome"], registry=registry)
        self.http = Counter("playground_http_requests", "HTTP API answers by endpoint and status code",
                            ["endpoint", "status"], registry=registry)
        self.rejected = Counter("playground_rejected_requests", "Requests refused before they ran, by reason "
                                "(bad_request, rate_limited, queue_full, too_large)", ["reason"], registry=registry)
        self.prompt_tokens = Counter("playground_prompt_tokens", "Prompt tokens of finished requests",
                                     registry=registry)
        self.cached_tokens = Counter("playground_prefix_cache_hit_tokens", "Prompt tokens whose KV came from the "
                                     "prefix cache", registry=registry)
        self.generated_tokens = Counter("playground_generation_tokens", "Generated tokens", registry=registry)
        self.drafted = Counter("playground_spec_draft_tokens", "Speculative draft tokens proposed", registry=registry)
        self.accepted = Counter("playground_spec_accepted_tokens", "Speculative draft tokens accepted",
                                registry=registry)
        self.preemptions = Counter("playground_preemptions", "Times the scheduler took a request's KV away to make "
                                   "room for others", registry=registry)
        self.ttft = Histogram("playground_time_to_first_token_seconds", "Wall time from submission to the first "
                              "token", buckets=TTFT_BUCKETS, registry=registry)
        self.itl = Histogram("playground_inter_token_latency_seconds", "Wall time between consecutive tokens of a "
                             "request", buckets=ITL_BUCKETS, registry=registry)
        self.e2e = Histogram("playground_request_latency_seconds", "Wall time from submission to the final event",
                             buckets=TTFT_BUCKETS, registry=registry)
        registry.register(_LiveState(self))
        self._last_token_at: dict[int, float] = {}  # request id -> wall time of its last token (loop thread only)
        # Running totals behind the two rate gauges (prometheus-client keeps counter values to itself).
        self.totals = {"prompt": 0, "cached": 0, "drafted": 0, "accepted": 0}

    def observe(self, handle, event) -> None:
        """The engine loop's observer: runs in the loop thread for every event of every request."""
        request, now = handle.request, time.perf_counter()
        if isinstance(event, TokenEvent):
            last = self._last_token_at.get(request.request_id)
            if last is None:
                self.ttft.observe(now - request.submitted_at)
            else:
                self.itl.observe(now - last)
            self._last_token_at[request.request_id] = now
            return
        self._last_token_at.pop(request.request_id, None)
        source = source_of(handle)
        if event is CANCELLED:
            self.requests.labels(source, "cancelled").inc()
        elif isinstance(event, FinishEvent):
            stats = event.stats
            self.requests.labels(source, "finished").inc()
            self.totals["prompt"] += stats.prompt_tokens
            self.totals["cached"] += stats.cached_prompt_tokens
            self.prompt_tokens.inc(stats.prompt_tokens)
            self.cached_tokens.inc(stats.cached_prompt_tokens)
            self.generated_tokens.inc(stats.generated_tokens)
            self.preemptions.inc(stats.preemptions)
            self.e2e.observe(now - request.submitted_at)
            if stats.spec:
                self.totals["drafted"] += stats.spec["drafted"]
                self.totals["accepted"] += stats.spec["accepted"]
                self.drafted.inc(stats.spec["drafted"])
                self.accepted.inc(stats.spec["accepted"])
        else:  # the error of a failed step
            self.requests.labels(source, "failed").inc()

    def ratio(self, part: str, whole: str) -> float:
        return self.totals[part] / self.totals[whole] if self.totals[whole] else 0.0

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _LiveState:
    """Gauges read from the engines when scraped: queue length, running requests, KV blocks in use, and the ratios
    Grafana users expect precomputed (prefix-cache hit rate, speculative acceptance rate)."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def describe(self):
        return []  # no values at registration: collect() reads the engines only when scraped

    def collect(self):
        metrics, pool = self.metrics, self.metrics.pool
        status = pool.loop.status()
        waiting = GaugeMetricFamily("playground_queue_length", "Requests queued and not yet running, all engines")
        waiting.add_metric([], sum(s["waiting"] for s in status))
        yield waiting
        running = GaugeMetricFamily("playground_running_requests", "Requests running (holding KV), all engines")
        running.add_metric([], sum(s["running"] for s in status))
        yield running
        blocks = GaugeMetricFamily("playground_kv_blocks_in_use", "KV blocks (paged) and slots (contiguous) held, "
                                   "all engines")
        blocks.add_metric([], pool.loop.call(pool.blocks_in_use))
        yield blocks
        hit = GaugeMetricFamily("playground_prefix_cache_hit_rate", "Prompt tokens from the prefix cache / prompt "
                                "tokens, since start")
        hit.add_metric([], metrics.ratio("cached", "prompt"))
        yield hit
        accept = GaugeMetricFamily("playground_spec_acceptance_rate", "Speculative drafts accepted / drafted, since "
                                   "start")
        accept.add_metric([], metrics.ratio("accepted", "drafted"))
        yield accept
