"""`python -m inference_core gpu-report --out DIR [--budget-s 480] [--device cuda] [--smoke]`: the whole stack on a
GPU in one prepared run, on a bare CUDA machine with only this repository (random-weight checkpoints at real shapes
are written on the spot by `inference_core.model.random_weights`).

Parts, in this order (the goals' measurements first: a short lease gets those), each stopping at its share of the
budget (a row not started in time is listed in `left_out`):

1. `device`: the GPU, torch and CUDA versions, and the copy bandwidth (a device-to-device copy of 1 GiB, bytes read
   plus bytes written over the median time of 10 copies), the bandwidth every row's `roofline_pct` is taken against.
   `attention`: the compiled step's attention alone (`bench.kernel_timing`: the Triton kernel with and without
   splitting a sequence's keys, against the ATen ops), a few seconds; `int4`: Llama-3-8B's int4 projections alone,
   one row, tinygemm against our Triton kernel.
2. `decode`: batch-1 decode in bf16 at Llama-3-8B's and Qwen3-0.6B's shapes (Qwen3-1.7B's last, as its own part):
   eager with the gathered paged cache, eager with FlexAttention reading the pool through the block table, compiled
   with CUDA graphs (one step a host round trip, and 8: `EngineConfig.decode_steps`), the same with int8 and int4
   weights, and transformers eager and at its best (static cache, which transformers compiles with CUDA graphs on
   its own). Each row: the median decode tokens/s of 3 runs of 128 new tokens after a warm-up, its % of the
   bandwidth limit (copy bandwidth over the bytes one step reads: the weights as stored plus the KV of the mean
   context) and its ratio to transformers' best row of the shape. The rows the goals are read from (`GOAL_ROWS`) run
   first, for every shape, then the others.
3. `batch`: `batch-bench` at Qwen3-0.6B's shape, 256 requests arriving at once with output lengths uniform over
   16-256 (seeded), at most 128 sequences a step: our continuous batching (requests joining at any step, and at
   most every 16 steps: `EngineConfig.join_every`), dynamic and static batching (in a process of their own,
   sharing one compile; compiled decode on a GPU where the part's share leaves time to compile), transformers' static
   batches, and transformers one request at a time on the first 4 requests (its tokens/s does not depend on how
   many); between them, a profile of a few eager decode steps of 64 sequences (where a batched step's time goes:
   kernels, or the device waiting for the host).
4. `serve`: the playground's own path on the device (`python -m server.serve_check`): a race of two lanes, a chat
   turn and one streamed API completion through the engine pool and its loop, each with its TTFT and tokens/s.
5. `tests`: the CUDA tests (`pytest -m cuda` over the files that hold them), each test's outcome recorded (those
   that ended, where the part is stopped at its share).
6. `decode-1.7b`: the decode rows at Qwen3-1.7B's shape.

A row that compiles (ours with CUDA graphs, transformers' static-compiled) and our batching modes run in processes
of their own, stopped at their cap: a compile that runs away costs those rows, not the rest of the report (on an
H100, the first runs of the compiled step spent the whole budget compiling again and again).

The report is rewritten after every part, so a run stopped from outside still leaves `DIR/gpu-report.json` (rows with
`shape`, `name`, `batch`, `decode_tokens_per_s`, `roofline_pct`, `speedup_vs_hf`; `device` and `torch` at the top)
and `DIR/gpu-report.md`. `--device cpu --smoke` runs the same code on a tiny model of each shape's family in seconds
(the test suite does, so that the script cannot break unnoticed between GPU runs).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from inference_core.bench.kernel_timing import format_attention, format_int4, time_attention, time_int4
from inference_core.bench.batching import batch_bench, format_step_kinds, parse_output_lengths
from inference_core.bench.profile import profile_requests, tokens_needed
from inference_core.bench.prompts import load_prompts
from inference_core.bench.speed import decode_bytes_per_step, forward_clock, load_hf_model, machine_info
from inference_core.config import ConfigError, EngineConfig
from inference_core.engine.engine import Engine
from inference_core.model.checkpoint import read_config
from inference_core.model.loader import load_model
from inference_core.model.random_weights import STAND_IN, write_random_checkpoint
from inference_core.quant.linear import QuantConfig
from inference_core.quant.quantize import quantize
from inference_core.roofline import timed_runs
from inference_core.sampling import SamplingParams
from inference_core.spec.decoding import SpecConfig

# part -> share of the budget (of the parts asked for, scaled to add up to the whole); a part's deadline is the run's
# start plus the shares up to and including its own, so time a part leaves unused goes to the parts after it.
PARTS = {"device": 0.02, "attention": 0.03, "int4": 0.02, "decode": 0.45, "batch": 0.15, "serve": 0.08, "tests": 0.22,
         "decode-1.7b": 0.08}
DECODE_SHAPES = {"decode": ("llama-3-8b", "qwen3-0.6b"), "decode-1.7b": ("qwen3-1.7b",)}  # the goals' shapes first
# name -> (engine settings, weight scheme), in the table's order; None: a transformers row. `spec`: the row's requests
# speculate with that source (`SPEC_K` drafts), on a prompt whose text repeats (`SPEC_PROMPT_REPEATS` times).
ROWS = {"gather": (dict(attention="gather"), "none"), "flex": (dict(attention="flex"), "none"),
        "graphs": (dict(compile=True), "none"), "graphs+steps8": (dict(compile=True, decode_steps=8), "none"),
        "graphs+int8": (dict(compile=True), "int8"),
        "graphs+int4": (dict(compile=True), "int4"),
        "graphs+steps8+int4": (dict(compile=True, decode_steps=8), "int4"),
        "graphs+ngram": (dict(compile=True, spec="ngram"), "none"), "hf": None, "hf-static-compiled": None}
ROW_ORDER = ("graphs", "graphs+steps8", "hf-static-compiled", "graphs+int4", "graphs+steps8+int4", "graphs+ngram",
             "gather", "flex", "graphs+int8", "hf")  # by priority
# The rows a goal is read from, run for every shape of a part before any other row (on an H100 the 8B shape's rows in
# ROW_ORDER took the whole decode share and left Qwen3-0.6B's out).
GOAL_ROWS = {"llama-3-8b": ("graphs", "graphs+steps8", "hf-static-compiled", "graphs+int4", "graphs+steps8+int4"),
             "qwen3-0.6b": ("graphs", "graphs+steps8", "hf-static-compiled")}
# The speculative row: random weights accept no trained drafter's drafts, but their greedy text falls into loops that
# prompt lookup finds. Its verifications (the last token and up to SPEC_K drafts) run in the flat step's CUDA graphs.
SPEC_K, SPEC_PROMPT_REPEATS = 4, 3
# The batch and serve parts compile (CUDA graphs) only where their share of the budget leaves room for it. On an
# H100 the compiled batch modes (then three processes, each compiling bucket 1 and the dynamic buckets and recording
# a graph per bucket and width) printed no row in 78 s, nor did the compiled race lane in 32 s. Now the modes share
# one process, so one compile (two of about 45 s at this shape: bucket 1, and every bucket above it) and, with the
# Triton attention, one recording a bucket. Short of the time they run eager, and the report says so.
BATCH_COMPILE_S, SERVE_COMPILE_S = 180.0, 120.0
OURS_SHARE = 0.7  # of the batch part, for our three modes; a profiled eager step and transformers' rows have the rest
BATCH_PROFILE_S = 20.0  # the profiled eager batch step runs where this much of the part is left (about 5 s on an H100)
COMPILED_ROW_S = 60.0  # a compiled row of 32 layers takes about this long (its compile; on an H100 one compile of
# the 8B shape's step took about 50 s); eager rows a quarter of it
CUDA_TEST_FILES = ("tests/engine/test_cuda.py", "tests/engine/test_triton_attention.py", "tests/quant", "tests/kv",
                   "tests/engine/test_compiled.py", "tests/engine/test_flex_attention.py")
SMOKE_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, vocab_size=4096, max_position_embeddings=2048)
PROMPT_ID = "chat-short-1"
HF_BEST = ("hf-static-compiled", "hf")
# Rows whose engine is profiled after its measurement (`profile_engine`): where the step's time goes, kernels against
# the device's idle time, and a trace beside the report.
PROFILED_ROWS = ("graphs", "graphs+steps8")
PROFILE_TOKENS = 96  # the most new tokens a profile's request takes (16 steps of 1, or 4 of 8, with their warm-up)


class Report:
    """The report as it grows; written whole (JSON and Markdown) after every part."""

    def __init__(self, out: Path, args):
        self.out = out
        self.data = {"device": None, "torch": torch.__version__, "smoke": args.smoke, "budget_s": args.budget_s,
                     "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "parts": {}, "rows": [], "left_out": [],
                     "errors": []}

    def leave_out(self, what: str, why: str = "budget") -> None:
        self.data["left_out"].append(f"{what}: {why}")
        print(f"  left out {what}: {why}", flush=True)

    def error(self, what: str, error: BaseException) -> None:
        self.data["errors"].append({"what": what, "error": f"{type(error).__name__}: {error}",
                                    "traceback": traceback.format_exc(limit=12)})
        print(f"  FAILED {what}: {type(error).__name__}: {error}", flush=True)

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "gpu-report.json").write_text(json.dumps(self.data, indent=2))
        (self.out / "gpu-report.md").write_text(markdown(self.data))


def run_gpu_report(args) -> int:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("gpu-report --device cuda needs CUDA; use --device cpu --smoke for the CPU check.")
    if device.type == "cpu" and not args.smoke:
        raise ConfigError("gpu-report on the CPU runs only as --smoke (a tiny model); real shapes need a GPU.")
    out, started = Path(args.out), time.perf_counter()
    work = Path(args.work or Path(tempfile.gettempdir()) / "gpu-report-checkpoints")
    report = Report(out, args)
    parts = [part for part in PARTS if part in args.parts.split(",")]
    if not parts:
        raise ConfigError(f"no part to run; --parts takes {', '.join(PARTS)}.")
    total_share = sum(PARTS[part] for part in parts)
    deadline = started
    for part in parts:
        deadline += PARTS[part] / total_share * args.budget_s
        print(f"== {part} (until {deadline - started:.0f} s of {args.budget_s:.0f})", flush=True)
        part_started = time.perf_counter()
        try:
            if part == "device":
                report.data.update(device_part(device, args.smoke))
            elif part == "attention":
                report.data["parts"]["attention"] = time_attention(device, deadline)
                print("\n".join(format_attention(report.data["parts"]["attention"])), flush=True)
            elif part == "int4":
                report.data["parts"]["int4"] = time_int4(device, deadline)
                print("\n".join(format_int4(report.data["parts"]["int4"])), flush=True)
            elif part == "tests":
                report.data["parts"]["tests"] = tests_part(device, deadline)
            elif part.startswith("decode"):
                shapes = [shape for shape in DECODE_SHAPES[part] if shape in args.shapes.split(",")]
                decode_part(report, shapes, device, work, args, deadline)
            elif part == "batch":
                report.data["parts"]["batch"] = batch_part(report, device, work, args, deadline)
            elif part == "serve":
                report.data["parts"]["serve"] = serve_part(report, device, work, args, deadline)
        except Exception as error:  # one part's failure is recorded; the others still run
            report.error(part, error)
        report.data["parts"].setdefault(part, {})["seconds"] = round(time.perf_counter() - part_started, 1)
        report.write()
        free_device()
    report.data["seconds"] = round(time.perf_counter() - started, 1)
    report.write()
    print(markdown(report.data))
    return 0 if not report.data["errors"] else 1


def device_part(device: torch.device, smoke: bool) -> dict:
    size = (64 if smoke else 1024) << 20
    info = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({os.cpu_count()} "
            "cores)", "cuda": torch.version.cuda, "machine": machine_info(device),
            "copy_bandwidth_gb_s": round(copy_bandwidth(device, size) / 1e9, 1)}
    print(f"  {info['device']}, torch {torch.__version__}, CUDA {info['cuda']}, copy {info['copy_bandwidth_gb_s']} "
          "GB/s (read + written)", flush=True)
    return info


def copy_bandwidth(device: torch.device, size_bytes: int, repeats: int = 10) -> float:
    """Bytes read plus bytes written per second by a device-to-device copy (median of `repeats`, after one)."""
    source = torch.randn(size_bytes // 4, device=device)
    target = torch.empty_like(source)
    return 2 * size_bytes / statistics.median(timed_runs(device, lambda: target.copy_(source), repeats))


def free_device() -> None:
    gc.collect()
    torch._dynamo.reset()  # compiled graphs (and their CUDA graph pools) of the shape just done
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def tests_part(device: torch.device, deadline: float) -> dict:
    """The CUDA tests, each outcome; on the CPU only collected (they skip there), to catch an import that broke."""
    root = Path(__file__).resolve().parents[2]
    files = [name for name in CUDA_TEST_FILES if (root / name).exists()]
    # -v: a line per test as it ends, so that a run stopped at its share still records the tests that ran.
    command = [sys.executable, "-m", "pytest", "-m", "cuda", "-rA", "-v", "-p", "no:cacheprovider", *files]
    if device.type != "cuda":
        command.append("--collect-only")
    timeout = max(5.0, deadline - time.perf_counter())
    try:
        done = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=timeout)
        output, status = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as stopped:
        output, status = (stopped.stdout or b"").decode() if isinstance(stopped.stdout, bytes) else (
            stopped.stdout or ""), "stopped at its share of the budget"
    outcomes = parse_test_outcomes(output)
    summary = next((line for line in reversed(output.splitlines()) if line.strip()), "")
    print(f"  {summary}", flush=True)
    return {"command": " ".join(command[1:]), "status": status, "summary": summary, "outcomes": outcomes,
            "failures": [name for name, word in outcomes.items() if word in ("FAILED", "ERROR")],
            "tail": output[-4000:] if status not in (0, 5) else ""}


OUTCOMES = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")


def parse_test_outcomes(output: str) -> dict[str, str]:
    """Each test's outcome from pytest's output: its `-v` lines ("tests/x.py::name PASSED [ 50%]") and its `-rA`
    summary ("PASSED tests/x.py::name", "SKIPPED [1] tests/x.py:12: why" carries no test id and is not counted)."""
    outcomes = {}
    for line in output.splitlines():
        words = line.split()
        if len(words) >= 2 and words[0] in OUTCOMES and "::" in words[1]:  # the summary
            outcomes[words[1]] = words[0]
        elif len(words) >= 2 and "::" in words[0] and words[1] in OUTCOMES:  # a -v line
            outcomes[words[0]] = words[1]
    return outcomes


def checkpoint(shape: str, work: Path, device: torch.device, smoke: bool) -> Path:
    """The random-weight checkpoint of `shape` (bf16), written once per work folder."""
    directory = work / shape
    if not (directory / "config.json").is_file():
        begun = time.perf_counter()
        # The stand-in tokenizer on every machine, so that prompts are the same tokens with or without the bundled
        # model installed.
        write_random_checkpoint(shape, directory, "bfloat16", tokenizer=STAND_IN, device=device,
                                **(SMOKE_SHAPE if smoke else {}))
        print(f"  wrote {shape} in {time.perf_counter() - begun:.1f} s", flush=True)
    return directory


def prompt_text() -> str:
    return next(row["prompt"] for row in load_prompts() if row["id"] == PROMPT_ID)


def decode_order(shapes: list[str], rows: list[str]) -> list[tuple[str, str]]:
    """(shape, row) in the order they run: every shape's goal rows (`GOAL_ROWS`) first, then each shape's others in
    `ROW_ORDER`, a shape's rows together (its eager rows share one model loaded in this process)."""
    wanted = [name for name in ROW_ORDER if name in rows]
    first = [(shape, name) for shape in shapes for name in wanted if name in GOAL_ROWS.get(shape, ())]
    return first + [(shape, name) for shape in shapes for name in wanted if (shape, name) not in first]


