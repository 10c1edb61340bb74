"""Paged attention, gather against FlexAttention, on one engine configuration: a prefill, batch-1 decode and batch-8
decode of different lengths, per dtype. Prints a table and writes JSON.

    python scripts/attention_bench.py --dtype float32 bfloat16 --out docs/bench/attention-cpu.json

Each measurement is warmed up first (flex compiles a graph per bucket on its first use), the two attentions take turns
round by round on the same loaded model, and every figure is the median over the rounds (prefill: one forward of the
prompt, nothing from the prefix cache; decode: the median step of 32 at each batch, whose contexts are the benchmark
prompts plus the tokens decoded so far).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from inference_core import Engine, EngineConfig, SamplingParams, load_model
from inference_core.bench.prompts import load_prompts

PREFILL_PROMPT = "long-2"  # 277 tokens
DECODE_PROMPTS = ("plain-1", "chat-short-3", "code-2", "grounded-1", "long-2", "chat-short-1", "code-1", "plain-2")
DECODE_STEPS = 32


def prompt_ids(loaded, ids: tuple[str, ...]) -> list[list[int]]:
    rows = {row["id"]: row for row in load_prompts()}
    return [loaded.tokenizer.prompt_ids(rows[i]["prompt"], rows[i].get("system"), rows[i]["kind"] != "completion")
            for i in ids]


def sync(loaded) -> None:
    if loaded.device.type == "cuda":
        torch.cuda.synchronize(loaded.device)


def time_prefill(engine: Engine, ids: list[int]) -> float:
    """ms of one forward over the whole prompt (the request's only step: one new token)."""
    sync(engine.loaded)
    started = time.perf_counter()
    engine.complete(ids, SamplingParams(max_new_tokens=1, ignore_eos=True))
    sync(engine.loaded)
    return (time.perf_counter() - started) * 1e3


def time_decode(engine: Engine, prompts: list[list[int]]) -> float:
    """The median ms of DECODE_STEPS steps in which every prompt's sequence decodes one token."""
    params = SamplingParams(max_new_tokens=DECODE_STEPS + 2, ignore_eos=True)
    requests = [engine.submit(ids, params) for ids in prompts]
    while any(request.seq.num_generated_tokens == 0 for request in requests):
        engine.step()  # the prompts' prefill (and their first tokens)
    steps = []
    for _ in range(DECODE_STEPS):
        sync(engine.loaded)
        started = time.perf_counter()
        engine.step()
        sync(engine.loaded)
        steps.append((time.perf_counter() - started) * 1e3)
    for request in requests:
        engine.cancel(request)
    return statistics.median(steps)


def measure(loaded, rounds: int, context: int) -> list[dict]:
    prefill_ids = prompt_ids(loaded, (PREFILL_PROMPT,))[0]
    decode_ids = prompt_ids(loaded, DECODE_PROMPTS)
    cases = {f"prefill {len(prefill_ids)} tokens": lambda engine: time_prefill(engine, prefill_ids),
             "decode batch 1": lambda engine: time_decode(engine, decode_ids[4:5]),
             "decode batch 8": lambda engine: time_decode(engine, decode_ids)}
    if context:  # long contexts: each prompt repeated up to `context` tokens
        long_ids = [(ids * (context // len(ids) + 1))[:context] for ids in decode_ids]
        cases[f"decode batch 8, {context}-token contexts"] = lambda engine: time_decode(engine, long_ids)
    pool = max(8192, 8 * (context + DECODE_STEPS + 8))
    engines = {attention: Engine(loaded, EngineConfig(kv_mode="paged", prefix_cache=False,
                                                      max_seq_len=max(2048, context + 64), kv_cache_tokens=pool,
                                                      attention=attention))
               for attention in ("gather", "flex")}
    timings = {(case, attention): [] for case in cases for attention in engines}
    for round_index in range(rounds + 1):  # round 0 warms up (and compiles flex's buckets)
        for case, run in cases.items():
            for attention, engine in engines.items():
                elapsed = run(engine)
                if round_index:
                    timings[case, attention].append(elapsed)
    rows = []
    for case in cases:
        gather, flex = (statistics.median(timings[case, attention]) for attention in ("gather", "flex"))
        rows.append({"case": case, "gather_ms": round(gather, 2), "flex_ms": round(flex, 2),
                     "flex_over_gather": round(flex / gather, 3)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bundled")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--context", type=int, default=0, help="also decode batch 8 at contexts of this many tokens")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    report = {"model": args.model, "device": args.device, "torch": torch.__version__,
              "threads": torch.get_num_threads(), "rounds": args.rounds, "rows": []}
    print(f"{'dtype':<9} {'case':<36} {'gather ms':>10} {'flex ms':>9} {'flex/gather':>12}")
    for dtype in args.dtype:
        loaded = load_model(args.model, device=args.device, dtype=dtype)
        for row in measure(loaded, args.rounds, args.context):
            report["rows"].append({"dtype": dtype, **row})
            print(f"{dtype:<9} {row['case']:<36} {row['gather_ms']:>10.2f} {row['flex_ms']:>9.2f} "
                  f"{row['flex_over_gather']:>12.3f}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
