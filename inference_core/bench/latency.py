"""Per-request latency records and what a set of them summarizes to: percentiles, time per output token, and goodput
under latency targets. Plain numbers in, plain numbers out: `batch-bench` feeds it `Timing` records and the
Batching tab feeds it the times it read from the engine's step reports, so both judge a request the same way.

Definitions (those of `vllm bench serve --goodput`). TPOT, time per output token, is the mean gap between a
request's tokens after the first: (latency - TTFT) / (output tokens - 1). A one-token answer has no such gap: it is
left out of the TPOT percentiles and meets any TPOT target (its TTFT target still judges it). A request meets the
targets when its TTFT is at most the TTFT target and its TPOT at most the TPOT target (a target not given judges
nothing); a request that never finished meets none. Goodput is the requests that met the targets per second of the
run's wall clock (the throughput's wall clock: first arrival to last completion); attainment is their share of all
requests. Without any target the two are None (null in the JSON).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from inference_core.config import ConfigError

SLO_KEYS = ("tpot_ms_p50", "tpot_ms_p95", "goodput_requests_per_s", "slo_attainment_pct")


@dataclass(slots=True)
class Timing:
    """One request's wall-clock times (time.perf_counter values) and what it produced."""

    arrival: float
    first_token: float = math.nan
    last_token: float = math.nan
    output_tokens: int = 0
    preemptions: int = 0
    spec: dict | None = None  # a speculating request's statistics (`SpecStats.as_dict`)


@dataclass(frozen=True, slots=True)
class LatencyTargets:
    """The latency a request must meet to count toward goodput; None: no target on that figure."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def __post_init__(self):
        for name, value in (("TTFT", self.ttft_ms), ("TPOT", self.tpot_ms)):
            if value is not None and not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise ConfigError(f"the {name} target must be a number of milliseconds above 0 (or none), got "
                                  f"{value!r}.")

    @property
    def given(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None

    def describe(self) -> str:
        parts = [f"{name} <= {_number(value)} ms" for name, value in (("TTFT", self.ttft_ms), ("TPOT", self.tpot_ms))
                 if value is not None]
        return " and ".join(parts) if parts else "no latency target"


def _number(value: float) -> str:
    return f"{value:.0f}" if float(value).is_integer() else f"{value:g}"


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def tpot_ms(ttft_ms: float, latency_ms: float, output_tokens: int) -> float | None:
    """(latency - TTFT) / (output tokens - 1); None for an answer of one token (or none)."""
    if output_tokens < 2:
        return None
    return (latency_ms - ttft_ms) / (output_tokens - 1)


def meets(ttft_ms: float, latency_ms: float, output_tokens: int, targets: LatencyTargets) -> bool:
    """Whether one request met every given target (an unfinished one, NaN times or no tokens, meets none)."""
    if output_tokens < 1 or math.isnan(ttft_ms) or math.isnan(latency_ms):
        return False
    if targets.ttft_ms is not None and not ttft_ms <= targets.ttft_ms:
        return False
    gap = tpot_ms(ttft_ms, latency_ms, output_tokens)
    return targets.tpot_ms is None or gap is None or gap <= targets.tpot_ms


def slo_summary(ttft_ms: list[float], latency_ms: list[float], output_tokens: list[int], wall_s: float,
                targets: LatencyTargets | None) -> dict:
    """SLO_KEYS for one row's requests (one entry per request in each list, times in ms, NaN for one that never
    produced the time); goodput over `wall_s` seconds. TPOT percentiles are None when no answer had two tokens."""
    gaps = [gap for ttft, latency, tokens in zip(ttft_ms, latency_ms, output_tokens)
            if not math.isnan(latency) and (gap := tpot_ms(ttft, latency, tokens)) is not None]
    summary = {"tpot_ms_p50": round(percentile(gaps, 50), 1) if gaps else None,
               "tpot_ms_p95": round(percentile(gaps, 95), 1) if gaps else None,
               "goodput_requests_per_s": None, "slo_attainment_pct": None}
    if targets is not None and targets.given and ttft_ms:
        good = sum(meets(*request, targets) for request in zip(ttft_ms, latency_ms, output_tokens))
        summary["goodput_requests_per_s"] = round(good / wall_s, 3) if wall_s > 0 else None
        summary["slo_attainment_pct"] = round(100 * good / len(ttft_ms), 1)
    return summary


def parse_rates(text: str) -> list[float]:
    """`--rates 0.5,1,2,4`: Poisson arrival rates in requests per second, each above 0."""
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        rates = []
    if not rates or not all(rate > 0 and math.isfinite(rate) for rate in rates):
        raise ConfigError(f"bad --rates {text!r}; give request rates per second above 0, comma-separated, like "
                          "0.5,1,2,4.")
    return rates
