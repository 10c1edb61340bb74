"""`python -m inference_core batch-bench`: one set of requests with arrival times through each of our batching modes
and through Hugging Face transformers `generate` (one request at a time, and in static left-padded batches), in one
process on one device, reporting throughput and the TTFT and latency that a user sees.

Method. N requests cycle through the prompt file's prompts (chat template applied as in `bench`), greedy, ending at
end-of-sequence or after their own output length: --max-new-tokens for all, or --output-lengths (`uniform:A-B`, each
request's drawn from a seeded RNG, or a list `16,64,256` cycled through), which is how random-weight checkpoints (whose
answers never end) still show what continuous batching gains when requests finish at different times. Arrivals: `burst`
(all at t=0) or `poisson:RATE` (exponential gaps of mean 1/RATE s from a seeded RNG, the first at t=0); every row gets
the same schedule. A mode may name its `join_every` (`continuous+join16`: waiting requests join a running batch at most
every 16 steps; `EngineConfig.join_every`). Our modes each get a fresh engine (paged KV; the pool, by default, holds
--max-num-seqs requests of the longest prompt plus --max-new-tokens; the prefix cache off, so a repeated prompt is
computed again as transformers computes it: batching alone is compared); the driver submits each request when its
arrival time comes and steps the engine in between. transformers rows start a request no earlier than its arrival:
`hf-sequential` one after another; `hf-static` a batch of the requests that have arrived (up to --max-num-seqs) once the
previous batch has finished. Every row runs one untimed warm-up first (the first --max-num-seqs requests, 4 new tokens).
Per request, wall clock: TTFT = arrival -> first token, latency = arrival -> last token (ours: when the engine emits the
token; transformers: read by a stopping criterion after every forward, so a row's last token is the forward that
produced it, not the end of its batch). Throughput = all output tokens / (last completion - first arrival).
`mean_batch_size`: ours, sequences per engine step; transformers, rows per forward (finished rows of a batch included:
transformers keeps computing them). TPOT, goodput and SLO attainment come from the same per-request records, under the
targets --slo-ttft-ms and --slo-tpot-ms (definitions in `inference_core.bench.latency`). `--rates` runs the whole bench
once per Poisson rate and lists every row at every rate in `sweep`: throughput against p95 latency per mode, the
frontier on which a person picks a mode and a rate (drawn by `ui.frontier`).

`--spec METHOD` (with `--spec-k`) runs each of our modes a second time with every request speculating
(`<mode> + METHOD k=K`, a fresh engine too, its query steps compiled before the timed run under --compile), so a batch
of speculating requests is measured beside the same batch without: the report's `speculation` gives each such row's
throughput over its mode's and its acceptance. `--kinds` keeps the prompt file's prompts of those kinds (grounded
prompts, where prompt lookup finds its drafts).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import time
from pathlib import Path

import torch

from inference_core.bench.latency import (SLO_KEYS, LatencyTargets, Timing, parse_rates, percentile,
                                          slo_summary)
from inference_core.bench.batch_table import format_header, format_row, format_sweep
from inference_core.bench.prompts import DEFAULT_PROMPTS, load_prompts
from inference_core.bench.speed import forward_clock, load_hf_model, machine_info, write_report
from inference_core.config import BATCHING_MODES, ConfigError, EngineConfig
from inference_core.engine.engine import Engine, StepReport
from inference_core.engine.request import FinishEvent, TokenEvent
from inference_core.model.checkpoint import resolve_model_dir
from inference_core.model.loader import LoadedModel, add_model_arguments, load_model
from inference_core.quant.linear import ACTIVATIONS, SCHEMES, QuantConfig
from inference_core.quant.quantize import quantize
from inference_core.sampling import SamplingParams
from inference_core.spec.decoding import SPEC_METHODS, SpecConfig

PEERS = ("hf-sequential", "hf-static")
ROW_KEYS = ("name", "requests", "output_tokens", "throughput_tokens_per_s", "ttft_ms_p50", "ttft_ms_p95",
            "latency_ms_p50", "latency_ms_p95", "preemptions", "mean_batch_size") + SLO_KEYS
WARMUP_TOKENS = 4


def parse_arrivals(arrival: str, count: int, seed: int) -> list[float]:
    """Arrival offsets in seconds from the first request's arrival (t=0)."""
    if arrival == "burst":
        return [0.0] * count
    kind, _, rate_text = arrival.partition(":")
    try:
        rate = float(rate_text)
    except ValueError:
        rate = 0.0
    if kind != "poisson" or not rate > 0:
        raise ConfigError(f"unknown --arrival {arrival!r}; use burst or poisson:RATE with RATE > 0 requests/s.")
    rng = random.Random(seed)
    offsets = [0.0]
    for _ in range(count - 1):
        offsets.append(offsets[-1] + rng.expovariate(rate))
    return offsets


