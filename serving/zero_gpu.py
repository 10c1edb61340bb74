"""ZeroGPU, Hugging Face's shared GPU Spaces: the page's GPU work inside `spaces.GPU` calls, each asking for the time
and the card size the work needs.

On a ZeroGPU Space (the `spaces` package installed and `SPACES_ZERO_GPU` set, which its own `Config` reads) the main
process has no GPU: a call of a function wrapped in `spaces.GPU(duration=..., size=...)` is scheduled on a card for
at most `duration` seconds and runs in a worker process forked for it, so nothing on the GPU outlives a call. So:

- a race runs both lanes inside one call (the race's handler streams both; the engine loop's thread starts in the
  worker), a chat turn, a batching-lab run and a Stack climb each inside one call too (`gpu_task`);
- each call asks for the device time our cost model estimates for the work (`serving.cost.StepCosts`, through
  `admission.job_seconds`) times `ESTIMATE_MARGIN`, plus `WORKER_START_S` for the worker's start; where the estimate
  cannot be made without the device (no figure measured yet), the deployment's limit on a run (`pool.max_run_s`).
  The figures the engine measures in a worker are kept on disk after each call (`COSTS_FILE`) and read back by the
  main process, whose own cost model never sees a step;
- the size is "xlarge" (a whole RTX PRO 6000, `inference_core.cards`) where the serving settings' memory plan at the
  full context does not fit half a card, else "large".

Elsewhere (no package, or the package on a machine that is not a ZeroGPU Space, where `spaces.GPU` returns the
function itself) everything runs in this process as usual. `on_zero_gpu()` tells which.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import math
from typing import Callable

from inference_core.cards import ZERO_GPU_SIZES
from inference_core.config import ConfigError
from inference_core.model.paths import cache_root
from inference_core.planner import plan_memory
from serving.admission import Job, job_seconds

log = logging.getLogger(__name__)

# A call asks for this many times the estimate: the estimate of a race measured 1.4x short of its device time on a
# busy 2-core host (serving.cost.START_SHARE); a call that runs past its duration is ended by ZeroGPU mid-stream.
ESTIMATE_MARGIN = 2.0
# A fresh worker's start before the work: CUDA's initialization and the weights' move onto the card. Not measured
# (no ZeroGPU Space at hand); an allowance.
WORKER_START_S = 20.0
MEMORY_HEADROOM = 0.9  # the share of a card's memory a plan may fill (CUDA's context and the allocator's slack)
COSTS_FILE = "zero_gpu_costs.json"


def on_zero_gpu() -> bool:
    """Whether this process serves a ZeroGPU Space: the `spaces` package is installed and its configuration says
    ZeroGPU (`SPACES_ZERO_GPU`)."""
    try:
        from spaces.config import Config  # optional dependency: installed on a Space
    except ImportError:
        return False
    return bool(Config.zero_gpu)


def gpu_size(pool) -> str:
    """'large' (half a card) where the serving settings' memory plan (the weights, the KV pool, activations at the
    full context) fits in it with headroom, else 'xlarge' (a whole card)."""
    settings = pool.serving
    plan = plan_memory(pool.loaded, settings.engine_config(pool.max_seq_len), settings.quant(),
                       free_bytes=ZERO_GPU_SIZES["large"].memory_bytes)
    needed = plan.weights_bytes + plan.kv_pool_bytes + plan.kv_tail_bytes + plan.activation_bytes
    return "large" if needed <= MEMORY_HEADROOM * ZERO_GPU_SIZES["large"].memory_bytes else "xlarge"


def gpu_seconds(pool, job: Job | None) -> int:
    """The device time a call running `job` asks for (see the module docstring): the estimate with its margin, capped
    at the run limit, or the run limit where there is no job to estimate or no figure yet; plus the worker's start."""
    _adopt_saved_costs(pool)
    estimate = job_seconds(pool, job) if job is not None else None
    work = pool.max_run_s if estimate is None else min(pool.max_run_s, ESTIMATE_MARGIN * estimate)
    return math.ceil(WORKER_START_S + work)


def gpu_task(pool, handler: Callable, job_of: Callable[..., Job | None] | None = None) -> Callable:
    """`handler` as the page and the API call it: on a ZeroGPU Space wrapped in `spaces.GPU`, with a duration from
    `job_of(*args, **kwargs)` (the handler's own arguments as the Job it will run; None: the run limit) and the size
    of the serving settings; elsewhere `handler` itself."""
    if not on_zero_gpu():
        return handler
    import spaces  # optional dependency: installed on a Space

    def duration(*args, **kwargs) -> int:
        try:
            job = job_of(*args, **kwargs) if job_of is not None else None
        except (ConfigError, ValueError, TypeError):  # bad input: the handler says so in its words, inside the call
            job = None
        return gpu_seconds(pool, job)

    @functools.wraps(handler)
    def in_worker(*args, **kwargs):
        try:
            return (yield from handler(*args, **kwargs))
        finally:
            _save_costs(pool)

    @functools.wraps(handler)
    def in_worker_once(*args, **kwargs):
        try:
            return handler(*args, **kwargs)
        finally:
            _save_costs(pool)

    wrapped = in_worker if inspect.isgeneratorfunction(_unwrapped(handler)) else in_worker_once
    return spaces.GPU(wrapped, duration=duration, size=gpu_size(pool))


def _unwrapped(handler: Callable) -> Callable:
    """The function under `functools.partial`s."""
    while isinstance(handler, functools.partial):
        handler = handler.func
    return handler


def _costs_path():
    return cache_root() / COSTS_FILE


def _save_costs(pool) -> None:
    """After a call, in its worker: the cost model's figures, for the main process's next estimate."""
    try:
        path = _costs_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({_model_key(pool): pool.costs.figures()}))
    except OSError as error:
        log.warning("could not keep the measured step costs for the next call's duration: %s", error)


def _adopt_saved_costs(pool) -> None:
    """In the main process: the figures the last call's worker measured (steps measured here still come first)."""
    path = _costs_path()
    try:
        saved = json.loads(path.read_text()).get(_model_key(pool)) if path.is_file() else None
    except (OSError, ValueError):
        saved = None
    if saved:
        pool.costs.adopt(saved)


def _model_key(pool) -> str:
    loaded = pool.loaded
    return f"{loaded.name}|{loaded.device}|{loaded.dtype_name}|{pool.max_seq_len}"