def decode_part(report: Report, shapes: list[str], device: torch.device, work: Path, args, deadline: float) -> None:
    """Every decode row of `shapes` that fits before `deadline`, in `decode_order`, listed in table order. A row
    that compiles runs in a process of its own, stopped at its cap (three times what its compile should take) or the
    deadline, whichever comes first: a compile that runs away costs that row, not the report."""
    new_tokens, repeats = (8, 1) if args.smoke else (args.new_tokens, 3)
    measured: dict[str, dict] = {shape: {} for shape in shapes}
    loaded, peers = {}, {}  # shape -> its model in this process, once one of its eager rows runs (one at a time)
    for shape, name in decode_order(shapes, args.rows.split(",")):
        if time.perf_counter() > deadline:
            report.leave_out(f"{shape} {name}")
            continue
        directory = checkpoint(shape, work, device, args.smoke)
        compile_s = 0 if args.smoke else COMPILED_ROW_S * read_config(directory).num_layers / 32  # follows depth
        compiled = name == "hf-static-compiled" or (ROWS[name] is not None and bool(ROWS[name][0].get("compile")))
        need = compile_s if compiled else compile_s / 4
        if time.perf_counter() + need > deadline:
            report.leave_out(f"{shape} {name}")
            continue
        try:
            if compiled:
                cap = min(deadline - time.perf_counter(), max(3 * need, 60.0))
                trace = report.out / trace_file(shape, name) if name in PROFILED_ROWS else None
                row = row_in_child(directory, name, device, new_tokens, repeats, cap, trace)
            else:
                if shape not in loaded:  # the previous shape's model goes first
                    loaded.clear()
                    peers.clear()
                    free_device()
                    loaded[shape] = load_model(str(directory), device=str(device), dtype="bfloat16")
                row = measure_row(loaded[shape], directory, name, new_tokens, repeats, peers)
        except RowStopped as stopped:
            report.leave_out(f"{shape} {name}", str(stopped))
            continue
        except Exception as error:
            report.error(f"{shape} {name}", error)
            continue
        finally:
            free_device()
        bandwidth = report.data.get("copy_bandwidth_gb_s", 0) * 1e9
        limit = bandwidth / row.pop("bytes_per_step") if bandwidth else 0
        rate = row.pop("rate")
        measured[shape][name] = {"shape": shape, "name": name, "batch": 1, "decode_tokens_per_s": round(rate, 1),
                                 "roofline_pct": round(100 * rate / limit, 1) if limit else None,
                                 "roofline_tokens_per_s": round(limit, 1), "new_tokens": new_tokens,
                                 "runs": repeats, **row}
        print(f"  {shape} {name}: {rate:.1f} tok/s ({measured[shape][name]['roofline_pct']}% of the bandwidth "
              "limit)", flush=True)
    loaded.clear()
    peers.clear()
    for shape, rows in measured.items():
        hf = next((rows[name]["decode_tokens_per_s"] for name in HF_BEST if name in rows), None)
        for name in (name for name in ROWS if name in rows):
            rows[name]["speedup_vs_hf"] = round(rows[name]["decode_tokens_per_s"] / hf, 2) if hf else None
            report.data["rows"].append(rows[name])


