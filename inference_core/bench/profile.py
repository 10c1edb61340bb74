"""`python -m inference_core profile`: where an engine step's time goes.

It takes `generate`'s flags (the lane settings, the model, the prompts and the batching flags), submits the prompts
to one `Engine`, steps it until every running request has its first token and `--warmup-steps` more (a compiled
engine compiles or loads its graph there), times `--steps` steps without the profiler, then records `--steps` more
with the torch profiler (CPU activities, and CUDA where the model is on a GPU) and prints a breakdown of the mean
step by category; `--trace PATH` writes the recorded steps as a Chrome trace that Perfetto (ui.perfetto.dev) and
chrome://tracing open, and `--json`
prints `{"steps", "step_ms", "breakdown": [{"category", "ms", "share"}], ...}` (`step_ms`: the mean step, `ms`: per
step; also `profiled_ms`, the mean step as the profiler's own events span it, `unprofiled_step_ms`, the mean of as
many steps just before, without the profiler (what its recording adds: a few microseconds per op), `model`, `dtype`,
`device`, `compiled`, `batch_size` and `work`, the recorded steps' kinds of work, and for a compiled engine
`compiled_forwards`: the recorded steps' forwards by package, and those that ran eager by reason).
`--join-prompt` submits more prompts once the warm-up is over (and again before the recorded steps), so that their
prefill chunks share steps with the running decodes: the recorded steps are then mixed steps.
End-of-sequence is ignored, so that the recorded steps run. `--kernels` (a compiled engine on the CPU) compiles the
step with inductor's kernel profiling, so that the graph's generated kernels record themselves: the breakdown then
splits the graph into categories by each kernel's name (`kernel_category`) and the report lists the costliest
kernels (`"kernels"`: name, category, calls and ms per step).

How time is attributed (`breakdown`). The forward and the engine mark their parts with ranges that exist only while
the profiler records (`model.llama.profile_range`: `ic::projection`, `ic::attention` with the gathered KV reads,
`ic::norm_rope`, `ic::kv_write`, `ic::sampling`, `ic::forward`); each recorded step is wrapped in `ic::step`, and a
compiled engine's graph call in `ic::compiled_graph` (a compiled graph is one opaque call: inductor fused its norms,
RoPE and attention into C++ or Triton kernels and the profiler sees none of them). Walking each step's events, a
torch op's whole time (its children included, so nothing is counted twice) goes to the innermost named range around
it; an op outside any named range goes by its name (matmuls to projections, SDPA to attention, softmax or argmax
outside the forward to sampling, `index_copy_` to KV writes: the compiled step writes its KV after the graph), else
to "Python" outside the forward and to "other" inside it; the time between ops goes to the innermost range (the
Python of the scheduler, the runner and the engine's bookkeeping outside every range). "other" is then the step's
measured wall time (a clock read around each step, after a device synchronize) less every named category: the
forward's unnamed ops (embedding, residual adds, the MLP's activation, casts) and what the profiler saw of no step.
Inside the compiled graph, a recorded kernel (`--kernels`) goes by the ops its name lists, and the graph's own
time between its kernels stays "compiled graph". On CUDA the categories are the device's: the kernels that ran in
each step's range on the trace's device timeline, by their names (`device_kernel_category`: inductor's kernels list
the ops they fuse; a CUDA graph's kernels are named there one by one), copies under "other", and "device idle" the
rest of the step, the time the device waited for the host; `kernels` then lists the step's costliest kernels.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from inference_core.config import ConfigError
from inference_core.engine.compiled import forwards_words
from inference_core.engine.engine import Engine
from inference_core.generate import add_generate_arguments, generate_config
from inference_core.model.loader import load_model
from inference_core.quant.quantize import quantize
from inference_core.settings import LaneSettings

PROJECTIONS, ATTENTION, NORMS, SAMPLING, KV_WRITES = "projections", "attention", "norms and RoPE", "sampling", \
    "KV writes"
COMPILED, PYTHON, IDLE, OTHER = "compiled graph", "Python (scheduler, runner)", "device idle", "other"
CATEGORIES = (PROJECTIONS, ATTENTION, NORMS, SAMPLING, KV_WRITES, COMPILED, PYTHON, OTHER)
STEP = "ic::step"
GRAPH = "ic::compiled_graph"  # a compiled engine's graph call (`_graph_call_ranged`)
# Named ranges: everything inside goes to their category.
RANGES = {"ic::projection": PROJECTIONS, "ic::attention": ATTENTION, "ic::norm_rope": NORMS,
          "ic::kv_write": KV_WRITES, "ic::sampling": SAMPLING, GRAPH: COMPILED}
# Context ranges: ops inside go by their name, else to the context's category (so does the time between ops).
CONTEXTS = {STEP: PYTHON, "ic::forward": OTHER}
# An op outside every named range, by its name without the namespace: (names, category), first match wins.
OP_NAMES = (
    ({"mm", "addmm", "bmm", "matmul", "linear", "_linear_pointwise", "_weight_int8pack_mm", "_weight_int4pack_mm",
      "_weight_int4pack_mm_for_cpu", "int4_rows"}, PROJECTIONS),
    ({"scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
      "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
      "_scaled_dot_product_cudnn_attention", "flex_attention"}, ATTENTION),
    ({"rms_norm", "_fused_rms_norm"}, NORMS),
    ({"index_copy_", "index_put_"}, KV_WRITES),
)
# A compiled graph's kernel, by the ops inductor lists in its name (a kernel that fuses a norm into a projection is a
# projection): the first group with a word in the name wins.
KERNEL_WORDS = (({"gemm", "mm", "bmm", "addmm", "linear", "int8pack", "int4pack"}, PROJECTIONS),
                ({"softmax"}, ATTENTION), ({"rsqrt", "roll"}, NORMS))
# Our kernels (model.row_kernel, model.attention_kernel), by the names they record under: the op's, and inside a
# package compiled with `--kernels` also that of its C entry point (aoti_torch_cpu_<op>), which holds the op's event.
OUR_KERNELS = {"linear_rows": PROJECTIONS, "linear_rows_int8": PROJECTIONS, "linear_rows_int4": PROJECTIONS,
               "attend_paged": ATTENTION, "attend_paged_queries": ATTENTION, "attend_paged_flat": ATTENTION}
SAMPLING_OPS = {"softmax", "_softmax", "log_softmax", "_log_softmax", "argmax", "multinomial", "topk", "sort",
                "cumsum", "exponential_"}  # outside the forward only (inside it softmax is attention's)


def add_profile_arguments(parser: argparse.ArgumentParser) -> None:
    """`generate`'s flags, and what to record."""
    add_generate_arguments(parser)
    parser.add_argument("--steps", type=int, default=8, help="engine steps to record after the warm-up (default 8)")
    parser.add_argument("--warmup-steps", type=int, default=3,
                        help="untimed steps after every request has its first token (default 3)")
    parser.add_argument("--trace", help="write the recorded steps here as a Chrome trace (opens in Perfetto)")
    parser.add_argument("--join-prompt", action="append", default=[],
                        help="a prompt submitted after the warm-up and again before the recorded steps (repeatable): "
                             "its prefill, in chunks of --max-batched-tokens, runs beside the running decodes, so "
                             "the steps measured are mixed steps")
    parser.add_argument("--kernels", action="store_true",
                        help="with --compile on the CPU: compile the step with inductor's kernel profiling (a "
                             "compile of its own) and split the compiled graph into its kernels")


