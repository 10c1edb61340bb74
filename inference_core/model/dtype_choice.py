"""`--dtype auto`: the dtype a model decodes fastest in on this device, chosen the same way at every start.

CUDA: bfloat16 (float16 on a GPU without bf16). A CPU: its capability decides first. Without native bf16 math
(AVX-512 BF16 or AMX) bf16 matmuls are emulated and slower than fp32, so float32, with nothing measured. With it, a
measurement confirms the win before bf16 is chosen: one decode step's projections of this model (enough layers to
stream `PROBE_BYTES` of fp32 weights from memory, as a decode step does), each dtype in the weight layout the model
would use (`llama.weight_layout`), warmed up, then timed in `ROUNDS` rounds of `REPEATS` passes each that alternate
which dtype goes first. The speed-up is the best fp32 timing over the best bf16 timing: load only adds time, so the
best of many interleaved timings is each dtype's own speed, whatever else the host runs meanwhile. The probe runs on
one thread: a pass on two threads needs both cores at once, which a busy host rarely gives (measured on a 2-core
host at a load average of 10: on one thread 1.70-2.02x over eight trials; on two, 0.3-2.6x). bf16 is chosen at
`MARGIN` or more. The result is kept per host and model shape in the local cache (`cache_file()`), so the
measurement runs once and every later start on this host reads the same answer, whatever the host's load then.
"""

from __future__ import annotations

import json
import math
import platform
import time
from pathlib import Path
from typing import Callable

import torch

from inference_core.config import ModelConfig
from inference_core.model.llama import Linear, native_bf16_math, weight_layout
from inference_core.model.paths import cache_root

PROBE_BYTES = 64 << 20  # fp32 weight bytes a probe pass streams: past the CPU's caches, as decode streams them
ROUNDS = 15
REPEATS = 3
MARGIN = 1.1  # bf16 must decode at least this much faster than fp32 to be chosen


def choose_dtype(device: torch.device, config: ModelConfig,
                 clock: Callable[[], float] = time.perf_counter) -> tuple[torch.dtype, str]:
    """`--dtype auto` for `config` on `device`, with the reason in words (see the module docstring); `clock` times
    the probe (a test injects a noisy one)."""
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, "the GPU's native fast dtype"
        return torch.float16, "this GPU has no bf16 support"
    if device.type != "cpu":
        return torch.float32, f"no measured choice for {device.type}"
    native = native_bf16_math()
    if not native:
        capability = torch.backends.cpu.get_cpu_capability()
        return torch.float32, (f"this CPU ({capability}) has no native bf16 math, so bf16 would run emulated and "
                               "slower")
    speedup = cached_speedup(config, clock)
    features = ", ".join(native)
    if speedup >= MARGIN:
        return torch.bfloat16, (f"this CPU has native bf16 math ({features}) and this model's decode step ran "
                                f"{speedup:.1f}x faster in bf16 than in float32 here")
    return torch.float32, (f"this CPU has native bf16 math ({features}), but this model's decode step ran only "
                           f"{speedup:.2f}x as fast in bf16 as in float32 here (bf16 is chosen from {MARGIN}x)")


def cache_file() -> Path:
    return cache_root() / "dtype-choice.json"


def cached_speedup(config: ModelConfig, clock: Callable[[], float] = time.perf_counter) -> float:
    """This host's measured bf16 speed-up for `config`'s shape: from the cache, or measured now and cached."""
    path, key = cache_file(), _key(config)
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if key in known:
        return float(known[key]["speedup"])
    speedup = decode_speedup(config, clock)
    known[key] = {"speedup": round(speedup, 4), "measured": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(known, indent=1, sort_keys=True))
    except OSError:  # a read-only home: measured again at the next start
        pass
    return speedup


def decode_speedup(config: ModelConfig, clock: Callable[[], float] = time.perf_counter) -> float:
    """fp32 time over bf16 time of one decode step's projections of `config` (module docstring), on one thread."""
    fp32_pass, bf16_pass = (_decode_pass(config, dtype) for dtype in (torch.float32, torch.bfloat16))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return measured_speedup(fp32_pass, bf16_pass, clock)
    finally:
        torch.set_num_threads(threads)