def parse_output_lengths(spec: str | None, count: int, max_new_tokens: int, seed: int) -> list[int]:
    """Each request's max_new_tokens: `max_new_tokens` for all (spec None), `uniform:A-B` (seeded), or a
    comma-separated list cycled through."""
    if spec is None:
        return [max_new_tokens] * count
    words = "use --output-lengths uniform:A-B (1 <= A <= B) or a list like 16,64,256."
    kind, _, bounds = spec.partition(":")
    try:
        if kind == "uniform":
            low, high = (int(part) for part in bounds.split("-"))
            if not 1 <= low <= high:
                raise ValueError
            rng = random.Random(seed)
            return [rng.randint(low, high) for _ in range(count)]
        lengths = [int(part) for part in spec.split(",")]
    except ValueError:
        raise ConfigError(f"bad --output-lengths {spec!r}; {words}") from None
    if not lengths or min(lengths) < 1:
        raise ConfigError(f"bad --output-lengths {spec!r}; {words}")
    return [lengths[i % len(lengths)] for i in range(count)]


def run_engine(engine: Engine, prompts: list[list[int]], offsets: list[float], lengths: list[int] | int,
               reports: list[StepReport] | None = None, spec: SpecConfig | None = None):
    """Submit each request at its arrival time (with its own max_new_tokens, `lengths`; speculating with `spec`)
    and step the engine until all are done. Returns the timings and the batch size of every engine step that ran
    work; `reports`, where given, gets those steps' reports; each timing's `spec`, the request's speculative
    statistics."""
    if isinstance(lengths, int):
        lengths = [lengths] * len(prompts)
    start = time.perf_counter()
    timings = [Timing(start + offset) for offset in offsets]
    batch_sizes: list[int] = []

    def listener(timing: Timing):
        def on_event(request, event) -> None:  # called inside engine.step(), as each event is produced
            now = time.perf_counter()
            if isinstance(event, TokenEvent) and math.isnan(timing.first_token):
                timing.first_token = now
            elif isinstance(event, FinishEvent):
                timing.last_token, timing.output_tokens = now, len(event.token_ids)
                timing.preemptions = event.stats.preemptions
                timing.spec = event.stats.spec
        return on_event

    submitted = 0
    while submitted < len(prompts) or engine.has_work():
        # 1. Submit every request whose arrival time has come; after the last one, nothing more is coming.
        while submitted < len(prompts) and timings[submitted].arrival <= time.perf_counter():
            params = SamplingParams(max_new_tokens=lengths[submitted])
            engine.submit(prompts[submitted], params, spec=spec).listener = listener(timings[submitted])
            submitted += 1
            if submitted == len(prompts):
                engine.drain()
        # 2. Step when a step makes progress now; else sleep until the next arrival or the end of the batch window.
        wait_s = engine.seconds_until_ready() if engine.has_work() else math.inf
        if wait_s == 0:
            report = engine.step()
            if report.batch_size:
                batch_sizes.append(report.batch_size)
                if reports is not None:
                    reports.append(report)
            continue
        next_arrival_s = timings[submitted].arrival - time.perf_counter() if submitted < len(prompts) else math.inf
        if math.isinf(wait_s) and math.isinf(next_arrival_s):
            raise RuntimeError("the engine holds requests it will never start; this is a scheduler bug.")
        time.sleep(max(0.0, min(wait_s, next_arrival_s)))
    return timings, batch_sizes


