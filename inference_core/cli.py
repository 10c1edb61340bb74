"""The command line, a stable contract other tools rely on: `python -m inference_core COMMAND [flags]`.

    generate       --prompt TEXT [--prompt TEXT ...] [--batching MODE] [--json] ...   (inference_core.generate)
    bench          [--prompts FILE] [--max-new-tokens N] [--repeats R] [--peer llama-cpp] [--json PATH] ...
    batch-bench    [--requests N] [--arrival burst|poisson:RATE] [--output-lengths uniform:A-B] [--spec ngram] ...
                   [--kinds grounded] [--json PATH] ...
    spec-bench     [--source ngram,early-exit,draft,medusa,eagle] [--spec-k 3,5] [--kinds chat,code] ...
    race           [--lanes paged,none] [--prompt-id ID] [--repeats R] [--json PATH] ...
    sampling-bench [--max-new-tokens N] [--rounds R] [--json PATH]
    profile        --prompt TEXT [generate's flags] [--steps N] [--trace PATH] [--kernels] [--json]
    quality        [--quant none,int8,int4] [--kv-dtype auto,int8] [--window N] [--no-agreement] [--json PATH] ...
    compile-options [--dtype D] [--options a,b] [--steps N] [--json PATH]
    precompile     [generate's lane flags] [--max-seq-len N] [--max-num-seqs N]
    awq            [--model M] [--quant-group 32] [--out PATH]
    gptq           [--model M] [--quant-group 32] [--no-act-order] [--no-on-awq] [--out PATH]
    verify-cache   [--model bundled|FILE.gguf]
    random-weights --preset qwen3-0.6b --out DIR [--dtype bfloat16] [--tokenizer DIR]
    memory-plan    [--kv paged] [--kv-dtype int8] [--quant int4] [--context N] [--check] [--json] ...
    gpu-report     --out DIR [--budget-s 480] [--device cuda] [--smoke] [--parts device,tests,decode,...]
    train-draft    --kind medusa|eagle [--model M] [--data FILE[,FILE...]] [--steps N] [--out PATH] ...

`COMMANDS` is the whole table: each command's flags and its body live beside the code it runs (`add_X_arguments` and
`run_X` there). Bad settings, and settings that do nothing together, exit with status 2 and a one-line message that
says what to change (a `ConfigError`).
"""

from __future__ import annotations

import argparse
import sys

from inference_core import generate, planner
from inference_core.bench import (
    batching,
    compile_options,
    gpu_report,
    profile,
    quality,
    race,
    sampling_cost,
    speculation,
    speed,
)
from inference_core.config import ConfigError
from inference_core.engine import precompile
from inference_core.model import bundled, random_weights
from inference_core.quant import calibrated_file
from inference_core.training import train_draft

# name: (one line of help, the function that adds its flags to a parser, the function that runs it and returns the
# exit status)
COMMANDS = {
    "generate": ("generate text for one or more prompts", generate.add_generate_arguments, generate.run_generate),
    "bench": ("our KV modes vs Hugging Face transformers (and llama.cpp) on the same prompts",
              speed.add_bench_arguments, speed.run_bench),
    "batch-bench": ("batching modes vs transformers on one request set with arrival times",
                    batching.add_batch_bench_arguments, batching.run_batch_bench),
    "spec-bench": ("speculative vs plain decoding by prompt kind", speculation.add_spec_bench_arguments,
                   speculation.run_spec_bench),
    "sampling-bench": ("what log-probabilities and a JSON schema constraint cost per decoded token",
                       sampling_cost.add_sampling_bench_arguments, sampling_cost.run_sampling_bench),
    "profile": ("where an engine step's time goes: N steps under the torch profiler, by category, and a trace",
                profile.add_profile_arguments, profile.run_profile),
    "train-draft": ("train Medusa heads or an EAGLE draft layer on the model's own answers",
                    train_draft.add_train_draft_arguments, train_draft.run_train_draft),
    "race": ("fairness of a race: each KV mode alone vs all of them interleaved", race.add_race_bench_arguments,
             race.run_race_bench),
    "quality": ("perplexity and greedy agreement of quantized weights and KV cache against the unquantized reference",
                quality.add_quality_arguments, quality.run_quality),
    "compile-options": ("which inductor options make the compiled decode step fastest here",
                        compile_options.add_compile_options_arguments, compile_options.run_compile_options),
    "precompile": ("build a configuration's compiled steps (every batch bucket, the flat step) into the disk cache",
                   precompile.add_precompile_arguments, precompile.run_precompile),
    "awq": ("calibrate AWQ int4 weights on the shipped text and save them (used by --quant awq)",
            calibrated_file.add_awq_arguments, calibrated_file.run_awq),
    "gptq": ("calibrate GPTQ int4 weights on the shipped text and save them (used by --quant gptq)",
             calibrated_file.add_gptq_arguments, calibrated_file.run_gptq),
    "verify-cache": ("re-hash a GGUF's converted cache against its manifest and convert again if a file differs",
                     bundled.add_verify_cache_arguments, bundled.run_verify_cache),
    "memory-plan": ("what a configuration weighs in memory, and how many sequences fit; --check: beside what the "
                    "engine allocates", planner.add_memory_plan_arguments, planner.run_memory_plan),
    "gpu-report": ("the whole stack on a GPU in one prepared run: tests, decode rows, batching, the serving path",
                   gpu_report.add_gpu_report_arguments, gpu_report.run_gpu_report),
    "random-weights": ("write a random-weight checkpoint at a real model's shapes, for speed benchmarks",
                       random_weights.add_random_weights_arguments, random_weights.run_random_weights),
}


def parser() -> argparse.ArgumentParser:
    """The command line's parser: one subcommand per row of COMMANDS."""
    top = argparse.ArgumentParser(prog="python -m inference_core", description=__doc__.split("\n\n")[0])
    commands = top.add_subparsers(dest="command", required=True)
    for name, (help_line, add_arguments, run) in COMMANDS.items():
        add_arguments(commands.add_parser(name, help=help_line))
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return COMMANDS[args.command][2](args)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
