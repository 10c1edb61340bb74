"""Racing requests on one device: interleaves several request generators in one thread so each gets an equal share
of device time, and measures that the share is fair.

`interleave` always advances the lane that has used the least busy time so far (each lane's own clock, from its
events), one model step at a time; the lane that takes the very first step is the caller's choice (the playground
alternates it between races, so no lane always meets whatever a first step still costs). Because every request times
only its own steps (see `engine`), a lane's reported TTFT and tokens/s are what the same configuration gives alone,
and on screen both lanes move at a pace that reflects their own speed. `measure_fairness` checks exactly that: each
configuration alone, then all of them in a race, and the ratio of their decode tokens/s
(`python -m inference_core race`).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Callable, Iterator

from inference_core.config import ConfigError, EngineConfig
from inference_core.engine import Engine, FinishEvent, StopGeneration, TokenEvent, load_model
from inference_core.prompts import DEFAULT_PROMPTS, load_prompts
from inference_core.sampling import SamplingParams


def interleave(lanes: dict[str, Iterator[TokenEvent | FinishEvent]], first: str | None = None,
               should_stop: Callable[[], bool] | None = None) -> Iterator[tuple[str, TokenEvent | FinishEvent]]:
    """Yield (lane name, event) from every lane until all have finished, next stepping the lane with the least busy
    time; ties (the first step above all) go to `first`, by default the lane named first.

    Once `should_stop()` returns true (it is asked before every step), each lane is stopped after the step it has in
    flight (`StopGeneration`): its remaining events still arrive, the last a FinishEvent with finish_reason
    "stopped"; a lane that had not started yet just ends, with no events. Closing this generator instead closes every
    lane at once, which cancels its request with no final event."""
    busy_s = {name: 0.0 for name in lanes}
    running = {name: lanes[name] for name in sorted(lanes, key=lambda name: name != first)}
    stopped: set[str] = set()
    try:
        while running:
            name = min(running, key=lambda lane: busy_s[lane])
            if should_stop is not None and name not in stopped and should_stop():
                stopped.add(name)
                try:
                    event = running[name].throw(StopGeneration)
                except StopGeneration:  # it had not started: no step to finish, nothing to report
                    running.pop(name)
                    continue
            else:
                event = next(running[name])
            finished = isinstance(event, FinishEvent)
            busy_s[name] = event.stats.total_ms / 1e3 if finished else event.time_s
            yield name, event
            if finished:  # the request is still held while the caller looks at its last event; now free it
                running.pop(name).close()
    finally:
        for lane in lanes.values():
            lane.close()


def race_to_end(engines: dict[str, Engine], prompt_ids: list[int],
                params: SamplingParams) -> dict[str, FinishEvent]:
    """Run one prompt on every engine at once, interleaved; return each lane's final event."""
    lanes = {name: engine.generate(prompt_ids, params) for name, engine in engines.items()}
    return {name: event for name, event in interleave(lanes) if isinstance(event, FinishEvent)}


def measure_fairness(engines: dict[str, Engine], prompt_ids: list[int], params: SamplingParams,
                     repeats: int) -> list[dict]:
    """Decode tokens/s of each engine alone and in a race of all of them, medians over `repeats` rounds (each round
    runs every engine alone, then the race, so drift on a shared machine hits both alike)."""
    alone: dict[str, list[float]] = {name: [] for name in engines}
    raced: dict[str, list[float]] = {name: [] for name in engines}
    for engine in engines.values():  # warm-up, never timed
        engine.complete(prompt_ids, SamplingParams(max_new_tokens=4))
    for _ in range(repeats):
        for name, engine in engines.items():
            engine.reset_prefix_cache()
            alone[name].append(engine.complete(prompt_ids, params).stats.decode_tokens_per_s)
        for engine in engines.values():
            engine.reset_prefix_cache()
        for name, event in race_to_end(engines, prompt_ids, params).items():
            raced[name].append(event.stats.decode_tokens_per_s)
    rows = []
    for name in engines:
        alone_median, race_median = statistics.median(alone[name]), statistics.median(raced[name])
        rows.append({"lane": name, "alone_decode_tokens_per_s": round(alone_median, 2),
                     "race_decode_tokens_per_s": round(race_median, 2),
                     "race_vs_alone": round(race_median / alone_median, 3), "runs": repeats})
    return rows


def run_race_bench(args) -> int:
    """`python -m inference_core race`: fairness of the playground's race, printed as a table and written as JSON."""
    lanes = [mode.strip() for mode in args.lanes.split(",") if mode.strip()]
    if len(lanes) < 2:
        raise ConfigError("a race needs at least two lanes: --lanes paged,contiguous (KV modes, comma-separated).")
    if args.repeats < 1 or args.max_new_tokens < 2:
        raise ConfigError("race needs --repeats >= 1 and --max-new-tokens >= 2.")
    by_id = {row["id"]: row for row in load_prompts(DEFAULT_PROMPTS)}
    if args.prompt_id not in by_id:
        raise ConfigError(f"unknown prompt id {args.prompt_id!r}; pick one of: {', '.join(by_id)}.")
    configs = {f"{index + 1}:{mode}": EngineConfig(kv_mode=mode) for index, mode in enumerate(lanes)}
    loaded = load_model(args.model, args.device, args.dtype)
    engines = {name: Engine(loaded, config) for name, config in configs.items()}
    row = by_id[args.prompt_id]
    prompt_ids = next(iter(engines.values())).prompt_ids(row["prompt"], row.get("system"))
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    print(f"race: {loaded.name} on {loaded.device} in {str(loaded.dtype).removeprefix('torch.')}, prompt "
          f"{args.prompt_id} ({len(prompt_ids)} tokens), {args.max_new_tokens} new tokens, {args.repeats} repeats",
          flush=True)
    rows = measure_fairness(engines, prompt_ids, params, args.repeats)
    print("| lane | alone decode tok/s | in the race decode tok/s | race / alone |\n|---|---|---|---|")
    for result in rows:
        print(f"| {result['lane']} | {result['alone_decode_tokens_per_s']:.1f} | "
              f"{result['race_decode_tokens_per_s']:.1f} | {result['race_vs_alone']:.2f} |")
    if args.json_path:
        report = {"model": loaded.name, "device": str(loaded.device),
                  "dtype": str(loaded.dtype).removeprefix("torch."), "prompt": args.prompt_id,
                  "prompt_tokens": len(prompt_ids), "max_new_tokens": args.max_new_tokens, "rows": rows}
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json_path}")
    return 0