class HFPeer:
    """transformers `generate` on the same weights: greedy, end-of-sequence ends a row, left-padded batches, the
    clock read after every forward by a stopping criterion."""

    def __init__(self, loaded: LoadedModel, model_dir: Path):
        self.model = load_hf_model(loaded, model_dir)
        self.device = loaded.device
        self.eos_ids = sorted(loaded.eos_token_ids)
        self.forward_times: list[float] = []
        self.clock = forward_clock(self.forward_times)

    def generate(self, prompts: list[list[int]], timings: list[Timing], lengths: list[int]) -> list[int]:
        """Run one batch until its longest output length; fill each row's timing, counting its tokens up to its own
        length or end-of-sequence. Returns the batch size of every forward."""
        width = max(len(ids) for ids in prompts)
        pad = self.eos_ids[0]  # any id: padded positions are masked out
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        self.forward_times.clear()
        output = self.model.generate(ids, attention_mask=mask, max_new_tokens=max(lengths), do_sample=False,
                                     eos_token_id=self.eos_ids, pad_token_id=pad, stopping_criteria=[self.clock])
        for row, timing, length in zip(output[:, width:].tolist(), timings, lengths):
            # Tokens up to and including the first end-of-sequence (later ones are transformers' padding).
            count = next((i + 1 for i, token in enumerate(row) if token in self.eos_ids), len(row))
            count = min(count, length)
            timing.first_token, timing.last_token = self.forward_times[0], self.forward_times[count - 1]
            timing.output_tokens = count
        return [len(prompts)] * len(self.forward_times)


def run_hf(peer: HFPeer, name: str, prompts: list[list[int]], offsets: list[float], lengths: list[int] | int,
           max_num_seqs: int):
    """hf-sequential: one request at a time; hf-static: batches of what has arrived, each after the previous one
    (a batch runs until its longest output length: transformers keeps computing finished rows)."""
    if isinstance(lengths, int):
        lengths = [lengths] * len(prompts)
    batch_limit = 1 if name == "hf-sequential" else max_num_seqs
    start = time.perf_counter()
    timings = [Timing(start + offset) for offset in offsets]
    batch_sizes: list[int] = []
    first = 0
    while first < len(prompts):
        # 1. Nothing has arrived: wait for the next request.
        time.sleep(max(0.0, timings[first].arrival - time.perf_counter()))
        # 2. The batch: the requests that have arrived, up to the limit, in arrival order.
        end = first + 1
        now = time.perf_counter()
        while end < len(prompts) and end - first < batch_limit and timings[end].arrival <= now:
            end += 1
        batch_sizes += peer.generate(prompts[first:end], timings[first:end], lengths[first:end])
        first = end
    return timings, batch_sizes


def step_kinds(reports: list[StepReport]) -> dict:
    """A timed run's engine steps by what they ran: decodes only, prefill chunks only, or both in one forward
    (`mixed`; and `other`, speculative work): for each, the steps, their median milliseconds, their mean batch and
    their share of the run's step time. Where a mode's time goes: on a GPU a mixed step runs eager even where decode
    steps run compiled."""
    groups: dict[str, list[StepReport]] = {}
    for report in reports:
        kinds = {kind for _, kind, _ in report.work}
        name = "decode" if kinds == {"decode"} else "prefill" if kinds == {"prefill"} else \
            "mixed" if kinds == {"decode", "prefill"} else "other"
        groups.setdefault(name, []).append(report)
    total_ms = sum(report.duration_ms for report in reports) or 1.0
    return {name: {"steps": len(group), "median_ms": round(statistics.median(r.duration_ms for r in group), 2),
                   "mean_batch": round(statistics.mean(r.batch_size for r in group), 1),
                   "time_pct": round(100 * sum(r.duration_ms for r in group) / total_ms, 1)}
            for name, group in sorted(groups.items())}


def format_step_kinds(name: str, kinds: dict) -> str:
    return f"{name} steps: " + "; ".join(
        f"{kind} {entry['steps']} (median {entry['median_ms']:.1f} ms, mean batch {entry['mean_batch']:.1f}, "
        f"{entry['time_pct']:.0f}% of the time)" for kind, entry in kinds.items())