def op_category(name: str, context: str) -> str:
    """The category of an op outside every named range, inside `context` (PYTHON: outside the forward)."""
    short = name.rsplit("::", 1)[-1]
    for names, category in OP_NAMES:
        if short in names:
            return category
    if context == PYTHON and short in SAMPLING_OPS:
        return SAMPLING
    return context


def kernel_category(name: str) -> str:
    """The category of a kernel inside a compiled graph, from the ops its name lists (KERNEL_WORDS), else the graph's:
    'graph_0_gemm_m1n3072k576_cpp_fused_..._mean_mm_mul_pow_rsqrt_5' is a projection, 'cpp_fused__softmax_...' is
    attention."""
    ours = OUR_KERNELS.get(name.removeprefix("inference_core::").removeprefix("aoti_torch_cpu_"))
    if ours is not None:
        return ours
    # Inductor names a kernel after the ops whose outputs it reads too: our op's name in it is not a projection.
    words = set(name.rsplit("::", 1)[-1].replace("linear_rows", "").split("_"))
    return next((category for names, category in KERNEL_WORDS if words & names), COMPILED)


def attribute(event, totals: Counter, context: str = PYTHON, named: str | None = None) -> None:
    """Add `event`'s time (us) to `totals` by category: see the module docstring. `named`: the innermost named range
    around it."""
    name = event.name
    if name in RANGES:
        named = RANGES[name]
    elif name in CONTEXTS:
        context, named = CONTEXTS[name], None
    else:  # a torch op (or a compiled graph's kernel): all of it, children included, to one category
        category = kernel_category(name) if named == COMPILED else named or op_category(name, context)
        totals[category] += _duration(event)
        return
    children = event.cpu_children
    for child in children:
        attribute(child, totals, context, named)
    totals[named or context] += _duration(event) - sum(_duration(child) for child in children)