def measured_speedup(fp32_pass: Callable[[], None], bf16_pass: Callable[[], None],
                     clock: Callable[[], float] = time.perf_counter, rounds: int = ROUNDS,
                     repeats: int = REPEATS) -> float:
    """The best fp32 timing over the best bf16 timing, each over `rounds` rounds of `repeats` passes, after one
    untimed pass of each; the dtype that goes first alternates between rounds. Load only ever adds time, so the best
    of many timings is the closest to the host's own speed, and interleaving gives both dtypes the same quiet
    moments (a median does not do: on a busy 2-core host most two-thread passes wait for a core)."""
    fp32_pass(), bf16_pass()  # warm-up: first-call allocations, oneDNN's kernel selection
    best = {fp32_pass: math.inf, bf16_pass: math.inf}
    for index in range(rounds):
        for run in (fp32_pass, bf16_pass) if index % 2 == 0 else (bf16_pass, fp32_pass):
            for _ in range(repeats):
                started = clock()
                run()
                best[run] = min(best[run], clock() - started)
    return best[fp32_pass] / max(best[bf16_pass], 1e-12)


def _decode_pass(config: ModelConfig, dtype: torch.dtype) -> Callable[[], None]:
    """One row through a decode step's projections (q, k, v, o, gate, up, down) of as many layers as stream
    PROBE_BYTES of fp32 weights, in `dtype` and the layout the model would use for it here."""
    cpu = torch.device("cpu")
    head_dim = config.head_dim
    shapes = [(config.hidden_size, config.num_heads * head_dim),
              (config.hidden_size, config.num_kv_heads * head_dim),
              (config.hidden_size, config.num_kv_heads * head_dim),
              (config.num_heads * head_dim, config.hidden_size),
              (config.hidden_size, config.intermediate_size), (config.hidden_size, config.intermediate_size),
              (config.intermediate_size, config.hidden_size)]
    layer_bytes = 4 * sum(rows * columns for rows, columns in shapes)
    layers = max(1, min(config.num_layers, math.ceil(PROBE_BYTES / layer_bytes)))
    generator = torch.Generator().manual_seed(0)
    projections = []
    for in_features, out_features in shapes * layers:
        layer = Linear(in_features, out_features, bias=False)
        layer.weight.data = torch.randn(out_features, in_features, generator=generator).to(dtype)
        layer.use_layout(weight_layout(cpu, dtype))
        projections.append((layer, torch.randn(1, in_features, generator=generator).to(dtype)))

    @torch.inference_mode()
    def run() -> None:
        for layer, x in projections:
            layer(x)
    return run


def _key(config: ModelConfig) -> str:
    """The host (CPU, its kernels, torch) and the model's shape: what the speed-up depends on."""
    host = (cpu_name(), torch.backends.cpu.get_cpu_capability(), ",".join(native_bf16_math()), torch.__version__)
    shape = (f"hidden {config.hidden_size}", f"intermediate {config.intermediate_size}",
             f"heads {config.num_heads}/{config.num_kv_heads}x{config.head_dim}",
             f"layers {config.num_layers}")
    return " | ".join(host + shape)


def _cpuinfo() -> dict[str, str]:
    """The first CPU's fields in /proc/cpuinfo ('model name', 'cpu family', ...); empty where there is none."""
    try:
        first_cpu = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        return {}
    return {key.strip(): value.strip() for key, _, value in (line.partition(":") for line in first_cpu.splitlines())}


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform knows."""
    return _cpuinfo().get("model name") or platform.processor() or platform.machine()


def cpu_details() -> dict:
    """What tells hosts with the same model name apart (a VM often shows only 'AMD EPYC'): the CPU's family and model
    numbers (/proc/cpuinfo; family 25 is AMD's Zen 3 and 4, 26 Zen 5) and its data cache sizes per level (/sys), where
    Linux shows them; empty elsewhere."""
    fields = _cpuinfo()
    details = {"family_model": f"{fields['cpu family']}/{fields['model']}"} \
        if "cpu family" in fields and "model" in fields else {}
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            if (index / "type").read_text().strip() in ("Data", "Unified"):
                details[f"L{(index / 'level').read_text().strip()}"] = (index / "size").read_text().strip()
        except OSError:
            continue
    return details