class RowStopped(Exception):
    """A row's process ran past its cap and was stopped."""


def row_in_child(directory: Path, name: str, device: torch.device, new_tokens: int, repeats: int,
                 cap: float, trace: Path | None = None) -> dict:
    """`measure_row` in a process of its own (its output, and dynamo's recompile reasons, go to this log); with
    `trace`, its engine's steps are profiled after the measurement (`profile_engine`)."""
    with tempfile.TemporaryDirectory() as folder:
        result = Path(folder) / "row.json"
        command = [sys.executable, "-m", "inference_core.bench.gpu_report", "--row", name, "--checkpoint",
                   str(directory), "--device", str(device), "--new-tokens", str(new_tokens), "--repeats",
                   str(repeats), "--result", str(result)] + (["--trace", str(trace)] if trace else [])
        env = dict(os.environ, TORCH_LOGS=os.environ.get("TORCH_LOGS", "recompiles"))
        if not _speculates(name):
            # A decode row's prompt is one forward, eager as in the earlier runs: the flat step (which takes prompts on
            # CUDA) would cost each row's process a compile of its own for it. The speculative row verifies in it.
            env["INFERENCE_CORE_TRITON_FLAT"] = "0"
        started = time.perf_counter()
        try:
            done = subprocess.run(command, cwd=Path(__file__).resolve().parents[2], env=env, timeout=cap)
        except subprocess.TimeoutExpired:
            raise RowStopped(f"stopped after {time.perf_counter() - started:.0f} s (its cap)") from None
        if done.returncode != 0 or not result.is_file():
            raise RuntimeError(f"the row's process exited {done.returncode} (its output is in the log above)")
        return json.loads(result.read_text())