def _duration(event) -> float:
    return event.time_range.end - event.time_range.start


def breakdown(step_events: list, step_ms: float) -> list[dict]:
    """The mean step's categories: [{category, ms, share}] (ms per step, share of `step_ms`), each named category
    from the events of the `ic::step` ranges in `step_events` and "other" the rest of `step_ms`, so that they sum
    to it."""
    totals: Counter = Counter()
    for event in step_events:
        attribute(event, totals)
    per_step = {category: totals[category] / 1e3 / len(step_events) for category in CATEGORIES}
    return _rows(per_step, step_ms)


def _rows(per_step: dict, step_ms: float) -> list[dict]:
    """[{category, ms, share}]: the categories with time (the compiled graph's only where it has some), and "other"
    the rest of `step_ms`."""
    named = {category: ms for category, ms in per_step.items() if category != OTHER and (ms or category != COMPILED)}
    rows = [{"category": category, "ms": ms} for category, ms in named.items()]
    rows.append({"category": OTHER, "ms": step_ms - sum(named.values())})
    for row in rows:
        row["share"] = row["ms"] / step_ms
    return rows


def device_kernel_category(name: str) -> str:
    """The category of a kernel on a GPU, from its name: inductor's kernels list the ops they fuse (a norm fused into
    a projection is a projection: 'triton_red_fused__fused_rms_norm__to_copy_mm_mul_t_13'), library kernels their
    kind (a cuBLAS or CUTLASS GEMM is a projection, a softmax attention's); our Triton attention kernel is `attend`.
    A pointwise kernel is never a projection: 'triton_poi_fused_add_index_mm_mul_roll_...' is RoPE on a projection's
    output. The rest of inductor's kernels are the compiled graph's; the rest of ATen's (an eager step's gathers,
    casts and elementwise ops), other."""
    words = set(re.split(r"[^a-z0-9]+", name.lower()))
    if "index_copy" in name or "index_put" in name:
        return KV_WRITES
    if words & {"attend", "attention", "softmax", "flash", "fmha"}:
        return ATTENTION
    if "argmax" in name.lower() or words & {"multinomial", "topk", "sort"}:
        return SAMPLING
    pointwise = name.startswith("triton_poi")  # inductor names a pointwise kernel after the matmuls it reads too
    if not pointwise and (words & {"mm", "bmm", "addmm", "gemv", "int4pack", "int8pack"} or "gemm" in name
                          or name.startswith(("nvjet", "cutlass", "int4_rows"))):  # int4_rows: quant.triton_int4
        return PROJECTIONS
    if words & {"rsqrt", "rms", "roll"} or "layer_norm" in name:  # ATen's RMSNorm runs its layer-norm kernel
        return NORMS
    return COMPILED if name.startswith("triton_") else OTHER  # an eager step's gathers, casts and adds: other