def summarize(name: str, timings: list[Timing], batch_sizes: list[int], targets: LatencyTargets | None = None) -> dict:
    """A row, by ROW_KEYS, from the row's per-request records: every figure, goodput included, from the same
    `timings` (goodput over the throughput's wall clock; see `inference_core.bench.latency`)."""
    ttft = [(t.first_token - t.arrival) * 1e3 for t in timings]
    latency = [(t.last_token - t.arrival) * 1e3 for t in timings]
    output_tokens = sum(t.output_tokens for t in timings)
    wall_s = max(t.last_token for t in timings) - min(t.arrival for t in timings)
    return {"name": name, "requests": len(timings), "output_tokens": output_tokens,
            "throughput_tokens_per_s": round(output_tokens / wall_s, 2),
            "ttft_ms_p50": round(percentile(ttft, 50), 1), "ttft_ms_p95": round(percentile(ttft, 95), 1),
            "latency_ms_p50": round(percentile(latency, 50), 1), "latency_ms_p95": round(percentile(latency, 95), 1),
            "preemptions": sum(t.preemptions for t in timings),
            "mean_batch_size": round(statistics.mean(batch_sizes), 2) if batch_sizes else 0.0,
            **slo_summary(ttft, latency, [t.output_tokens for t in timings], wall_s, targets)}


def add_batch_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """`python -m inference_core batch-bench`'s flags."""
    parser.add_argument("--prompts", help="JSONL prompt file (default: the packaged benchmark prompts)")
    parser.add_argument("--requests", type=int, default=32, help="requests, cycling through the prompts")
    add_model_arguments(parser)
    parser.add_argument("--max-new-tokens", type=int, default=64, help="every request's output length (see "
                        "--output-lengths)")
    parser.add_argument("--output-lengths", help="each request's own output length: uniform:A-B (seeded by --seed) "
                        "or a list like 16,64,256 cycled through (default: --max-new-tokens for all)")
    parser.add_argument("--peer-requests", type=int, help="transformers rows run only the first N requests (one "
                        "request at a time, 256 take long; its tokens/s does not depend on how many)")
    parser.add_argument("--arrival", default="burst",
                        help="burst (all at t=0) or poisson:RATE (RATE requests/s, seeded)")
    parser.add_argument("--modes", default="none,static,dynamic,continuous",
                        help="our batching modes, comma-separated (continuous+joinN: waiting requests join a running "
                        "batch at most every N steps)")
    parser.add_argument("--peers", default="hf-sequential,hf-static",
                        help="transformers rows, comma-separated, from: hf-sequential, hf-static ('' for none)")
    parser.add_argument("--max-num-seqs", type=int, default=8, help="batch size limit (ours and hf-static)")
    parser.add_argument("--spec", choices=[m for m in SPEC_METHODS if m != "none"],
                        help="also run each of our modes with every request speculating by this method")
    parser.add_argument("--spec-k", type=int, default=None,
                        help="draft length of --spec (default: the best measured for the source, `spec.defaults`)")
    parser.add_argument("--spec-tree-width", type=int, default=None,
                        help="candidates a draft position for Medusa and EAGLE (default: the best measured for the "
                        "source, as the lane's; 1: a chain)")
    parser.add_argument("--no-spec-tree-prune", dest="spec_tree_prune", action="store_false",
                        help="verify every node of the tree, not only those the drafter is confident of")
    parser.add_argument("--kinds", help="only the prompt file's prompts of these kinds, comma-separated (e.g. "
                        "grounded)")
    parser.add_argument("--kv-cache-tokens", type=int,
                        help="paged pool size (default: max-num-seqs requests of the longest prompt)")
    parser.add_argument("--compile", action="store_true", help="our modes decode through the compiled step (CUDA "
                        "graphs on a GPU)")
    parser.add_argument("--quant", choices=SCHEMES, default="none",
                        help="our rows' weights, as `generate --quant` (the transformers rows keep the model's)")
    parser.add_argument("--quant-group", type=int, default=32, help="int4: input features per scale and zero")
    parser.add_argument("--quant-activations", choices=ACTIVATIONS, default="model",
                        help="int4 weights by the activations in the model dtype (model) or rounded to int8 (int8: "
                             "our CPU kernel)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrival times and output lengths")
    parser.add_argument("--slo-ttft-ms", type=float, help="TTFT target: with --slo-tpot-ms, a request meeting both "
                        "counts toward goodput_requests_per_s and slo_attainment_pct (without targets they are null)")
    parser.add_argument("--slo-tpot-ms", type=float, help="time-per-output-token target: (latency - TTFT) / (output "
                        "tokens - 1); a one-token answer meets it")
    parser.add_argument("--rates", help="a request-rate sweep: the whole bench once per Poisson rate, like "
                        "0.5,1,2,4 (requests/s, arrivals poisson:RATE from --seed); the JSON gets a `sweep` list")
    parser.add_argument("--json", dest="json_path", help="write the results here")