def measure_row(loaded, directory: Path, name: str, new_tokens: int, repeats: int, peers: dict,
                trace: Path | None = None) -> dict:
    """Row `name` at batch 1: its median decode tokens/s (`rate`), the bytes one of its steps reads at the mean
    context (`bytes_per_step`), the prompt's length and, for our compiled rows, what compiling cost (and with `trace`,
    a profile of its steps)."""
    prompt = Engine(loaded, EngineConfig(kv_mode="none")).prompt_ids(prompt_text(), chat=True)
    if _speculates(name):
        prompt = prompt * SPEC_PROMPT_REPEATS
    row: dict = {"prompt_tokens": len(prompt)}
    if ROWS[name] is None:
        if "hf" not in peers:  # one transformers model for both of its rows
            peers["hf"] = load_hf_model(loaded, directory)
        row["rate"], row_loaded = hf_decode(peers["hf"], loaded.device, prompt, new_tokens, repeats,
                                            name != "hf"), loaded
    else:
        row["rate"], row_loaded, engine, spec = ours_decode(loaded, name, prompt, new_tokens, repeats)
        if spec is not None:  # the last run's drafts (what a verification step carried) and how many were accepted
            row["spec"] = {key: spec[key] for key in ("drafted", "accepted", "steps") if key in spec}
        packed = [buffer for buffer_name, buffer in row_loaded.model.named_buffers() if buffer_name.endswith("qweight")]
        if packed and ROWS[name][1] == "int4":  # which int4 kernel the layers took (kernels.int4_path)
            row["int4_kernel"] = "triton" if any(buffer.dtype == torch.uint8 for buffer in packed) else "tinygemm"
        if engine.decoder:
            row["compile"] = engine.compile_stats()
        if trace:
            row["profile"] = profile_engine(engine, prompt, trace)
    row["bytes_per_step"] = decode_bytes_per_step(row_loaded, len(prompt) + new_tokens / 2)
    return row


