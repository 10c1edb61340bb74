"""`python -m inference_core compile-options`: which inductor options make the compiled decode step fastest here.

For each option set, a fresh compile of the batch-1 decode step (`compiled.CompiledDecoder`, contiguous KV) on the
given model and dtype: the cold compile's seconds, the seconds of a second compile in the same process after
`torch._dynamo.reset()` (what a restart with inductor's disk cache costs, roughly), and the median step time over
`--steps` decode steps at a context of about 200 tokens, beside the eager step. Prints a table and writes JSON; the
fastest set becomes `compiled.CPU_OPTIONS` (by hand: the choice is recorded with its numbers in docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from inference_core.bench.speed import machine_info, write_report
from inference_core.config import EngineConfig
from inference_core.engine.compiled import CompiledDecoder
from inference_core.engine.engine import make_kv_cache
from inference_core.engine.runner import ModelRunner
from inference_core.model.loader import load_model
from inference_core.sequence import Sequence

OPTION_SETS = {
    "default": {},
    "freezing": {"freezing": True},
    "max-autotune-no-cudagraphs": {"max_autotune": True},
    "freezing+max-autotune": {"freezing": True, "max_autotune": True},
    "freezing+max-autotune+cpp-wrapper": {"freezing": True, "max_autotune": True, "cpp_wrapper": True},
}


def time_steps(step, seq: Sequence, cache, steps: int) -> float:
    """Median milliseconds of `steps` decode steps, each appending one token to `seq`."""
    times = []
    for _ in range(steps):
        seq.token_ids.append(7)
        cache.ensure_capacity(seq)
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
        cache.commit(seq, len(seq))
    return statistics.median(times) * 1e3


def add_compile_options_arguments(parser: argparse.ArgumentParser) -> None:
    """`python -m inference_core compile-options`'s flags."""
    parser.add_argument("--model", default="bundled")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--layout", default="auto",
                        help="weight layout: auto, out_in, in_out or packed (see model.Linear)")
    parser.add_argument("--options", default=",".join(OPTION_SETS), help="option sets to try, comma-separated")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--json", dest="json_path")


def run_compile_options(args: argparse.Namespace) -> int:
    loaded = load_model(args.model, "cpu", args.dtype, layout=args.layout)
    layout = loaded.model.lm_head.layout
    cache = make_kv_cache(loaded, EngineConfig(kv_mode="contiguous", max_num_seqs=1), 1024)
    runner = ModelRunner(loaded.model, cache, loaded.device)
    seq = Sequence(list(range(1000, 1200)))
    cache.allocate(seq)
    runner.run([seq])
    rows = [{"options": "eager", "step_ms": round(time_steps(lambda: runner.run([seq], [1]), seq, cache,
                                                             args.steps), 2)}]
    print(f"{loaded.name} {args.dtype} ({layout} weights): eager {rows[0]['step_ms']} ms/step", flush=True)

    def fresh_compile(name: str) -> tuple[CompiledDecoder, float]:
        """A decoder with option set `name`, compiled after dynamo has forgotten every graph, and its seconds."""
        torch._dynamo.reset()
        decoder = CompiledDecoder(loaded.model, cache, loaded.device, 1, 1024, options=OPTION_SETS[name],
                                  backend="torch.compile")
        started = time.perf_counter()
        decoder.warm_up(1)
        return decoder, time.perf_counter() - started

    for name in args.options.split(","):
        seq.token_ids[200:] = []  # every option set decodes from the same context as eager did
        cache.commit(seq, 200)
        _, cold_s = fresh_compile(name)
        decoder, warm_s = fresh_compile(name)  # again: what inductor's caches save
        step_ms = time_steps(lambda: decoder.run([seq]), seq, cache, args.steps)
        rows.append({"options": name, "settings": OPTION_SETS[name], "compile_s": round(cold_s, 1),
                     "second_compile_s": round(warm_s, 1), "step_ms": round(step_ms, 2),
                     "speedup_vs_eager": round(rows[0]["step_ms"] / step_ms, 2)})
        print(f"  {name}: compile {cold_s:.1f} s (again {warm_s:.1f} s), {step_ms:.2f} ms/step, "
              f"{rows[0]['step_ms'] / step_ms:.2f}x eager", flush=True)
    write_report({"model": loaded.name, "dtype": args.dtype, "layout": layout, "context_tokens": 200,
                  "machine": machine_info(loaded.device), "rows": rows}, args.json_path)
    return 0

