"""What a request will cost on this device, estimated from forward passes measured here: the guard that keeps one
request from holding a shared device for minutes.

`StepCosts` times real forward passes of the loaded model, each the first time an estimate needs it: a full forward
over n tokens with no KV cache (once per length bucket: 64, 128, 256, ... tokens) and a cached decode step (a short
request on a small contiguous cache). A request's device time is then the sum of its steps: with a KV cache, a
prefill over the prompt plus one cached step per further token; with no KV cache, a forward over the whole text so
far for every token. A length between buckets is costed at the per-token time of the bucket above it, which
over-estimates short forwards (their fixed cost is spread over fewer tokens) and never under-estimates a long one.
Speculative decoding is costed as plain decoding. These are estimates, shown as such; the measured numbers are the
request's own stats. `check_run_cost` refuses a run estimated over the deployment's device-time limit, saying what
to change.
"""

from __future__ import annotations

import time

import torch

from inference_core.config import ConfigError, EngineConfig
from inference_core.engine.engine import Engine
from inference_core.engine.runner import ModelRunner
from inference_core.kv.cache import RecomputeKVCache
from inference_core.sampling import SamplingParams
from inference_core.sequence import Sequence
from inference_core.settings import LaneSettings

SMALLEST_BUCKET = 64
DECODE_PROBE_TOKENS = 16


def length_bucket(num_tokens: int) -> int:
    """The smallest power of two, at least SMALLEST_BUCKET, that holds `num_tokens`."""
    bucket = SMALLEST_BUCKET
    while bucket < num_tokens:
        bucket *= 2
    return bucket


class StepCosts:
    """Measured forward times of one loaded model on its device (see the module docstring)."""

    def __init__(self, loaded, max_seq_len: int):
        self.loaded = loaded
        self.max_seq_len = max_seq_len
        self.forward_ms: dict[int, float] = {}  # length bucket -> ms of one uncached forward over that many tokens
        self._decode_ms: float | None = None

    @property
    def decode_ms(self) -> float:
        """ms of one cached decode step at a short context: the decode speed of a short request, best of two."""
        if self._decode_ms is None:
            engine = Engine(self.loaded, EngineConfig(kv_mode="contiguous", max_seq_len=SMALLEST_BUCKET))
            params = SamplingParams(max_new_tokens=DECODE_PROBE_TOKENS, ignore_eos=True)
            speeds = [engine.complete([1] * 8, params).stats.decode_tokens_per_s for _ in range(2)]
            self._decode_ms = 1e3 / max(speeds)
        return self._decode_ms

    @torch.inference_mode()
    def forward_ms_at(self, num_tokens: int) -> float:
        """ms of one uncached forward over `num_tokens` tokens, at its bucket's measured per-token time."""
        bucket = min(length_bucket(num_tokens), length_bucket(self.max_seq_len))
        if bucket not in self.forward_ms:
            runner = ModelRunner(self.loaded.model, RecomputeKVCache(), self.loaded.device)
            token_ids = [index % self.loaded.config.vocab_size for index in range(bucket)]
            started = time.perf_counter()
            runner.run([Sequence(token_ids)])
            if self.loaded.device.type == "cuda":
                torch.cuda.synchronize(self.loaded.device)
            self.forward_ms[bucket] = (time.perf_counter() - started) * 1e3
        return self.forward_ms[bucket] * num_tokens / bucket

    def request_seconds(self, kv_mode: str, prompt_tokens: int, new_tokens: int) -> float:
        """Estimated device time of one request with no prefix-cache hit."""
        if new_tokens < 1:
            return 0.0
        if kv_mode == "none":  # token i is sampled from a forward over prompt + i tokens
            return sum(self.forward_ms_at(prompt_tokens + index) for index in range(new_tokens)) / 1e3
        return (self.forward_ms_at(prompt_tokens) + (new_tokens - 1) * self.decode_ms) / 1e3

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