def _speculates(name: str) -> bool:
    """Whether decode row `name` speculates (its settings name a `spec` source)."""
    return ROWS[name] is not None and "spec" in ROWS[name][0]


def ours_decode(loaded, name: str, prompt: list[int], new_tokens: int, repeats: int):
    """Median decode tokens/s of our engine as row `name` has it, batch 1, after a warm-up (and its compile); the
    model it ran (quantized where the row is), the engine, and the last run's speculation stats (None: no `spec`)."""
    settings, scheme = ROWS[name]
    settings = dict(settings)
    spec = SpecConfig(settings.pop("spec"), k=SPEC_K) if "spec" in settings else None
    if "attention" not in {field.name for field in dataclasses.fields(EngineConfig)}:  # an engine without the switch
        if settings["attention"] != "gather":
            raise ConfigError(f"this engine has no attention setting: no {settings['attention']} row")
        settings = {}
    model = quantize(loaded, QuantConfig(scheme)) if scheme != "none" else loaded
    longest = len(prompt) + max(new_tokens, PROFILE_TOKENS) + 32
    config = EngineConfig(kv_mode="paged", max_num_seqs=1, max_seq_len=longest, prefix_cache=False, **settings)
    engine = Engine(model, config)
    engine.warm_up_compiled((1,), spec)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    engine.complete(prompt, SamplingParams(max_new_tokens=8, ignore_eos=True), spec=spec)
    finishes = [engine.complete(prompt, params, spec=spec) for _ in range(repeats)]
    rate = statistics.median(finish.stats.decode_tokens_per_s for finish in finishes)
    return rate, model, engine, finishes[-1].stats.spec if spec is not None else None


