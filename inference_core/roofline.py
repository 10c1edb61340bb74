"""The roofline: what a device can do and where a run sits under it.

- `Ceilings` (`measure_ceilings`, kept per host, device and dtype in the local cache, `refresh=True` measures again):
  the memory bandwidth a full read of a large buffer reaches and the throughput of a large matrix product in the
  model's dtype, each the best of a few timed runs after a warm-up.
- `forward_work(config, weights_bytes, kv_bytes_per_token, ...)`: the FLOPs and bytes of one forward from the model's
  configuration, the one place they are counted (with `weights_read_per_step`, the weights' share, which `bench`
  and `gpu-report` use for their bandwidth limits too). FLOPs: 2 per weight per token through the projections, 2 per
  weight per logits row through the LM head, and 4 x heads x head_dim per layer per key a token attends to (scores
  and the weighted sum). Bytes: every weight read once per forward (shared by the whole batch), the context's K and V
  read, the new tokens' K and V written.
- `run_points(...)`: a finished request's prefill and decode as points (arithmetic intensity in FLOPs per byte,
  achieved FLOP/s from its measured time), so a lane's decode sits against the memory roof and its prefill climbs
  toward the compute roof; `batch` > 1 (the mean batch its decode steps had) shares the weights' bytes, which is
  what moves a batched point right.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

import torch

from inference_core.config import ModelConfig
from inference_core.model.dtype_choice import cpu_name
from inference_core.model.paths import cache_root
from inference_core.quant.linear import weight_bytes

PROBE_BYTES = 512 << 20  # the bandwidth probe's buffer: past every cache
MATMUL_SIZE = 2048  # the throughput probe's square matrices (CUDA: 8192)


@dataclass(frozen=True)
class Ceilings:
    bandwidth_bytes_per_s: float
    peak_flops_per_s: float
    device: str
    dtype: str

    @property
    def ridge(self) -> float:
        """The arithmetic intensity (FLOPs per byte) where the two roofs meet."""
        return self.peak_flops_per_s / self.bandwidth_bytes_per_s


def measure_ceilings(device: torch.device, dtype: torch.dtype, refresh: bool = False, repeats: int = 5) -> Ceilings:
    """This host's ceilings for `device` and `dtype`: from the local cache, or measured now and cached."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    key = f"{device.type}|{name}|{dtype}|{torch.get_num_threads()}"
    path = cache_root() / "roofline.json"
    known = json.loads(path.read_text()) if path.is_file() else {}
    if key in known and not refresh:
        return Ceilings(**known[key])
    ceilings = Ceilings(_bandwidth(device, repeats), _matmul_flops(device, dtype, repeats), name,
                        str(dtype).removeprefix("torch."))
    known[key] = asdict(ceilings)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(known, indent=1, sort_keys=True))
    return ceilings


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a CUDA device; the CPU works synchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_runs(device: torch.device, work, repeats: int) -> list[float]:
    """Seconds of each of `repeats` runs of `work` after one untimed warm-up, the device synchronized around each."""
    work()
    times = []
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        work()
        synchronize(device)
        times.append(time.perf_counter() - started)
    return times


