"""`python -m inference_core sampling-bench`: what reading the model's distribution and constraining its output cost
per decoded token.

Three pairs on one engine, each measured as decode tokens/s over the same number of tokens, A and B interleaved
round by round in alternating order (so a busy moment hits both), the median of each reported with the median of the
rounds' ratios:

- top-5 log-probabilities against none (`SamplingParams.logprobs=5`), at batch 1 and at batch 8, with the work
  log-probabilities add to a step timed on its own (`inference_core.logits.token_logprobs` on the batch's logits,
  the median of 50 calls) as a share of the step: a figure a busy host's step-to-step noise does not move;
- a JSON schema constraint against none, at batch 1: the constrained run goes first and ends when its JSON does;
  the unconstrained run then decodes exactly as many tokens (ignoring end-of-sequence), so both rates cover the same
  positions. The grammar's own time per token (`GenerationStats.grammar_ms`) is reported beside it.

Prints a table and writes JSON (`--json PATH`) with the host's features.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from inference_core.bench.speed import machine_info
from inference_core.config import EngineConfig
from inference_core.engine.engine import Engine
from inference_core.logits import RowContext, token_logprobs
from inference_core.model.loader import add_model_arguments, load_model
from inference_core.sampling import SamplingParams
from inference_core.structured import Constraint

PEOPLE = {"type": "array", "minItems": 6, "maxItems": 6,
          "items": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                                     "city": {"type": "string", "maxLength": 24}},
                    "required": ["name", "city"], "additionalProperties": False}}
PROMPT = "List six people and the city each lives in, as JSON."


def add_sampling_bench_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens per logprobs run")
    parser.add_argument("--rounds", type=int, default=5, help="A/B rounds per pair (medians reported)")
    parser.add_argument("--json", help="write the report here")


def _decode_rate(engine: Engine, prompts: list, params: SamplingParams) -> tuple[float, list]:
    """Submit every prompt at once, step to the end; the mean decode tokens/s of the requests and their stats."""
    requests = [engine.submit(prompt, params) for prompt in prompts]
    while engine.has_work():
        engine.step()
    stats = [request.events[-1].stats for request in requests]
    return statistics.mean(s.decode_tokens_per_s for s in stats), stats


def _pair(engine, rounds: int, run_a, run_b) -> dict:
    """Interleaved rounds after one untimed warm-up of each, the order alternating (AB, BA, ...): the medians, and
    the median of the rounds' B / A ratios (a slow drift of the host's speed cancels within a round)."""
    run_a(), run_b()
    a, b = [], []
    for round_index in range(rounds):
        first, second = (run_a, run_b) if round_index % 2 == 0 else (run_b, run_a)
        x, y = first(), second()
        a.append(x if first is run_a else y)
        b.append(y if first is run_a else x)
    return {"a": statistics.median(a), "b": statistics.median(b),
            "ratio": statistics.median(y / x for x, y in zip(a, b)), "a_runs": a, "b_runs": b}


def logprobs_ms(batch: int, vocab: int, top: int = 5, calls: int = 50) -> float:
    """The median time of computing top-`top` log-probabilities for `batch` rows of `vocab` logits, as the batched
    sampling step does (one log-softmax, top-k, entropy and host transfer)."""
    logits = torch.randn(batch, vocab)
    rows = [RowContext(SamplingParams(max_new_tokens=1, logprobs=top), [], 0)] * batch
    tokens = logits.argmax(-1).tolist()
    token_logprobs(logits, logits, rows, tokens)
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        token_logprobs(logits, logits, rows, tokens)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def run_sampling_bench(args) -> int:
    loaded = load_model(args.model, args.device, args.dtype)
    rows = []
    for batch in (1, 8):
        engine = Engine(loaded, EngineConfig(kv_mode="paged", max_num_seqs=batch, max_seq_len=1024))
        prompts = [f"Tell a short story about the number {i}." for i in range(batch)]
        plain = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
        with_logprobs = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True, logprobs=5)
        pair = _pair(engine, args.rounds, lambda: _decode_rate(engine, prompts, plain)[0],
                     lambda: _decode_rate(engine, prompts, with_logprobs)[0])
        step_ms = 1e3 / pair["a"]  # a decode step gives each of the batch's requests one token
        cost_ms = logprobs_ms(batch, loaded.config.vocab_size)
        rows.append({"what": "top-5 log-probabilities", "batch": batch, "tokens": args.max_new_tokens, **pair,
                     "in_step_ms": round(cost_ms, 3), "in_step_pct": round(100 * cost_ms / step_ms, 2)})
    engine = Engine(loaded, EngineConfig(kv_mode="paged", max_num_seqs=1, max_seq_len=1024))
    constrained = SamplingParams(max_new_tokens=400, constraint=Constraint("json_schema", json.dumps(PEOPLE)))
    _, (first,) = _decode_rate(engine, [PROMPT], constrained)
    free = SamplingParams(max_new_tokens=first.generated_tokens, ignore_eos=True)
    grammar_ms = []

    def run_constrained() -> float:
        rate, (stats,) = _decode_rate(engine, [PROMPT], constrained)
        grammar_ms.append(stats.grammar_ms / stats.generated_tokens)
        return rate

    pair = _pair(engine, args.rounds, lambda: _decode_rate(engine, [PROMPT], free)[0], run_constrained)
    rows.append({"what": "JSON schema constraint", "batch": 1, "tokens": first.generated_tokens,
                 "grammar_ms_per_token": statistics.median(grammar_ms), **pair})
    report = {"model": loaded.display_name, "dtype": loaded.dtype_name, "machine": machine_info(loaded.device),
              "rows": rows}
    print(format_table(report))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def format_table(report: dict) -> str:
    lines = [f"{report['model']} ({report['dtype']}), {report['machine']['processor']}, "
             f"{report['machine']['cpu_capability']}",
             "| what | batch | tokens | without (tok/s) | with (tok/s) | with / without | in the step | "
             "grammar ms/token |",
             "|---|---|---|---|---|---|---|---|"]
    for row in report["rows"]:
        grammar = f"{row['grammar_ms_per_token']:.3f}" if "grammar_ms_per_token" in row else "-"
        in_step = f"{row['in_step_ms']:.2f} ms ({row['in_step_pct']:.1f}%)" if "in_step_ms" in row else "-"
        lines.append(f"| {row['what']} | {row['batch']} | {row['tokens']} | {row['a']:.1f} | {row['b']:.1f} | "
                     f"{row['ratio']:.3f} | {in_step} | {grammar} |")
    return "\n".join(lines)