def trace_file(shape: str, name: str) -> str:
    """The file name of a row's profiler trace, in letters, digits, '.', '_' and '-' alone ('graphs+steps8' gives
    'graphs-steps8'), so that copying tools that refuse other characters in a name keep it."""
    return re.sub(r"[^A-Za-z0-9._-]", "-", f"trace-{shape}-{name}.json.gz")


def profile_engine(engine: Engine, prompt: list[int], trace: Path) -> dict:
    """A few of the engine's steps under the torch profiler (`profile_requests`, as `profile` records them): the
    mean step, its categories (on CUDA each category's kernel time and the time the device sat idle waiting for the
    host) and the Chrome trace written to `trace`."""
    steps, warmup = (4, 1) if engine.config.decode_steps > 1 else (16, 2)
    tokens = tokens_needed(steps, warmup) * engine.config.decode_steps  # at most PROFILE_TOKENS
    request = engine.make_request(prompt, SamplingParams(max_new_tokens=tokens, ignore_eos=True))
    report = profile_requests(engine, [request], steps, warmup, str(trace))
    return {"trace": trace.name, **{key: report[key] for key in ("steps", "step_ms", "unprofiled_step_ms",
                                                                  "breakdown", "work")}}


def hf_decode(model, device: torch.device, prompt: list[int], new_tokens: int, repeats: int, static: bool) -> float:
    """transformers `generate` on `model`, greedy, batch 1: eager with its dynamic cache, or with a static cache
    (which it compiles with CUDA graphs itself on a GPU); the median decode tokens/s after two warm-ups."""
    ids = torch.tensor([prompt], device=device)
    times: list[float] = []
    clock = forward_clock(times)
    extra = {"cache_implementation": "static"} if static else {}
    rates = []
    for attempt in range(repeats + 2):
        times.clear()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                       eos_token_id=None, pad_token_id=0, stopping_criteria=[clock], **extra)
        if attempt >= 2:
            rates.append((len(times) - 1) / (times[-1] - times[0]))
    return statistics.median(rates)


