"""`python -m inference_core bench`: our KV modes against Hugging Face transformers `generate`, same model, prompts,
device and dtype, in one process.

Method: one warm-up request per configuration (never timed); then for each repeat, each prompt runs under every
configuration in turn (interleaved, so slow drift of a shared machine hits all rows alike); each row reports the
median over its runs. Decode tokens/s counts the tokens after the first over the time from the first token to the
last; TTFT is the prompt's prefill plus the first sampling (the paged prefix cache is emptied before each run so TTFT
is a cold prompt). transformers is timed from inside `generate` by a stopping criterion that reads the clock after
every token. `roofline_pct` is decode tokens/s as a percentage of the memory-bandwidth limit: the read bandwidth this
script measures (summing a 1 GiB buffer, the best of 5 sums) over the bytes one decode step must read (weights plus
the KV of the average context). The bandwidth is probed before the runs and after every repeat, and the limit uses
the probes' median: a shared host's bandwidth moves during a run (on the 2-core development VM, between about 30 and
80 GB/s), and one probe taken at either moment would set the limit for the whole run. A compiled row adds
`roofline_pct_weights`: the same limit at the rate a sum over its package's weights, read in place, reaches at the
same moments (`CompiledDecoder.weight_memory`, where the package's weights lie in a buffer of ours: every projection
through our kernels; `weights_read_gb_s`, the median of those probes), since at one moment
the weights' memory and a fresh buffer read up to about 25% apart, in either direction, on that VM.
`roofline_pct_paired` pairs each timed run with the same probe taken right after it (on one 1 GiB buffer kept for
the whole bench): the median over the runs of each run's tokens/s against the limit its own probe sets, with the
runs' `roofline_pct_paired_range`, the runs' rates and the probes (`decode_tokens_per_s_runs`,
`read_probes_after_runs_gb_s`). On that VM the bandwidth moves for seconds at a time, so a run and the probe right
after it see the same memory more often than a run and a median taken over minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import time
from functools import partial
from pathlib import Path

import torch

from inference_core.bench import process_peers
from inference_core.bench.llama_bench import (GEN_TOKENS, PROMPT_TOKENS, SOURCES, llama_bench_binary, median_row,
                                              run_llama_bench)
from inference_core.bench.llama_cpp import PEERS, PeerUnavailable, absent_row, open_peers, peer_gguf_path
from inference_core.bench.prompts import DEFAULT_PROMPTS, load_prompts
from inference_core.config import ConfigError, EngineConfig
from inference_core.engine.engine import Engine
from inference_core.model.checkpoint import resolve_model_dir
from inference_core.model.dtype_choice import cpu_details, cpu_name
from inference_core.model import row_kernel
from inference_core.model.loader import LoadedModel, add_model_arguments, load_model
from inference_core.quant.linear import QuantConfig, fastest_quant, weight_bytes
from inference_core.quant.quantize import quantize
from inference_core.roofline import read_bandwidth, read_rate, synchronize, weights_read_per_step
from inference_core.sampling import SamplingParams

DEFAULT_PROMPT_IDS = ("chat-short-1", "code-2", "grounded-1", "long-2")
HF_ROW = "hf-transformers"


def paired_roofline_pct(runs: list[dict], bytes_per_step: float) -> tuple[float, list[float]]:
    """Each run's decode tokens/s as a percentage of the limit that the probe read right after it sets
    (`read_bytes_per_s` over `bytes_per_step`): their median, and their lowest and highest."""
    pcts = [100 * run["decode_tokens_per_s"] * bytes_per_step / run["read_bytes_per_s"] for run in runs]
    return statistics.median(pcts), [min(pcts), max(pcts)]


PROBE_BYTES = 1 << 30  # the bandwidth probe: a sum over a 1 GiB fp32 buffer, the best of PROBE_REPEATS
PROBE_REPEATS = 5


def measure_read_bandwidth(device: torch.device, size_bytes: int = PROBE_BYTES, repeats: int = PROBE_REPEATS) -> float:
    """Bytes per second that a full read of a large fp32 buffer achieves (best of `repeats`)."""
    return read_bandwidth(device, size_bytes, repeats)


def decode_bytes_per_step(loaded: LoadedModel, context_len: float) -> float:
    """Bytes one decode step reads: the weights (`roofline.weights_read_per_step`) plus K and V of the context in
    every layer."""
    return weights_read_per_step(loaded.model) + context_len * loaded.config.kv_bytes_per_token(loaded.dtype)


def load_hf_model(loaded: LoadedModel, model_dir: Path):
    """The same checkpoint as a transformers model, on our model's device and dtype: the peer of every benchmark."""
    from transformers import AutoModelForCausalLM  # optional dependency (requirements-tools.txt)

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=loaded.dtype).to(loaded.device)