def device_breakdown(trace_events: list[dict], step_ms: float, top: int = 12) -> tuple[list[dict], list[dict]]:
    """On a GPU, where the mean step's device time goes, from the profiler's Chrome trace: the kernels, copies and
    sets that started inside each step's `ic::step` range (the host waits for the device at each step's end, so a
    step's device work lies inside its range), by `device_kernel_category`, and "device idle" the rest of `step_ms`,
    the time the device waited for the host. (The kernels a CUDA graph replays are on the trace's device timeline,
    one by one, while the profiler's per-op device totals miss many of them.) Returns (breakdown, the `top`
    costliest kernels: [{name, category, calls, ms}] per step)."""
    steps = [(event["ts"], event["ts"] + event["dur"]) for event in trace_events
             if event.get("cat") == "user_annotation" and event.get("name") == STEP]
    if not steps:
        raise ConfigError("the profiler's trace holds no recorded step")
    per_category: Counter = Counter()
    times, calls = Counter(), Counter()
    for event in trace_events:
        if event.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset") or not any(
                start <= event["ts"] < end for start, end in steps):
            continue
        name = event["name"]
        category = device_kernel_category(name) if event["cat"] == "kernel" else OTHER
        per_category[category] += event["dur"]
        times[name] += event["dur"]
        calls[name] += 1
    per_step = {category: per_category[category] / 1e3 / len(steps) for category in CATEGORIES if category != PYTHON}
    per_step[IDLE] = max(0.0, step_ms - sum(per_step.values()))
    rows = _rows(per_step, step_ms)
    kernels = [{"name": name, "category": device_kernel_category(name), "calls": calls[name] / len(steps),
                "ms": us / 1e3 / len(steps)} for name, us in times.most_common(top)]
    return rows, kernels


def run_profile(args) -> int:
    if not 1 <= args.steps <= 10_000:
        raise ConfigError(f"--steps is the number of engine steps to record: from 1 to 10000, got {args.steps}.")
    if not 0 <= args.warmup_steps <= 1_000:
        raise ConfigError(f"--warmup-steps must be from 0 to 1000, got {args.warmup_steps}.")
    needed = tokens_needed(args.steps, args.warmup_steps)
    if args.max_new_tokens < needed:
        raise ConfigError(f"--max-new-tokens {args.max_new_tokens} ends the requests before the recorded steps: the "
                          f"prefill, {args.warmup_steps} warm-up steps, {args.steps} unrecorded and 1 + {args.steps} "
                          f"recorded steps need at least {needed}; raise --max-new-tokens or lower --steps.")
    settings = LaneSettings.from_args(args)
    engine = _build_engine(args, settings)
    params = settings.sampling(args.max_new_tokens, top_k=args.top_k, stop=tuple(args.stop), ignore_eos=True,
                               min_tokens=args.min_tokens, stop_token_ids=tuple(args.stop_token_id),
                               logprobs=args.logprobs)
    copies = [params if i == 0 or params.seed is None else replace(params, seed=params.seed + i)
              for i in range(args.n)]
    options = {"system": args.system, "chat": not args.no_chat, "spec": settings.spec()}
    for prompt, priority in zip(args.prompt, args.priority or [0] * len(args.prompt)):
        for request in engine.make_copies(prompt, copies, priority=priority, **options):
            engine.enqueue(request)
    engine.drain()

    def join() -> None:  # a fresh copy of each joining prompt, between two steps
        for prompt in args.join_prompt:
            for request in engine.make_copies(prompt, [params], **options):
                engine.enqueue(request)
        engine.drain()

    report = record_steps(engine, args.steps, args.warmup_steps, args.trace, join if args.join_prompt else None,
                          settings.spec())
    if args.json:
        print(json.dumps(report))
    else:
        print(format_table(report))
    return 0


def _build_engine(args, settings: LaneSettings) -> Engine:
    """The engine `generate` would build from these flags."""
    config = generate_config(args, settings)
    loaded = quantize(load_model(args.model, args.device, args.dtype), settings.quant(args.quant_lm_head))
    draft = load_model(args.draft_model, args.device, loaded.dtype_name) if args.draft_model else None
    engine = Engine(loaded, config, draft_model=draft)
    if args.kernels:
        if engine.decoder is None:
            raise ConfigError("--kernels splits a compiled step into its kernels: add --compile.")
        engine.decoder.record_kernels()
    if args.draft_heads:
        engine.load_draft_heads(args.spec_method, args.draft_heads)
    return engine