def batch_part(report: Report, device: torch.device, work: Path, args, deadline: float) -> dict:
    """Our modes in a process of their own (`batch-bench`; compiled decode on a GPU where the part's share
    leaves `BATCH_COMPILE_S`, else eager: the modes' engines share one compile and its graphs), stopped at `OURS_SHARE`
    of the part: a compile that runs away, or a slow mode, costs the modes not finished by then, and keeps the rows
    before them (batch-bench writes its JSON after each row). Then transformers' rows here, on the same requests,
    until the deadline."""
    directory = checkpoint("qwen3-0.6b", work, device, args.smoke)
    requests, seqs, peer_requests = (16, 8, 2) if args.smoke else (256, 128, 4)
    spec = "uniform:4-16" if args.smoke else "uniform:16-256"
    lengths = parse_output_lengths(spec, requests, 0, seed=0)
    rows = [row for row in load_prompts() if row["kind"] != "completion"]
    compiled = device.type == "cuda" and deadline - time.perf_counter() >= BATCH_COMPILE_S
    modes, ours, steps = ["continuous", "dynamic", "static", "continuous+join16"], [], {}  # by priority
    with tempfile.TemporaryDirectory() as folder:
        prompts = Path(folder) / "prompts.jsonl"
        prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
        result = Path(folder) / "ours.json"
        command = [sys.executable, "-m", "inference_core", "batch-bench", "--model", str(directory), "--device",
                   str(device), "--dtype", "bfloat16", "--prompts", str(prompts), "--requests", str(requests),
                   "--output-lengths", spec, "--seed", "0", "--max-num-seqs", str(seqs), "--modes", ",".join(modes),
                   "--peers", "", "--json", str(result)] + (["--compile"] if compiled else [])
        share = OURS_SHARE * (deadline - time.perf_counter())
        try:
            if share > 0:
                subprocess.run(command, cwd=Path(__file__).resolve().parents[2], check=True, timeout=max(10.0, share))
        except subprocess.TimeoutExpired:
            print("  our batching modes stopped at their share of the budget", flush=True)
        except subprocess.CalledProcessError as error:
            report.error("batch-bench of our modes", error)
        if result.exists():
            written = json.loads(result.read_text())
            ours, steps = written["rows"], written["steps"]
    not_run = [mode for mode in modes if mode not in {row["name"] for row in ours}]
    loaded = load_model(str(directory), device=str(device), dtype="bfloat16")
    profile = None
    if deadline - time.perf_counter() >= BATCH_PROFILE_S:
        trace = report.out / trace_file("qwen3-0.6b", f"batch-{seqs // 2}")
        try:
            profile = profile_batch(loaded, rows, seqs // 2, trace)
        except Exception as error:
            report.error("batch profile", error)
        finally:
            free_device()
    else:
        report.leave_out("batch profile")
    peers = batch_bench(loaded, directory, rows, [0.0] * requests, lengths, [], ["hf-static", "hf-sequential"],
                        seqs, peer_requests=peer_requests, settings={"arrival": "burst", "output_lengths": spec},
                        deadline=deadline)
    result = {**peers, "rows": ours + peers["rows"], "steps": steps, "left_out": not_run + peers["left_out"]}
    result["arguments"]["compile"] = compiled  # our rows'
    if profile is not None:
        result["profile"] = profile
    report.data["left_out"] += [f"batch {name}: budget" for name in result["left_out"]]
    by_name = {row["name"]: row["throughput_tokens_per_s"] for row in result["rows"]}
    if "continuous" in by_name and "hf-sequential" in by_name:
        result["continuous_vs_hf_sequential"] = round(by_name["continuous"] / by_name["hf-sequential"], 2)
    del loaded
    return {key: result[key] for key in ("arguments", "rows", "steps", "left_out", "output_lengths")} | {
        key: result[key] for key in ("continuous_vs_hf_sequential", "profile") if key in result}


def profile_batch(loaded, rows: list[dict], size: int, trace: Path) -> dict:
    """A few eager decode steps of a continuous engine with `size` requests running (`profile_requests`): where a
    batched step's time goes on this device, the kernels against the time the device waits for the host."""
    engine = Engine(loaded, EngineConfig(kv_mode="paged", max_num_seqs=size, batching="continuous"))
    steps, warmup = 6, 2
    params = SamplingParams(max_new_tokens=tokens_needed(steps, warmup), ignore_eos=True)
    requests = [engine.make_request(rows[index % len(rows)]["prompt"], params, chat=False) for index in range(size)]
    report = profile_requests(engine, requests, steps, warmup, str(trace))
    return {"trace": trace.name, "kernels": report["kernels"][:8], **{
        key: report[key] for key in ("batch_size", "steps", "step_ms", "unprofiled_step_ms", "breakdown", "work")}}


def serve_part(report: Report, device: torch.device, work: Path, args, deadline: float) -> dict:
    """The playground's path in a process of its own (`server.serve_check`: the engine pool, its loop, the API's
    request reading and replies), as a GPU Space runs it."""
    directory = checkpoint("qwen3-0.6b", work, device, args.smoke)
    root = Path(__file__).resolve().parents[2]
    result = report.out / "serve.json"
    command = [sys.executable, "-m", "server.serve_check", "--model", str(directory), "--device", str(device),
               "--json", str(result)] + (["--new-tokens", "8"] if args.smoke else [])
    timeout = max(10.0, deadline - time.perf_counter())
    command += ["--eager"] if args.smoke or timeout < SERVE_COMPILE_S else []
    try:
        done = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        report.leave_out("serve", "stopped at its share of the budget")
        return {}
    print("  " + "\n  ".join(done.stdout.strip().splitlines()[-6:]), flush=True)
    if done.returncode != 0:
        raise RuntimeError(f"server.serve_check exited {done.returncode}: {done.stderr[-2000:]}")
    return json.loads(result.read_text())


def _profile_line(profile: dict) -> str:
    """A profiled step in words: its time, the categories that took any, and its trace."""
    shares = ", ".join(f"{part['category']} {part['ms']:.2f}" for part in profile["breakdown"] if part["ms"] > 0)
    return f"{profile['step_ms']:.2f} ms ({shares} ms; trace {profile['trace']})"


def markdown(data: dict) -> str:
    lines = [f"# GPU report: {data.get('device')}", "",
             f"torch {data['torch']}, CUDA {data.get('cuda')}, copy bandwidth {data.get('copy_bandwidth_gb_s')} GB/s "
             f"(read + written), budget {data['budget_s']:.0f} s" + (" (smoke)" if data["smoke"] else ""), "",
             "| shape | row | batch | decode tok/s | % of bandwidth limit | vs transformers' best |",
             "|---|---|---|---|---|---|"]
    for row in data["rows"]:
        speedup = f"{row['speedup_vs_hf']:.2f}x" if row.get("speedup_vs_hf") else "-"
        lines.append(f"| {row['shape']} | {row['name']} | {row['batch']} | {row['decode_tokens_per_s']:.1f} | "
                     f"{row['roofline_pct']} | {speedup} |")
    for row in (row for row in data["rows"] if row.get("profile")):
        lines += ["", f"{row['shape']} {row['name']}, a profiled step: {_profile_line(row['profile'])}"]
    batch = data["parts"].get("batch", {})
    if batch.get("rows"):
        lines += ["", f"batch-bench at qwen3-0.6b: {batch['arguments']['requests']} requests, output lengths "
                  f"{batch['arguments'].get('output_lengths')}, at most {batch['arguments']['max_num_seqs']} a step; "
                  f"our decode {'compiled' if batch['arguments'].get('compile') else 'eager'}",
                  "", "| row | requests | tok/s | TTFT p50 ms | latency p50 ms | mean batch |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {row['name']} | {row['requests']} | {row['throughput_tokens_per_s']:.0f} | "
                  f"{row['ttft_ms_p50']:.0f} | {row['latency_ms_p50']:.0f} | {row['mean_batch_size']:.1f} |"
                  for row in batch["rows"]]
        lines += [""] + [f"- {format_step_kinds(mode, kinds)}" for mode, kinds in batch.get("steps", {}).items()]
    if batch.get("profile"):
        lines += ["", f"an eager decode step of {batch['profile']['batch_size']:.0f} sequences, profiled: "
                  f"{_profile_line(batch['profile'])}"]
    if "rows" in data["parts"].get("attention", {}):
        lines += format_attention(data["parts"]["attention"])
    if "rows" in data["parts"].get("int4", {}):
        lines += format_int4(data["parts"]["int4"])
    serve = data["parts"].get("serve", {})
    if serve.get("runs"):
        lines += ["", f"serving path ({serve.get('how')}):", "", "| run | lane | TTFT ms | tok/s | tokens |",
                  "|---|---|---|---|---|"]
        lines += [f"| {run['run']} | {run['lane']} | {run['ttft_ms']:.0f} | {run['tokens_per_s']:.1f} | "
                  f"{run['tokens']} |" for run in serve["runs"]]
    tests = data["parts"].get("tests", {})
    if tests.get("summary"):
        lines += ["", f"CUDA tests: {tests['summary']}" + (f"; failed: {', '.join(tests['failures'])}"
                                                          if tests.get("failures") else "")]
    lines += [f"- left out: {item}" for item in data["left_out"]]
    lines += [f"- error in {item['what']}: {item['error']}" for item in data["errors"]]
    return "\n".join(lines) + "\n"


def add_gpu_report_arguments(parser: argparse.ArgumentParser) -> None:
    """`python -m inference_core gpu-report`'s flags."""
    parser.add_argument("--out", required=True, help="folder for gpu-report.json and gpu-report.md")
    parser.add_argument("--budget-s", type=float, default=480.0, help="seconds for the whole report")
    parser.add_argument("--device", default="cuda", help="cuda (or cuda:N); cpu only with --smoke")
    parser.add_argument("--smoke", action="store_true", help="a tiny model of each shape's family, in seconds")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, from: {', '.join(PARTS)}")
    parser.add_argument("--new-tokens", type=int, default=128, help="decode rows: new tokens per run")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"decode rows, from: {', '.join(ROWS)}")
    parser.add_argument("--shapes", default=",".join(shape for shapes in DECODE_SHAPES.values() for shape in shapes),
                        help="decode shapes")
    parser.add_argument("--work", help="folder for the random-weight checkpoints (default: gpu-report-checkpoints "
                        "in the temporary folder; an 8B one takes 16 GB)")


def _row_main(argv: list[str] | None = None) -> int:
    """A compiled row in a process of its own (`row_in_child`)."""
    parser = argparse.ArgumentParser(prog="python -m inference_core.bench.gpu_report")
    for flag in ("--row", "--checkpoint", "--device", "--result"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--new-tokens", type=int, required=True)
    parser.add_argument("--repeats", type=int, required=True)
    parser.add_argument("--trace", type=Path)
    args = parser.parse_args(argv)
    loaded = load_model(args.checkpoint, device=args.device, dtype="bfloat16")
    row = measure_row(loaded, Path(args.checkpoint), args.row, args.new_tokens, args.repeats, {}, args.trace)
    Path(args.result).write_text(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(_row_main())