def forward_clock(times: list[float]):
    """A transformers stopping criterion that never stops and appends the time after every forward to `times`
    (after synchronizing the device), which is how a benchmark times transformers `generate` from inside."""
    from transformers import StoppingCriteria  # optional dependency (requirements-tools.txt)

    class Clock(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            synchronize(input_ids.device)
            times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    return Clock()


class _HFRunner:
    """transformers `generate` on the same weights, greedy, end-of-sequence ignored, clock read after each token."""

    def __init__(self, loaded: LoadedModel, model_dir: Path):
        self.model = load_hf_model(loaded, model_dir)
        self.device = loaded.device
        self.token_times: list[float] = []
        self.clock = forward_clock(self.token_times)

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> dict:
        ids = torch.tensor([prompt_ids], device=self.device)
        self.token_times.clear()
        synchronize(self.device)
        start = time.perf_counter()
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                  do_sample=False, eos_token_id=None, pad_token_id=0, stopping_criteria=[self.clock])
        first, last = self.token_times[0], self.token_times[-1]
        return {"ttft_ms": (first - start) * 1e3, "prefill_tokens_per_s": len(prompt_ids) / (first - start),
                "decode_tokens_per_s": (len(self.token_times) - 1) / (last - first),
                "token_ids": out[0, len(prompt_ids):].tolist()}


def _run_ours(engine: Engine, prompt_ids: list[int], max_new_tokens: int) -> dict:
    engine.reset_prefix_cache()
    finish = engine.complete(prompt_ids, SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))
    return {"ttft_ms": finish.stats.ttft_ms, "prefill_tokens_per_s": finish.stats.prefill_tokens_per_s,
            "decode_tokens_per_s": finish.stats.decode_tokens_per_s, "token_ids": list(finish.token_ids)}


ALL_PEERS = PEERS + tuple(process_peers.PEERS)


def peer_list(value: str) -> list[str]:
    """`--peer a,b:p1+p2` -> ['a', 'b:p1+p2'], each a known bench peer (and precisions it has)."""
    names = [name.strip() for name in value.split(",") if name.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"no peer named in {value!r}; choose from: {', '.join(ALL_PEERS)}")
    for name in names:
        try:
            process_peers.parse_peer(name, ALL_PEERS)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    return names


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """`python -m inference_core bench`'s flags."""
    parser.add_argument("--prompts", help="JSONL prompt file (default: the packaged benchmark prompts)")
    parser.add_argument("--prompt-ids", help="comma-separated prompt ids to run (default: one per kind)")
    add_model_arguments(parser)
    parser.add_argument("--configs",
                        help="our configurations to run, comma-separated: a KV mode (none, contiguous, paged), "
                             "with '+compile' for compiled decode, '+stepsN' for N compiled decode steps a host round "
                             "trip (greedy), '+int8' or '+int4' for quantized weights and, with one of them, "
                             "'+float-lm-head' to keep the LM head in the model dtype, with int4 or int8 '+a8' for "
                             "int8 activations (default: paged, paged+compile+steps8 and the fastest quantized "
                             "configuration inside the quality table's limits on this machine: `default_configs`)")
    parser.add_argument("--quant-group", type=int, default=32, help="int4 rows: input features per scale and zero")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers row")
    parser.add_argument("--peer", type=peer_list, action="extend",
                        help="other engines on the same model, repeatable or comma-separated: llama-cpp (llama.cpp on "
                             "the same GGUF file, where llama-cpp-python is installed; reported as absent otherwise), "
                             "llama-bench (llama.cpp's own benchmark, tg128 and pp512; built once from "
                             "llama-cpp-python's source with CMake), ik-llama-bench (the same of the ik_llama.cpp "
                             "fork, with its run-time repacking; built from ik-llama-cpp-python's source), openvino "
                             "(OpenVINO GenAI on the GGUF file: f32, bf16), onnxruntime-genai (ONNX Runtime GenAI on "
                             "its builder's conversion: int4, int8, fp32), ctranslate2 (on its converter's "
                             "conversion: int8, int8_float32, float32, bfloat16); each of the last three in a "
                             "virtual environment of its own, installed from the package registry on first use; "
                             "NAME:P1+P2 runs those precisions only")
    parser.add_argument("--long-prompt-tokens", type=int, default=512,
                        help="every row also prefills a prompt of this many tokens (cold; 0: no such row), the "
                             "prompt llama-bench's pp test processes")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", dest="json_path", help="write the results here")