def tokens_needed(steps: int, warmup_steps: int) -> int:
    """New tokens a request needs to stay running through `record_steps`: its prefill, the warm-up steps, as many
    unrecorded steps as recorded ones, and the profiler's first (untimed) step."""
    return 2 + warmup_steps + 2 * steps


def profile_requests(engine: Engine, requests: list, steps: int, warmup_steps: int, trace: str | None = None) -> dict:
    """Queue `requests` on `engine` all at once, record their steps (`record_steps`) and end whatever is left, so
    that the engine holds no KV afterwards (the page's profile action: in the engine loop's thread, the device its
    own meanwhile)."""
    for request in requests:
        engine.enqueue(request)
    engine.drain()
    try:
        return record_steps(engine, steps, warmup_steps, trace, spec=requests[0].spec if requests else None)
    finally:
        for request in requests:
            engine.cancel(request)


def record_steps(engine: Engine, steps: int, warmup_steps: int, trace: str | None = None,
                 join: Callable[[], None] | None = None, spec=None) -> dict:
    """Warm up (every running request past its first token, then `warmup_steps` more), record `steps` steps and
    return the report (see the module docstring). `join`, where given, submits more requests before the unrecorded
    steps and again before the recorded ones (their prompts' steps are then mixed with the running decodes). A
    compiled engine first readies every bucket's packages (and the query steps of `spec`, the requests'
    `SpecConfig`), so that none is built or loaded in a recorded step when the batch grows or shrinks."""
    # 1. Warm-up: every package, prefill, then steps that fill caches and let the clock settle.
    if engine.decoder is not None:
        engine.warm_up_compiled(tuple(engine.decoder.buckets), spec)
    while engine.has_work() and not (engine.scheduler.running and all(
            request.seq.num_generated_tokens > 0 for request in engine.scheduler.running)):
        engine.step()
    for _ in range(warmup_steps):
        if engine.has_work():
            engine.step()
    # 2. As many steps again without the profiler: what its recording adds to a step.
    if join is not None:
        join()
    unprofiled = [_timed_step(engine) for _ in range(steps) if engine.has_work()]
    if join is not None:
        join()
    compiled_before = None  # the compiled engine's counts after the profiler's untimed step
    cuda = engine.loaded.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    walls, reports, step_events = [], [], []

    trace_events: list[dict] = []

    def collect(profiler) -> None:  # the end of the recorded steps (the profiler clears its events after this)
        step_events.extend(event for event in profiler.events() if event.name == STEP)
        if not (trace or cuda):
            return
        # On CUDA the device's timeline is read back from the trace (`device_breakdown`): where none was asked for,
        # from a temporary one.
        with tempfile.TemporaryDirectory() as folder:
            path = Path(trace) if trace else Path(folder) / "trace.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            profiler.export_chrome_trace(str(path))
            if cuda:
                with (gzip.open if path.suffix == ".gz" else open)(path, "rt") as file:
                    trace_events.extend(json.load(file)["traceEvents"])

    # 3. One untimed step with the profiler on (its first events cost more), then the recorded steps.
    with _graph_call_ranged(engine), profile(activities=activities, on_trace_ready=collect, acc_events=True,
                                             schedule=schedule(wait=0, warmup=1, active=steps)) as profiler:
        for index in range(1 + steps):
            if not engine.has_work():
                break
            if index == 1 and engine.decoder is not None:
                compiled_before = engine.decoder.stats.as_dict()
            wall, report = _timed_step(engine, record_function(STEP))
            if index > 0:
                walls.append(wall)
                reports.append(report)
            profiler.step()
    if not walls or not step_events:
        raise ConfigError("the requests ended before any step was recorded; raise --max-new-tokens.")
    if len(walls) < steps:
        print(f"[the requests ended after {len(walls)} of {steps} recorded steps]", file=sys.stderr)
    step_ms = statistics.mean(walls) * 1e3
    if cuda:
        rows, kernels = device_breakdown(trace_events, step_ms)
    else:
        rows = breakdown(step_events, step_ms)
        kernels = graph_kernels(step_events) if engine.decoder is not None else []
    loaded = engine.loaded
    return {"steps": len(walls), "step_ms": step_ms, "breakdown": rows,
            "compiled_forwards": engine.decoder.stats.since(compiled_before) if compiled_before is not None else None,
            "profiled_ms": statistics.mean(_duration(event) for event in step_events) / 1e3,
            "unprofiled_step_ms": statistics.mean(wall for wall, _ in unprofiled) * 1e3 if unprofiled else None,
            "model": loaded.display_name, "dtype": loaded.dtype_name, "device": str(loaded.device),
            "compiled": engine.decoder is not None,
            "batch_size": statistics.mean(report.batch_size for report in reports),
            "work": dict(Counter(kind for report in reports for _, kind, _ in report.work)), "kernels": kernels}


