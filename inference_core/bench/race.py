"""`python -m inference_core race`: whether a race is fair. A lane raced against others (`engine.interleave`) should
decode as fast as it does alone, since each request times only its own steps; `measure_fairness` runs each
configuration alone, then all of them in a race, and reports the ratio of their decode tokens/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from inference_core.bench.prompts import DEFAULT_PROMPTS, load_prompts
from inference_core.config import ConfigError, EngineConfig
from inference_core.engine.engine import Engine
from inference_core.engine.interleave import race_to_end
from inference_core.model.loader import add_model_arguments, load_model
from inference_core.sampling import SamplingParams


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


def add_race_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """`python -m inference_core race`'s flags."""
    parser.add_argument("--lanes", default="paged,contiguous", help="KV modes to race, comma-separated")
    parser.add_argument("--prompt-id", default="chat-short-1", help="a benchmark prompt id")
    add_model_arguments(parser)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", dest="json_path", help="write the results here")


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