def speculative_rows(modes: list[str], spec: SpecConfig | None) -> list[tuple[str, str, SpecConfig | None]]:
    """Our rows in order as (row name, mode, the requests' speculative settings): each mode, and with `spec` after
    it the same mode with every request speculating."""
    rows = []
    for mode in modes:
        rows.append((mode, mode, None))
        if spec is not None:
            wide = f" {spec.tree_width} wide" + ("" if spec.tree_prune else ", every node") if spec.tree_width > 1 \
                else ""
            rows.append((f"{mode} + {spec.method} k={spec.k}{wide}", mode, spec))
    return rows


def speculation_summary(row: dict, plain: dict | None, timings: list[Timing]) -> dict:
    """A speculative row against its mode's plain row (None: not run): the throughput ratio, and the acceptance
    over all its requests (drafted and accepted tokens added up, as spec-bench does)."""
    stats = [t.spec for t in timings if t.spec]
    drafted, accepted = sum(s["drafted"] for s in stats), sum(s["accepted"] for s in stats)
    verifications = sum(s["steps"] for s in stats)
    return {"ratio": round(row["throughput_tokens_per_s"] / plain["throughput_tokens_per_s"], 3) if plain else None,
            "acceptance_rate": round(accepted / drafted, 3) if drafted else 0.0,
            "mean_accepted_length": round((accepted + verifications) / verifications, 2) if verifications else 0.0,
            "verifications": verifications,
            # request-steps taken without drafting, where plain steps measured faster (`spec.pays`)
            "plain_steps": sum(s["plain_steps"] for s in stats),
            # request-steps whose drafts were shortened to fit the group's verification (`Engine.drafts_that_fit`)
            "fitted_steps": sum(s["fitted_steps"] for s in stats)}


def mode_settings(name: str) -> dict | None:
    """A batch-bench row of ours as engine settings: a batching mode, or `continuous+joinN` (N >= 1); None where
    the name is neither."""
    if name in BATCHING_MODES:
        return {"batching": name}
    every = name.removeprefix("continuous+join")
    if name.startswith("continuous+join") and every.isdigit() and int(every) >= 1:
        return {"batching": "continuous", "join_every": int(every)}
    return None


def run_batch_bench(args) -> int:
    modes = [mode.strip() for mode in args.modes.split(",") if mode.strip()]
    peers = [peer.strip() for peer in args.peers.split(",") if peer.strip()]
    if unknown := [m for m in modes if mode_settings(m) is None] + [p for p in peers if p not in PEERS]:
        raise ConfigError(f"unknown batch-bench row {unknown[0]!r}; --modes takes {', '.join(BATCHING_MODES)} (and "
                          f"continuous+joinN: join a running batch at most every N steps) and "
                          f"--peers {', '.join(PEERS)}.")
    if not modes and not peers:
        raise ConfigError("nothing to bench: name rows with --modes or --peers.")
    if args.requests < 1 or args.max_new_tokens < 1 or args.max_num_seqs < 1 or (args.peer_requests or 1) < 1:
        raise ConfigError("batch-bench needs --requests, --max-new-tokens, --max-num-seqs and --peer-requests of at "
                          "least 1.")
    if args.rates is not None and args.arrival != "burst":
        raise ConfigError("--rates sets the arrivals (poisson:RATE for each rate); drop --arrival.")
    rates = parse_rates(args.rates) if args.rates is not None else None
    offsets = parse_arrivals(args.arrival, args.requests, args.seed)
    lengths = parse_output_lengths(args.output_lengths, args.requests, args.max_new_tokens, args.seed)
    targets = LatencyTargets(args.slo_ttft_ms, args.slo_tpot_ms)
    rows = load_prompts(args.prompts or DEFAULT_PROMPTS)  # a bad file fails before the model loads
    if args.kinds:
        kinds = [kind.strip() for kind in args.kinds.split(",") if kind.strip()]
        rows = [row for row in rows if row["kind"] in kinds]
        if not rows:
            raise ConfigError(f"no prompts of kind {', '.join(kinds)} in {args.prompts or DEFAULT_PROMPTS}.")
    spec = SpecConfig(method=args.spec, k=args.spec_k, tree_width=args.spec_tree_width,
                      tree_prune=args.spec_tree_prune) if args.spec else None  # checked before the model loads
    quant = QuantConfig(args.quant, args.quant_group, activations=args.quant_activations)
    loaded = quantize(load_model(args.model, args.device, args.dtype), quant)
    settings = {"arrival": args.arrival, "seed": args.seed, "prompts": str(args.prompts or DEFAULT_PROMPTS),
                "kinds": args.kinds, "output_lengths": args.output_lengths}
    common = dict(kv_cache_tokens=args.kv_cache_tokens, compile=args.compile, peer_requests=args.peer_requests,
                  settings=settings, targets=targets, spec=spec)
    model_dir = resolve_model_dir(args.model)
    if rates is None:
        report = batch_bench(loaded, model_dir, rows, offsets, lengths, modes, peers, args.max_num_seqs, **common,
                             json_path=args.json_path)
    else:
        report = rate_sweep(loaded, model_dir, rows, rates, args.seed, lengths, modes, peers, args.max_num_seqs,
                            **common)
    write_report(report, args.json_path)
    return 0


