"""What a request will cost on this device, estimated from forward passes measured here: the guard that keeps one
request from holding a shared device for minutes, and the token count the page starts with.

`StepCosts` knows two figures of the loaded model: the time of a full forward over n tokens with no KV cache (per
length bucket: 64, 128, 256, ... tokens) and of a cached decode step at a short context. Each comes first from a
probe, run on the device between the engine loop's steps the first time an estimate needs it: an untimed warm-up,
then the best of `PROBE_REPEATS` timings (fewer for a long bucket, whose forwards every visitor waits for), so that
a cold first call or one slow moment does not become the figure.
Then the engine's own steps take over: the loop reports every step (`EngineLoop.add_step_observer`), and a step of
one request on the loaded weights, eager, is a measurement of the same thing (a prefill, or with no KV cache any
step, is a forward over its tokens; a cached one-token step is a decode). Once `MIN_MEASURED` such steps of a
figure have run, the median of its latest `MEASURED_STEPS` replaces the probe: the estimate follows what requests
actually take here, and recovers by itself after a busy spell.

A request's device time is the sum of its steps: with a KV cache, a prefill over the prompt plus one cached step per
further token; with no KV cache, a forward over the whole text so far for every token. A length between buckets is
costed at the per-token time of the bucket above it, which over-estimates short forwards (their fixed cost is
spread over fewer tokens) and never under-estimates a long one. Speculative decoding is costed as plain decoding.
These are estimates, shown as such; the measured numbers are the request's own stats. `check_run_cost` refuses a
run estimated over the deployment's device-time limit, saying what to change; `new_tokens_that_fit` is how many
new tokens a page can start with.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from typing import Callable

import torch

from inference_core.config import ConfigError, EngineConfig
from inference_core.engine.engine import Engine, StepReport
from inference_core.engine.runner import ModelRunner
from inference_core.kv.cache import RecomputeKVCache
from inference_core.sampling import SamplingParams
from inference_core.sequence import Sequence
from inference_core.settings import LaneSettings

SMALLEST_BUCKET = 64
DECODE_PROBE_TOKENS = 16
PROBE_REPEATS = 3  # timed probes after the warm-up; the best counts
LONG_BUCKET = 256  # forward probes over more tokens are timed twice, not PROBE_REPEATS times
MIN_MEASURED = 4  # engine steps of a figure before their median replaces its probe
MEASURED_STEPS = 32  # the latest engine steps of each figure kept
# A page's starting token count is estimated to use at most this share of the run limit. Measured: with two spinning
# processes on both cores and the browser drawing the race, the default race took 1.4x its estimate (20.4 s of
# device time against 14 s); with a third busy process beside them (the suite's other worker compiling), the
# recomputing lane, estimated at 7 s, was still running at the 20 s limit (3.7 tokens/s). A quarter of the limit
# leaves room for 4x; at the default limit (3 minutes) it still starts the default race at its full length.
START_SHARE = 0.25


def length_bucket(num_tokens: int) -> int:
    """The smallest power of two, at least SMALLEST_BUCKET, that holds `num_tokens`."""
    bucket = SMALLEST_BUCKET
    while bucket < num_tokens:
        bucket *= 2
    return bucket


class StepCosts:
    """Measured forward times of one loaded model on its device (see the module docstring). `on_device(function)`
    runs a probe where it has the device to itself (the pool passes its engine loop's `call`); `clock` times
    probes."""

    def __init__(self, loaded, max_seq_len: int, on_device: Callable[[Callable], float] = lambda probe: probe(),
                 clock: Callable[[], float] = time.perf_counter):
        self.loaded = loaded
        self.max_seq_len = max_seq_len
        self.on_device = on_device
        self.clock = clock
        self.probed_forward_ms: dict[int, float] = {}  # length bucket -> ms of one uncached forward over it
        self.probed_decode_ms: float | None = None
        # The engine's own steps, as the same figures: per bucket, a forward's ms scaled to the bucket's length.
        self.measured_forward_ms: dict[int, deque[float]] = {}
        self.measured_decode_ms: deque[float] = deque(maxlen=MEASURED_STEPS)
        self._lock = threading.Lock()  # steps are observed in the loop thread, estimates read in callers' threads

    @property
    def decode_ms(self) -> float:
        """ms of one cached decode step at a short context: the median of measured steps, else the probe."""
        return self._decode_ms(probe=True)

    def _decode_ms(self, probe: bool) -> float | None:
        measured = self._median(self.measured_decode_ms)
        if measured is not None:
            return measured
        if self.probed_decode_ms is None and probe:
            self.probed_decode_ms = self.on_device(self._probe_decode_ms)
        return self.probed_decode_ms

    def forward_ms_at(self, num_tokens: int, probe: bool = True) -> float | None:
        """ms of one uncached forward over `num_tokens` tokens, at its bucket's per-token time (None where `probe` is
        False and the bucket was neither measured nor probed)."""
        bucket = min(length_bucket(num_tokens), length_bucket(self.max_seq_len))
        measured = self._median(self.measured_forward_ms.get(bucket, ()))
        if measured is None:
            if bucket not in self.probed_forward_ms:
                if not probe:
                    return None
                self.probed_forward_ms[bucket] = self.on_device(lambda: self._probe_forward_ms(bucket))
            measured = self.probed_forward_ms[bucket]
        return measured * num_tokens / bucket

    def figures(self) -> dict:
        """What this process knows without probing: {"decode_ms": ms or None, "forward_ms": {bucket: ms}}."""
        buckets = {*self.probed_forward_ms, *self.measured_forward_ms}
        forward = {bucket: self.forward_ms_at(bucket, probe=False) for bucket in sorted(buckets)}
        return {"decode_ms": self._decode_ms(probe=False),
                "forward_ms": {bucket: ms for bucket, ms in forward.items() if ms is not None}}

    def adopt(self, figures: dict) -> None:
        """Take `figures` (another process's `figures()`: the latest ZeroGPU worker's) as this process's probes, in
        place of its own or earlier ones; steps this process measured itself still come first."""
        if figures.get("decode_ms") is not None:
            self.probed_decode_ms = float(figures["decode_ms"])
        for bucket, ms in figures.get("forward_ms", {}).items():
            self.probed_forward_ms[int(bucket)] = float(ms)

    def observe(self, engine: Engine, report: StepReport) -> None:
        """Count one engine step in (called in the loop thread after every step): a step of one request, not
        speculative, on the loaded weights, eager and compiling nothing, is a measured forward or decode."""
        if engine.loaded is not self.loaded or len(report.work) != 1 or report.compile_ms \
                or report.padding_rows or report.prompt_padding_tokens:
            return
        _, kind, tokens = report.work[0]
        with self._lock:
            if kind == "decode" and tokens == 1:
                if engine.decoder is None:
                    self.measured_decode_ms.append(report.duration_ms)
            elif kind != "speculative":
                bucket = length_bucket(tokens)
                if bucket <= length_bucket(self.max_seq_len):
                    self.measured_forward_ms.setdefault(bucket, deque(maxlen=MEASURED_STEPS)).append(
                        report.duration_ms * bucket / tokens)

    def _median(self, steps) -> float | None:
        with self._lock:
            return statistics.median(steps) if len(steps) >= MIN_MEASURED else None

    @torch.inference_mode()
    def _probe_forward_ms(self, bucket: int) -> float:
        """The best of PROBE_REPEATS timed forwards over `bucket` tokens (two past LONG_BUCKET: the loop, and so every
        visitor, waits for the probe), after an untimed one the first time anything is probed."""
        runner = ModelRunner(self.loaded.model, RecomputeKVCache(), self.loaded.device)
        token_ids = [index % self.loaded.config.vocab_size for index in range(bucket)]
        if not self.probed_forward_ms:
            runner.run([Sequence(token_ids)])  # the first forward warms up kernels and allocations
        timings = []
        for _ in range(PROBE_REPEATS if bucket <= LONG_BUCKET else 2):
            started = self.clock()
            runner.run([Sequence(token_ids)])
            if self.loaded.device.type == "cuda":
                torch.cuda.synchronize(self.loaded.device)
            timings.append((self.clock() - started) * 1e3)
        return min(timings)

    def _probe_decode_ms(self) -> float:
        """A short request's decode steps on a small contiguous cache: per run the median step after the prefill,
        the best of PROBE_REPEATS runs after one that warms up."""
        engine = Engine(self.loaded, EngineConfig(kv_mode="contiguous", max_seq_len=SMALLEST_BUCKET))
        params = SamplingParams(max_new_tokens=DECODE_PROBE_TOKENS, ignore_eos=True)
        runs = []
        for _ in range(1 + PROBE_REPEATS):
            engine.enqueue(engine.make_request([1] * 8, params))
            steps = []
            while engine.has_work():
                started = self.clock()
                engine.step()
                steps.append((self.clock() - started) * 1e3)
            runs.append(statistics.median(steps[1:]))  # the first step is the prefill
        return min(runs[1:])

    def request_seconds(self, kv_mode: str, prompt_tokens: int, new_tokens: int, probe: bool = True) -> float | None:
        """Estimated device time of one request with no prefix-cache hit (None where `probe` is False and a figure it
        needs was neither measured nor probed)."""
        if new_tokens < 1:
            return 0.0
        if kv_mode == "none":  # token i is sampled from a forward over prompt + i tokens
            parts = [self.forward_ms_at(prompt_tokens + index, probe) for index in range(new_tokens)]
        else:
            parts = [self.forward_ms_at(prompt_tokens, probe), self._decode_ms(probe) if new_tokens > 1 else 0.0]
            parts[1] = None if parts[1] is None else parts[1] * (new_tokens - 1)
        return None if None in parts else sum(parts) / 1e3

    def most_new_tokens(self, kv_modes: list[str], prompt_tokens: int, limit_s: float, upper: int) -> int:
        """The largest number of new tokens (up to `upper`) for which requests in `kv_modes`, one each, are estimated
        to take at most `limit_s` together; 0 if none does."""
        low, high = 0, upper
        while low < high:
            middle = (low + high + 1) // 2
            if sum(self.request_seconds(mode, prompt_tokens, middle) for mode in kv_modes) <= limit_s:
                low = middle
            else:
                high = middle - 1
        return low


def new_tokens_that_fit(pool, lanes: list[LaneSettings], prompt_tokens: int, wanted: int, step: int = 8) -> int:
    """The new tokens per lane a page starts with: `wanted`, or where the estimate of one request per lane is over
    START_SHARE of the pool's run limit, the most that fits, in multiples of `step` (at least `step`)."""
    here = [settings.kv_mode for settings in lanes if not settings.external]
    fits = pool.costs.most_new_tokens(here, prompt_tokens, START_SHARE * pool.max_run_s, wanted)
    return wanted if fits >= wanted else max(step, fits // step * step)


def duration(seconds: float) -> str:
    """A device time as a person reads it: '40 s', 'about 3 minutes'."""
    if seconds < 90:
        return f"{seconds:.0f} s" if seconds >= 1 else f"{seconds:.1f} s"
    return f"{seconds / 60:.0f} minutes" if seconds % 60 == 0 else f"about {seconds / 60:.0f} minutes"


def check_run_cost(pool, lanes: dict[str, LaneSettings], prompt_tokens: int, new_tokens: int,
                   what: str) -> list[float]:
    """Estimated device seconds of each lane's request (one request per lane, run one after another on the device);
    raises ConfigError (naming `{max_new_tokens}` for each surface to word) when together they exceed the pool's
    `max_run_s`."""
    estimates = pool.estimate_s(list(lanes.values()), prompt_tokens, new_tokens)
    if sum(estimates) <= pool.max_run_s:
        return estimates
    slowest = max(zip(lanes, estimates), key=lambda pair: pair[1])[0]
    here = [s.kv_mode for s in lanes.values() if not s.external]
    fits = pool.costs.most_new_tokens(here, prompt_tokens, pool.max_run_s, new_tokens)
    changes = [f"lower {{max_new_tokens}} to {fits} or less" if fits else "shorten the prompt"]
    why = ""
    if lanes[slowest].kv_mode == "none":
        why = ": with no KV cache, each new token recomputes the whole text"
        changes.append(f"give {'lane ' + slowest if len(lanes) > 1 else 'it'} a KV cache")
    whose = f" (lane {slowest} {duration(max(estimates))}{why})" if len(lanes) > 1 else why
    raise ConfigError(f"this {what} would hold the shared device for {duration(sum(estimates))}{whose}, over this "
                      f"app's limit of {duration(pool.max_run_s)} per {what}. To run it, "
                      f"{' or '.join(changes)}.")
