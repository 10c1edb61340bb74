"""What our CUDA-only code shares: the device's multiprocessor count, which sizes our Triton kernels' grids
(`engine.triton_attention`, `quant.triton_int4`), and the time a call takes inside a CUDA graph, which decides
between kernels (`quant.kernels.int4_path`) and times them in `gpu-report` (`bench.kernel_timing`)."""

from __future__ import annotations

import functools
import statistics

import torch

INTERPRETER_MULTIPROCESSORS = 132  # an H100's: what Triton's interpreter (the tests, on a CPU) sizes the grids for


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """The device's multiprocessors (`INTERPRETER_MULTIPROCESSORS` off CUDA)."""
    if device.type != "cuda":
        return INTERPRETER_MULTIPROCESSORS
    return torch.cuda.get_device_properties(device).multi_processor_count


def graph_seconds(call, calls: int = 20, replays: int = 5) -> float:
    """Seconds one `call()` takes on the current CUDA device, from a CUDA graph of `calls` calls (so the host's
    launches are not what is timed): the median of `replays` replays, timed with device events, after one untimed
    replay. `call` runs once first, outside the capture (a Triton kernel compiles then)."""
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            call()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times)