def default_configs(device: str) -> str:
    """bench's rows where --configs is not given: eager and compiled paged KV (8 decode steps a round trip), and on a
    CPU the fastest quantized configuration inside the quality table's limits (`quant.linear.fastest_quant`), so that
    a first `bench --peer ...` shows our best."""
    configs = ["paged", "paged+compile+steps8"]
    if device != "cpu":
        return ",".join(configs)
    best = fastest_quant(torch.device("cpu"))
    name = best.scheme + ("+a8" if best.activations == "int8" else "")
    return ",".join([*configs, f"paged+compile+{name}+steps8"])


def run_bench(args) -> int:
    if args.repeats < 1 or args.max_new_tokens < 2:
        raise ConfigError("bench needs --repeats >= 1 and --max-new-tokens >= 2.")
    if args.configs is None:
        auto = args.device in (None, "auto")
        args.configs = default_configs(("cuda" if torch.cuda.is_available() else "cpu") if auto else args.device)

    parsed = {name: parse_config(name, args.quant_group)
              for name in (part.strip() for part in args.configs.split(",")) if name}
    configs = {name: config for name, (config, _) in parsed.items()}
    schemes = {name: scheme for name, (_, scheme) in parsed.items()}
    rows = load_prompts(args.prompts or DEFAULT_PROMPTS)  # a bad file fails before the model loads
    loaded = load_model(args.model, args.device, args.dtype)
    models = {scheme: quantize(loaded, scheme) for scheme in set(schemes.values())}  # one copy per scheme
    engines = {name: Engine(models[schemes[name]], config) for name, config in configs.items()}
    compile_warmup, compile_rss = {}, {}
    for name, engine in engines.items():
        if engine.decoder is not None:
            before = resident_mib()
            compile_warmup[name] = round(engine.warm_up_compiled(), 2)
            compile_rss[name] = round(resident_mib() - before, 1)
    wanted = args.prompt_ids.split(",") if args.prompt_ids else DEFAULT_PROMPT_IDS
    by_id = {row["id"]: row for row in rows}
    chosen = [by_id[i] for i in wanted if i in by_id] or rows[:4]  # a custom file: its first prompts
    tokenizing = Engine(loaded, EngineConfig(kv_mode="none"))  # holds no KV memory
    prompts = [(row["id"], tokenizing.prompt_ids(row["prompt"], row.get("system"), chat=row["kind"] != "completion"))
               for row in chosen]
    runners = {name: (lambda ids, n, e=engine: _run_ours(e, ids, n)) for name, engine in engines.items()}
    if not args.no_hf:
        runners[HF_ROW] = _HFRunner(loaded, resolve_model_dir(args.model)).run
    long_ids = long_prompt(tokenizing, rows, args.long_prompt_tokens, min(
        engine.max_seq_len for engine in engines.values()) if engines else loaded.config.max_position_embeddings)
    peers, absent_peers = {}, []  # --peer llama-cpp: llama.cpp on the same GGUF file, or a row that says why not
    asked = [process_peers.parse_peer(name, ALL_PEERS) for name in args.peer or []]
    if args.peer:
        peers, absent_peers = open_peers([name for name, _ in asked if name in PEERS], args.model, max(
            [len(ids) for _, ids in prompts] + [len(long_ids)]) + args.max_new_tokens,
            loaded.config.kv_bytes_per_token(torch.float16))
    # --peer openvino, onnxruntime-genai, ctranslate2: each in its own environment and process (`process_peers`)
    others, absent_others = process_peers.open_process_peers(
        [(name, precisions) for name, precisions in asked if name in process_peers.PEERS], args.model,
        _model_dir(args.model), torch.get_num_threads(), loaded.config.kv_bytes_per_token(torch.float32) // 4)
    peers.update(others)
    absent_peers += absent_others
    runners.update({name: peer.run for name, peer in peers.items()})
    if not runners:
        raise ConfigError("nothing to bench: name KV modes with --configs or drop --no-hf.")
    # --peer llama-bench, ik-llama-bench: one run of each per repeat, interleaved with the rows above
    llama_benches, llama_bench_runs = {}, {}
    for peer, source in SOURCES.items():
        if peer not in (args.peer or []):
            continue
        try:
            gguf = peer_gguf_path(args.model)
            binary = llama_bench_binary(gguf, torch.get_num_threads(), source=source)  # built and checked, unclocked
            llama_benches[peer] = partial(run_llama_bench, gguf, torch.get_num_threads(),
                                          len(long_ids) or PROMPT_TOKENS, 1, binary, source)
            llama_bench_runs[peer] = []
        except PeerUnavailable as error:
            absent_peers.append(absent_row(args.model, str(error), peer))
            print(f"bench: {peer} absent: {error}", flush=True)
    print(f"bench: {loaded.name} on {loaded.device} in {str(loaded.dtype).removeprefix('torch.')}, "
          f"{len(prompts)} prompts x {args.repeats} repeats, {args.max_new_tokens} new tokens", flush=True)
    probes = [measure_read_bandwidth(loaded.device)]  # and one after every repeat: their median sets the limit
    # A compiled row's weights where its package holds them, read in place at the same moments (`weight_memory`).
    weight_views = {name: views for name, engine in engines.items()
                    if engine.decoder is not None and (views := engine.decoder.weight_memory())}
    weight_probes = {name: [read_rate(views)] for name, views in weight_views.items()}
    paired_buffer = [torch.ones(PROBE_BYTES // 4, device=loaded.device)]  # the probe read after every timed run
    # 1. Warm-up: one short request per configuration, never timed.
    for run in runners.values():
        run(prompts[0][1], 8)
    # 2. Timed runs, interleaved: repeat -> prompt -> configuration.
    results: dict[str, list[dict]] = {name: [] for name in runners}
    for repeat in range(args.repeats):
        for prompt_id, ids in prompts:
            for name, run in runners.items():
                results[name].append({**run(ids, args.max_new_tokens),
                                      "read_bytes_per_s": read_rate(paired_buffer, PROBE_REPEATS)})
            print(f"  repeat {repeat + 1}/{args.repeats}, {prompt_id}: " + ", ".join(
                f"{name} {results[name][-1]['decode_tokens_per_s']:.1f}" for name in runners) + " tok/s", flush=True)
        for peer, llama_bench in llama_benches.items():
            run = llama_bench()
            llama_bench_runs[peer].append(run)
            print(f"  repeat {repeat + 1}/{args.repeats}, {run['name']}: tg {run['decode_tokens_per_s']:.1f} tok/s, "
                  f"pp {run['prefill_long_tokens_per_s']:.0f} tok/s", flush=True)
        probes.append(measure_read_bandwidth(loaded.device))
        for name, views in weight_views.items():
            weight_probes[name].append(read_rate(views))
    # 3. The long prompt's prefill: every row, cold, interleaved like the runs above.
    long_prefill: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(args.repeats if long_ids else 0):
        for name, run in runners.items():
            long_prefill[name].append(run(long_ids, 2)["prefill_tokens_per_s"])
    for peer in others.values():  # its process ends with its input (and would with ours)
        peer.close()
    # Each peer's greedy tokens against transformers' (else our first row's), from the first repeat.
    reference = HF_ROW if HF_ROW in results else next(iter(engines), None)
    first_repeat = {name: {prompt_id: run.get("token_ids") for (prompt_id, _), run in zip(prompts, runs)}
                    for name, runs in results.items()}
    token_checks = {name: process_peers.token_check(first_repeat[name], first_repeat[reference], reference,
                                                    set(loaded.eos_token_ids))
                    for name in others if reference is not None}
    if long_ids:
        print(f"  {len(long_ids)}-token prompt: " + ", ".join(
            f"{name} {statistics.median(rates):.0f}" for name, rates in long_prefill.items()) + " prefill tok/s")
    # 4. Medians, roofline and speed-up over transformers.
    bandwidth = statistics.median(probes)
    mean_context = statistics.mean(len(ids) for _, ids in prompts) + args.max_new_tokens / 2
    limit = bandwidth / decode_bytes_per_step(loaded, mean_context)
    table = []
    for name, runs in results.items():
        decode = statistics.median(r["decode_tokens_per_s"] for r in runs)
        if name in peers:
            row_limit = bandwidth / peers[name].decode_bytes_per_step(mean_context)
            described = peers[name].describe()
            if name in token_checks:
                described["token_check"] = token_checks[name]
        else:
            row_model = engines[name].loaded if name in engines else loaded
            row_limit = bandwidth / decode_bytes_per_step(row_model, mean_context)  # a quantized model reads less
            described = {"name": name, "kv": "dynamic (transformers)" if name == HF_ROW else configs[name].kv_mode,
                         "quant": schemes[name].name if name in schemes else "none",
                         "weights_mib": round(weight_bytes(row_model.model) / 2**20, 1),
                         "compile": engines[name].compile_stats() if name in engines else None,
                         "compile_warmup_s": compile_warmup.get(name), "compile_rss_mib": compile_rss.get(name)}
        paired, paired_range = paired_roofline_pct(runs, bandwidth / row_limit)
        table.append({**described, "decode_tokens_per_s": round(decode, 2),
                      "ttft_ms": round(statistics.median(r["ttft_ms"] for r in runs), 1),
                      "prefill_tokens_per_s": round(statistics.median(r["prefill_tokens_per_s"] for r in runs), 1),
                      "prefill_long_tokens_per_s": round(statistics.median(long_prefill[name]), 1)
                      if long_prefill[name] else None,
                      "roofline_pct": round(100 * decode / row_limit, 1), "roofline_pct_paired": round(paired, 1),
                      "roofline_pct_paired_range": [round(pct, 1) for pct in paired_range],
                      "decode_tokens_per_s_runs": [round(run["decode_tokens_per_s"], 1) for run in runs],
                      "read_probes_after_runs_gb_s": [round(run["read_bytes_per_s"] / 1e9, 2) for run in runs],
                      "runs": len(runs)})
        if name in weight_probes:  # the same limit at the rate the weights' own memory was read
            rate = statistics.median(weight_probes[name])
            weights_limit = row_limit * rate / bandwidth  # the same bytes a step, read at that rate
            table[-1].update(weights_read_gb_s=round(rate / 1e9, 2),
                             weights_read_probes_gb_s=[round(probe / 1e9, 2) for probe in weight_probes[name]],
                             roofline_pct_weights=round(100 * decode / weights_limit, 1))
    peer_names = set(peers)
    for runs in llama_bench_runs.values():  # llama-bench on the same GGUF and threads: medians of its runs
        row = median_row(runs)
        row["roofline_pct"] = round(100 * row["decode_tokens_per_s"] / (bandwidth / (
            gguf.stat().st_size + GEN_TOKENS / 2 * loaded.config.kv_bytes_per_token(torch.float16))), 1)
        table.append(row)
        peer_names.add(row["name"])
    hf = next((row for row in table if row["name"] == HF_ROW), None)
    for row in table:
        row["speedup_vs_hf"] = round(row["decode_tokens_per_s"] / hf["decode_tokens_per_s"], 2) if hf else None
    table += absent_peers
    report = {"model": loaded.name, "device": str(loaded.device), "dtype": str(loaded.dtype).removeprefix("torch."),
              "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
              "prompts": [prompt_id for prompt_id, _ in prompts], "read_bandwidth_gb_s": round(bandwidth / 1e9, 2),
              "read_bandwidth_probes_gb_s": [round(probe / 1e9, 2) for probe in probes],
              "roofline_tokens_per_s": round(limit, 1), "long_prompt_tokens": len(long_ids),
              "machine": machine_info(loaded.device), "rows": table,
              "ours_vs_peers": _ours_vs_peers(table, set(engines), peer_names)}
    print(format_table(report))
    write_report(report, args.json_path)
    return 0


def _model_dir(model_spec: str) -> Path | None:
    """Our converted model directory for `model_spec` (what the peers that convert start from), or None."""
    try:
        return resolve_model_dir(model_spec)
    except (ConfigError, OSError, ValueError):
        return None


def long_prompt(tokenizing: Engine, rows: list[dict], tokens: int, context_len: int) -> list[int]:
    """The first `tokens` ids of the prompt file's texts one after another (plain text, no chat template), at most
    what a row's context holds with two new tokens; [] for 0 (no long-prompt row)."""
    tokens = min(tokens, context_len - 2)
    if tokens <= 0:
        return []
    ids: list[int] = []
    while len(ids) < tokens:
        ids += [token for row in rows for token in tokenizing.prompt_ids(row["prompt"], chat=False)]
    return ids[:tokens]


def _ours_vs_peers(table: list[dict], ours: set[str], peers: set[str]) -> list[dict]:
    """Our fastest row's decode tokens/s over each peer's, the ratio a peer comparison is about, and our fastest
    long-prompt prefill over the peer's where both were measured."""
    measured = [row for row in table if row["name"] in ours]
    if not measured:
        return []
    best = max(measured, key=lambda row: row["decode_tokens_per_s"])
    prefills = [row for row in measured if row.get("prefill_long_tokens_per_s")]
    best_prefill = max(prefills, key=lambda row: row["prefill_long_tokens_per_s"]) if prefills else None
    pairs = []
    for row in table:
        if row["name"] not in peers or row.get("absent"):
            continue
        pair = {"ours": best["name"], "peer": row["name"], "ours_decode_tokens_per_s": best["decode_tokens_per_s"],
                "peer_decode_tokens_per_s": row["decode_tokens_per_s"],
                "ratio": round(best["decode_tokens_per_s"] / row["decode_tokens_per_s"], 2)}
        if best_prefill and row.get("prefill_long_tokens_per_s"):
            pair.update(ours_prefill=best_prefill["name"],
                        ours_prefill_tokens_per_s=best_prefill["prefill_long_tokens_per_s"],
                        peer_prefill_tokens_per_s=row["prefill_long_tokens_per_s"],
                        prefill_ratio=round(best_prefill["prefill_long_tokens_per_s"]
                                            / row["prefill_long_tokens_per_s"], 2))
        pairs.append(pair)
    return pairs


def resident_mib() -> float:
    """This process's resident memory in MiB (Linux; 0 elsewhere): what compiling a graph adds (frozen weights are
    copied into each graph, prepacked)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def parse_config(name: str, group_size: int = 32) -> tuple[EngineConfig, QuantConfig]:
    """A bench row's name -> its engine config and weight quantization: a KV mode, with '+compile' for compiled
    decode, '+stepsN' for N compiled decode steps a host round trip, '+inductor-mm' for compiled decode with the
    matmuls inductor picks instead of our projection kernel (model.row_kernel), '+inductor-attention' with the
    attention inductor compiles instead of ours (model.attention_kernel), '+int8' or '+int4' for quantized weights
    and, with one of them, '+float-lm-head' to keep the LM head in the model dtype, with int4 or int8 '+a8' for
    int8 activations (model.w4a8_kernel; int8: `quant.kernels.int8_by_int8_mm`), '+kv-int8' or '+kv-int4' for a
    quantized KV cache (int8 eager only; e.g. paged+compile+int8, paged+compile+steps8,
    paged+compile+int4+a8+float-lm-head, paged+compile+kv-int4)."""
    kv_mode, *extras = name.split("+")
    quant = [extra for extra in extras if extra in ("int8", "int4")]
    kv_dtype = [extra[3:] for extra in extras if extra in ("kv-int8", "kv-int4")]
    steps = [int(extra[5:]) for extra in extras if re.fullmatch(r"steps\d+", extra)]
    if any(extra not in ("compile", "int8", "int4", "inductor-mm", "inductor-attention", "float-lm-head", "a8",
                         "kv-int8", "kv-int4")
           and not re.fullmatch(r"steps\d+", extra)
           for extra in extras) \
            or len(quant) > 1 or len(steps) > 1 or len(kv_dtype) > 1 or len(set(extras)) < len(extras) \
            or ("float-lm-head" in extras and not quant) or ("a8" in extras and not quant):
        raise ConfigError(f"unknown bench configuration {name!r}: use a KV mode (none, contiguous, paged), with "
                          "'+compile' for compiled decode, '+stepsN' for N decode steps a round trip, '+inductor-mm' "
                          "for inductor's matmuls instead of our projection kernel, '+inductor-attention' for "
                          "inductor's attention instead of our attention kernel, '+int8' or '+int4' for quantized "
                          "weights and, with one of them, '+float-lm-head' to keep the LM head in the model dtype, "
                          "with '+int4' or '+int8' '+a8' for int8 activations, '+kv-int8' or '+kv-int4' for a "
                          "quantized KV cache (e.g. paged+compile+int8).")
    return (EngineConfig(kv_mode=kv_mode, compile="compile" in extras, decode_steps=steps[0] if steps else 1,
                         kv_dtype=kv_dtype[0] if kv_dtype else "auto",
                         row_kernel="inductor-mm" not in extras, attention_kernel="inductor-attention" not in extras),
            QuantConfig(quant[0] if quant else "none", group_size, "float-lm-head" not in extras,
                        "int8" if "a8" in extras else "model"))


def write_report(report: dict, path: str | None, quiet: bool = False) -> None:
    """A benchmark's JSON report, written to `path` (folders made as needed; the file replaced whole, so a run
    stopped while writing leaves the last report) when one was given, and said unless `quiet`."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        partial = Path(path).with_name(Path(path).name + ".partial")
        partial.write_text(json.dumps(report, indent=2))
        os.replace(partial, path)
        if not quiet:
            print(f"wrote {path}")


def format_table(report: dict) -> str:
    long = f"{report['long_prompt_tokens']}-token prompt" if report.get("long_prompt_tokens") else "no long prompt"
    probes = report.get("read_bandwidth_probes_gb_s") or [report["read_bandwidth_gb_s"]]
    lines = [f"{report['model']} | {report['device']} | {report['dtype']} | read bandwidth "
             f"{report['read_bandwidth_gb_s']} GB/s (median of {len(probes)} probes, {min(probes)}-{max(probes)}) "
             f"-> decode limit {report['roofline_tokens_per_s']} tok/s",
             f"| config | decode tok/s | vs transformers | TTFT ms | prefill tok/s | prefill tok/s ({long}) | "
             "roofline % | roofline % at its weights' read rate (GB/s) | roofline %, each run against a probe after it "
             "(range) |", "|---|---|---|---|---|---|---|---|---|"]
    for row in report["rows"]:
        if row.get("absent"):
            lines.append(f"| {row['name']} | absent: {row['absent']} | | | | | | | |")
            continue
        speedup = f"{row['speedup_vs_hf']:.2f}x" if row["speedup_vs_hf"] else "-"
        weights = (f"{row['roofline_pct_weights']:.0f} ({row['weights_read_gb_s']})" if row.get("weights_read_gb_s")
                   else "-")
        lines.append(f"| {row['name']} | {row['decode_tokens_per_s']:.1f} | {speedup} | {_cell(row['ttft_ms'])} | "
                     f"{_cell(row['prefill_tokens_per_s'])} | {_cell(row.get('prefill_long_tokens_per_s'))} | "
                     f"{row['roofline_pct']:.0f} | {weights} | {_paired_cell(row)} |")
    for pair in report.get("ours_vs_peers", []):
        lines.append(f"ours best / {pair['peer']}, decode: {pair['ours']} {pair['ours_decode_tokens_per_s']:.1f} / "
                     f"{pair['peer_decode_tokens_per_s']:.1f} tok/s = {pair['ratio']:.2f}x" + (
                         f"; prefill: {pair['ours_prefill']} {pair['ours_prefill_tokens_per_s']:.0f} / "
                         f"{pair['peer_prefill_tokens_per_s']:.0f} tok/s = {pair['prefill_ratio']:.2f}x"
                         if "prefill_ratio" in pair else ""))
    for row in report["rows"]:
        if (check := row.get("token_check")) is not None:
            parted = [f"{prompt} at token {position}" for prompt, position in check["first_difference"].items()
                      if position is not None]
            lines.append(f"{row['name']}: greedy tokens " + (f"equal to {check['against']}'s" if check["equal"] else
                         f"differ from {check['against']}'s: {', '.join(parted)}"))
    return "\n".join(lines)


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _paired_cell(row: dict) -> str:
    if row.get("roofline_pct_paired") is None:  # llama-bench's rows, and reports from before the paired probe
        return "-"
    low, high = row["roofline_pct_paired_range"]
    return f"{row['roofline_pct_paired']:.0f} ({low:.0f}-{high:.0f})"


def machine_info(device: torch.device) -> dict:
    info = {"platform": platform.platform(), "processor": cpu_name(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "avx512_bf16": torch.cpu._is_avx512_bf16_supported(), "amx": torch.cpu._is_amx_tile_supported(),
            "cpu": cpu_details()}
    if device.type == "cpu" and row_kernel.tuning():  # how our projection loop ran here (where a row loaded it)
        info["row_kernel_tuning"] = row_kernel.tuning()
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info