def graph_kernels(step_events: list, top: int = 12) -> list[dict]:
    """The `top` costliest events inside the compiled graph's calls of the recorded steps (the kernels, where the
    step was compiled with `--kernels`), grouped by name less inductor's graph prefix and numbered suffix (the same
    kernel in every layer): [{name, category, calls, ms}], calls and ms per step."""
    times, calls = Counter(), Counter()

    def walk(event, inside: bool) -> None:
        for child in event.cpu_children:
            if inside:
                name = re.sub(r"_\d+$", "", re.sub(r"^graph_\d+_", "", child.name))
                times[name] += _duration(child)
                calls[name] += 1
            else:
                walk(child, child.name == GRAPH)

    for event in step_events:
        walk(event, False)
    steps = max(len(step_events), 1)
    return [{"name": name, "category": kernel_category(name), "calls": calls[name] / steps, "ms": us / 1e3 / steps}
            for name, us in times.most_common(top)]


@contextlib.contextmanager
def _graph_call_ranged(engine: Engine):
    """A compiled engine's graph calls (each package: decode, query and flat steps; or torch.compile's graph) as one
    range, `ic::compiled_graph`, while this lasts: the profiler sees no kernel inside a call (the range is set on the
    decoder object here, so that compiled.py pays nothing)."""
    decoder = engine.decoder
    if decoder is None:
        yield
        return
    name = "_call_package" if decoder.backend == "aoti" else "_call"
    call = getattr(decoder, name)

    def ranged_call(*args):
        with record_function(GRAPH):
            return call(*args)

    setattr(decoder, name, ranged_call)
    try:
        yield
    finally:
        delattr(decoder, name)  # the class's method again


def _timed_step(engine: Engine, inside=contextlib.nullcontext()):
    """(wall seconds, StepReport) of one engine step run inside `inside` (a range, for the recorded steps), the
    device synchronized before the clock is read."""
    started = time.perf_counter()
    with inside:
        report = engine.step()
    if engine.loaded.device.type == "cuda":
        torch.cuda.synchronize(engine.loaded.device)
    return time.perf_counter() - started, report


def format_table(report: dict) -> str:
    work = ", ".join(f"{count} {kind}" for kind, count in report["work"].items())
    lines = [f"{report['model']} ({report['dtype']}) on {report['device']}, "
             f"{'compiled' if report['compiled'] else 'eager'}: {report['steps']} steps of mean batch "
             f"{report['batch_size']:.1f} ({work}), {report['step_ms']:.2f} ms per step recorded"
             + (f" ({report['unprofiled_step_ms']:.2f} ms per step just before, unrecorded)"
                if report["unprofiled_step_ms"] is not None else ""),
             *([f"forwards in the recorded steps: {forwards_words(report['compiled_forwards'])}"]
               if report.get("compiled_forwards") else []),
             "| category | ms per step | share |", "|---|---|---|"]
    for row in report["breakdown"]:
        lines.append(f"| {row['category']} | {row['ms']:.3f} | {100 * row['share']:.1f}% |")
    if report["kernels"]:
        where = "on the device" if report["device"].startswith("cuda") else "in the compiled graph"
        lines += ["", f"| kernel {where} | category | calls per step | ms per step |", "|---|---|---|---|"]
        lines += [f"| {kernel['name'][:90]} | {kernel['category']} | {kernel['calls']:.0f} | {kernel['ms']:.3f} |"
                  for kernel in report["kernels"]]
    elif report["compiled"]:
        lines.append("(the compiled graph holds the decode forward's projections, attention, norms and RoPE, fused by "
                     "inductor: the profiler sees no kernel inside it; --kernels splits it)")
    return "\n".join(lines)
