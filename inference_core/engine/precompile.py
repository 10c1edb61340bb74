"""`python -m inference_core precompile`: build one configuration's compiled steps into the disk cache ahead of use.

A compiled engine builds each of its steps on first use: the flat step (prompts and mixed steps) and one decode graph
per batch bucket (1, 2, 4, ... up to --max-num-seqs), each a compile of a minute or more on a CPU, kept on disk
(`compiled.compile_cache_dir`) for every later engine with the same model, shapes and options. This command builds
all of them at once, so that an engine only loads them: `python app.py` runs it in a background process for the
engine its chat and API serve (`serving.build`), and a container image can run it at build time. It takes the lane
flags `generate` takes (--compile is implied) and the engine's own --max-seq-len and --max-num-seqs.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from typing import Callable

from inference_core.config import EngineConfig
from inference_core.engine.compiled import batch_buckets, compile_cache_dir
from inference_core.engine.engine import Engine
from inference_core.model.loader import add_model_arguments, load_model
from inference_core.quant.quantize import quantize
from inference_core.settings import LaneSettings, add_setting_arguments

MAX_NUM_SEQS = EngineConfig().max_num_seqs  # the engine's default, the pool's engines'


def add_precompile_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_setting_arguments(parser)
    parser.add_argument("--quant-lm-head", action=argparse.BooleanOptionalAction, default=True,
                        help="quantize the LM head too (default: yes)")
    parser.add_argument("--max-seq-len", type=int, help="context length (default: the model's, at most 8192)")
    parser.add_argument("--max-num-seqs", type=int, default=MAX_NUM_SEQS,
                        help=f"sequences in one step: a decode graph is built for each of its buckets (default "
                             f"{MAX_NUM_SEQS}: {', '.join(map(str, batch_buckets(MAX_NUM_SEQS)))})")


def engine_for(loaded, settings: LaneSettings, max_seq_len: int | None, max_num_seqs: int = MAX_NUM_SEQS,
               quant_lm_head: bool = True) -> Engine:
    """The engine `settings` make on `loaded` (quantized as they say), as `serving.pool.EnginePool` makes it."""
    config = settings.engine_config(max_seq_len, max_num_seqs=max_num_seqs)
    return Engine(quantize(loaded, settings.quant(quant_lm_head)), config)


def build_all(engine: Engine, call: Callable = lambda function, *args: function(*args)) -> list[tuple[str, float]]:
    """Compile (or load from disk) every step `engine` can take: the flat step and each batch bucket's decode graph,
    one bucket a `call` (an engine loop's, to run each between its steps). Returns (step, seconds) in the order
    built."""
    times = []
    for size in batch_buckets(engine.config.max_num_seqs):
        started = time.perf_counter()
        call(engine.warm_up_compiled, (size,))  # the flat step comes with the first
        times.append((f"batch {size}" + (" and the flat step" if not times else ""), time.perf_counter() - started))
    return times


def run_precompile(args: argparse.Namespace) -> int:
    settings = replace(LaneSettings.from_args(args), compile=True)
    settings.quant(args.quant_lm_head)  # bad weight settings fail before the model loads
    settings.engine_config(args.max_seq_len, max_num_seqs=args.max_num_seqs)
    engine = engine_for(load_model(args.model, args.device, args.dtype), settings, args.max_seq_len,
                        args.max_num_seqs, args.quant_lm_head)
    started = time.perf_counter()
    for step, seconds in build_all(engine):
        print(f"{step}: {seconds:.1f} s", flush=True)
    stats = engine.compile_stats()
    print(f"{settings.describe()}: {stats['graphs']} steps ready in {time.perf_counter() - started:.0f} s "
          f"({stats['from_disk']} of them already on disk) in {compile_cache_dir()}", flush=True)
    return 0