def rate_sweep(loaded: LoadedModel, model_dir: Path, prompt_rows: list[dict], rates: list[float], seed: int,
               lengths: list[int], modes: list[str], peers: list[str], max_num_seqs: int,
               settings: dict | None = None, **options) -> dict:
    """`--rates`: the whole bench once per Poisson rate (the same seed, so a higher rate packs the same gaps
    closer), then one `sweep` row per row and rate: the frontier of throughput against p95 latency."""
    runs = []
    for rate in rates:
        arrival = f"poisson:{rate:g}"
        offsets = parse_arrivals(arrival, len(lengths), seed)
        runs.append(batch_bench(loaded, model_dir, prompt_rows, offsets, lengths, modes, peers, max_num_seqs,
                                settings={**(settings or {}), "arrival": arrival}, **options))
    sweep = [{"rate_requests_per_s": rate, **row} for rate, run in zip(rates, runs) for row in run["rows"]]
    sweep.sort(key=lambda row: ((modes + peers).index(row["name"]), row["rate_requests_per_s"]))
    report = {"arguments": {**runs[0]["arguments"], "arrival": None, "rates": rates}, "machine": runs[0]["machine"],
              "prompt_tokens": runs[0]["prompt_tokens"], "output_lengths": lengths, "sweep": sweep,
              "runs": [{"rate_requests_per_s": rate, "arrivals_s": run["arrivals_s"], "rows": run["rows"],
                        "steps": run["steps"], "left_out": run["left_out"]} for rate, run in zip(rates, runs)]}
    print(format_sweep(report), flush=True)
    return report