def read_bandwidth(device: torch.device, size_bytes: int, repeats: int) -> float:
    """Bytes per second a full read of a `size_bytes` fp32 buffer achieves (a sum of it, the best of `repeats`)."""
    buffer = torch.ones(size_bytes // 4, dtype=torch.float32, device=device)
    return size_bytes / min(timed_runs(device, buffer.sum, repeats))


def read_rate(views: list[torch.Tensor], repeats: int = 5) -> float:
    """Bytes per second a sum over `views` (memory already there, read in place, on one device) achieves, the best
    of `repeats`."""
    size = sum(view.numel() * view.element_size() for view in views)
    return size / min(timed_runs(views[0].device, lambda: [view.sum() for view in views], repeats))


def _bandwidth(device: torch.device, repeats: int) -> float:
    return read_bandwidth(device, PROBE_BYTES, repeats)


def _matmul_flops(device: torch.device, dtype: torch.dtype, repeats: int) -> float:
    size = 8192 if device.type == "cuda" else MATMUL_SIZE
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    return 2 * size**3 / min(timed_runs(device, lambda: a @ b, repeats))


def weights_read_per_step(model) -> int:
    """Bytes of weights one forward reads: every weight as stored (quantized projections at their size), the
    embedding table only as the LM head when tied (an untied table, or one whose head is a transposed or quantized
    copy, is read one row per token: nothing to count)."""
    embedding = model.embed_tokens.weight
    total = weight_bytes(model)
    head = getattr(model.lm_head, "weight", None)
    if head is None or head.data_ptr() != embedding.data_ptr():
        total -= embedding.numel() * embedding.element_size()
    return total


def projection_weights(config: ModelConfig) -> int:
    """Weights one token goes through in the decoder layers' projections (the LM head apart)."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    per_layer = config.hidden_size * (q + 2 * kv) + q * config.hidden_size + 3 * config.hidden_size * \
        config.intermediate_size
    return config.num_layers * per_layer


def forward_work(config: ModelConfig, weights_bytes: float, kv_bytes_per_token: float, new_tokens: int,
                 attended_keys: int, logits_rows: int) -> tuple[float, float]:
    """(FLOPs, bytes) of one forward computing `new_tokens` tokens that attend to `attended_keys` keys in all (each
    token's context, itself included, summed), with `logits_rows` rows through the LM head."""
    flops = 2 * projection_weights(config) * new_tokens + 2 * config.hidden_size * config.vocab_size * logits_rows
    flops += 4 * config.num_layers * config.num_heads * config.head_dim * attended_keys
    bytes_moved = weights_bytes + kv_bytes_per_token * (attended_keys + new_tokens)
    return float(flops), float(bytes_moved)


def run_points(config: ModelConfig, weights_bytes: float, kv_bytes_per_token: float, prompt_tokens: int,
               cached_prompt_tokens: int, generated_tokens: int, ttft_s: float, decode_s: float,
               batch: float = 1.0) -> list[dict]:
    """A finished request's prefill (one forward of the prompt's uncached tokens) and decode (its steps after the
    first token, the weights' bytes shared by `batch` sequences) as roofline points."""
    points = []
    computed = prompt_tokens - cached_prompt_tokens
    if computed > 0 and ttft_s > 0:
        keys = sum(range(cached_prompt_tokens + 1, prompt_tokens + 1))
        flops, moved = forward_work(config, weights_bytes, kv_bytes_per_token, computed, keys, 1)
        points.append(_point("prefill", flops, moved, ttft_s))
    steps = generated_tokens - 1
    if steps > 0 and decode_s > 0:
        keys = sum(range(prompt_tokens + 1, prompt_tokens + steps + 1))
        # every step reads the weights once, shared by the `batch` sequences it decodes
        flops, moved = forward_work(config, steps * weights_bytes / max(batch, 1.0), kv_bytes_per_token, steps, keys,
                                    steps)
        points.append(_point("decode", flops, moved, decode_s))
    return points


def steps_point(config: ModelConfig, weights_bytes: float, kv_bytes_per_token: float, steps: list[tuple], phase: str,
                ) -> dict | None:
    """A run of engine steps as one roofline point: `steps` is [(seconds, [(context, tokens, logits_rows), ...])],
    each step's sequences with the tokens already in their cache, the tokens the step forwarded for them and the rows
    they sent through the LM head. Every step reads the weights once, whatever its batch. None without a step."""
    flops = moved = seconds = 0.0
    for step_s, work in steps:
        if not work:
            continue
        new_tokens = sum(tokens for _, tokens, _ in work)
        keys = sum(tokens * context + tokens * (tokens + 1) // 2 for context, tokens, _ in work)
        step_flops, step_bytes = forward_work(config, weights_bytes, kv_bytes_per_token, new_tokens, keys,
                                              sum(rows for _, _, rows in work))
        flops, moved, seconds = flops + step_flops, moved + step_bytes, seconds + step_s
    return _point(phase, flops, moved, seconds) if seconds > 0 else None


def _point(phase: str, flops: float, moved: float, seconds: float) -> dict:
    return {"phase": phase, "flops": flops, "bytes": moved, "seconds": seconds, "intensity": flops / moved,
            "flops_per_s": flops / seconds, "bytes_per_s": moved / seconds}