def batch_bench(loaded: LoadedModel, model_dir: Path, prompt_rows: list[dict], offsets: list[float],
                lengths: list[int], modes: list[str], peers: list[str], max_num_seqs: int,
                kv_cache_tokens: int | None = None, compile: bool = False, peer_requests: int | None = None,
                settings: dict | None = None, deadline: float = math.inf,
                targets: LatencyTargets | None = None, json_path: str | None = None,
                spec: SpecConfig | None = None) -> dict:
    """Every row of one batch-bench run on a loaded model; prints each row as it is measured, and writes the report
    so far to `json_path` after each (a run stopped part-way keeps the rows it finished). A row not started by
    `deadline` (time.perf_counter) is listed in `left_out`. `targets`: the latency targets goodput counts. `spec`:
    each mode again with every request speculating (`speculative_rows`)."""
    tokenizing = Engine(loaded, EngineConfig(kv_mode="none"))  # holds no KV memory
    distinct = [tokenizing.prompt_ids(row["prompt"], row.get("system"), chat=row["kind"] != "completion")
                for row in prompt_rows]
    prompts = [distinct[i % len(distinct)] for i in range(len(offsets))]
    block_size = EngineConfig().block_size
    longest_blocks = math.ceil((max(map(len, prompts)) + max(lengths)) / block_size)
    kv_cache_tokens = kv_cache_tokens or max_num_seqs * longest_blocks * block_size
    warmup = (prompts[:max_num_seqs], [0.0] * min(max_num_seqs, len(prompts)), WARMUP_TOKENS)
    if spec is not None:  # the draft length a request leaving k open gets in this setup (`spec.defaults`)
        spec = Engine(loaded, EngineConfig(kv_mode="paged", kv_cache_tokens=block_size, compile=compile)
                      ).resolve_spec(spec)
    machine = {**machine_info(loaded.device), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
               "cpu_count": os.cpu_count()}
    peer_count = min(peer_requests or len(prompts), len(prompts))
    arguments = {**(settings or {}), "requests": len(prompts), "max_new_tokens": max(lengths), "modes": modes,
                 "peers": peers, "peer_requests": peer_count, "max_num_seqs": max_num_seqs,
                 "kv_cache_tokens": kv_cache_tokens, "compile": compile, "model": loaded.name,
                 "quant": loaded.quant.name if loaded.quant else "none",
                 "spec": None if spec is None else {"method": spec.method, "k": spec.k},
                 "device": str(loaded.device), "dtype": str(loaded.dtype).removeprefix("torch."),
                 "slo_ttft_ms": targets.ttft_ms if targets else None,
                 "slo_tpot_ms": targets.tpot_ms if targets else None}
    report = {"arguments": arguments, "machine": machine, "arrivals_s": [round(s, 4) for s in offsets],
              "prompt_tokens": [len(ids) for ids in prompts], "output_lengths": lengths, "rows": [], "steps": {},
              "left_out": []}
    if spec is not None:
        report["speculation"] = {}
    print(format_header(report), flush=True)
    # 1. Our modes: a fresh engine each (no prefix cache: batching alone is compared), one warm-up, the timed run;
    # with `spec`, each mode again with every request speculating.
    for name, mode, row_spec in speculative_rows(modes, spec):
        if time.perf_counter() > deadline:
            report["left_out"].append(name)
            continue
        engine = Engine(loaded, EngineConfig(kv_mode="paged", max_num_seqs=max_num_seqs, **mode_settings(mode),
                                             kv_cache_tokens=kv_cache_tokens, prefix_cache=False, compile=compile))
        if engine.decoder is not None:  # every bucket's graphs compiled (or recorded) before the timed run
            engine.warm_up_compiled(tuple(engine.decoder.buckets), row_spec)
        run_engine(engine, *warmup, None, row_spec)
        steps: list[StepReport] = []
        timings, batch_sizes = run_engine(engine, prompts, offsets, lengths, steps, row_spec)
        report["rows"].append(summarize(name, timings, batch_sizes, targets))
        report["steps"][name] = step_kinds(steps)
        print(format_row(report["rows"][-1]), flush=True)
        if row_spec is not None:
            plain = next((row for row in report["rows"] if row["name"] == mode), None)
            report["speculation"][name] = entry = speculation_summary(report["rows"][-1], plain, timings)
            print(f"{name}: {entry['ratio']}x {mode}'s throughput, acceptance {entry['acceptance_rate']}, "
                  f"{entry['mean_accepted_length']} tokens a verification, {entry['plain_steps']} request-steps "
                  f"without drafting (plain steps measured faster), {entry['fitted_steps']} with drafts shortened to "
                  "fit the group's verification", flush=True)
        write_report(report, json_path, quiet=True)
        del engine  # its KV pool goes before the next one is made
    # 2. transformers: one model for both peers, a warm-up per row, the first `peer_count` requests.
    peer = HFPeer(loaded, model_dir) if peers and time.perf_counter() < deadline else None
    for name in peers:
        if peer is None or time.perf_counter() > deadline:
            report["left_out"].append(name)
            continue
        run_hf(peer, name, *warmup, max_num_seqs)
        timed = run_hf(peer, name, prompts[:peer_count], offsets[:peer_count], lengths[:peer_count], max_num_seqs)
        report["rows"].append(summarize(name, *timed, targets))
        print(format_row(report["rows"][-1]), flush=True)
        write_report(report, json_path, quiet=True)
    for mode, kinds in report["steps"].items():
        print(format_step_kinds(mode, kinds), flush=True)
    return report

