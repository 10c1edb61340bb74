"""What a configuration weighs in memory before it runs, and what the engine then allocated: the memory planner.

`plan_memory(loaded, config, quant, context_len, num_seqs)` gives, for a loaded model and the settings a lane would
use (dtype, weight quantization, KV mode and dtype, block size, sliding window, context length, sequences):

- `weights_bytes`: the weights as the engine stores them with that quantization. The unquantized figure is the
  engine's own count (`quant.linear.weight_bytes`: parameters and buffers, each tensor once; the CPU's packed bf16
  layout keeps a second, oneDNN copy of each projection beside it, outside this count); each projection the
  scheme replaces is taken out and its quantized tensors put in (int8: a byte per weight and a scale per output
  feature in the kernels' compute dtype; int4 and AWQ: half a byte per weight, in either device's packed layout, and
  a scale and a zero per group and output feature).
- `kv_bytes_per_token`, `kv_bytes_per_sequence` (a sequence of `context_len` tokens: whole blocks when paged, only
  the window's blocks with a sliding window, and those of its attention sinks; its whole slot when contiguous) and
  `kv_pool_bytes` (what the engine allocates for these settings: the paged pool with FlexAttention's spare blocks, or
  every contiguous slot). An int4 KV cache's figures are its 4-bit codes with their scales and minimums; beside them
  it writes each sequence's newest block in the model dtype (`kv_tail_bytes`: one block per sequence).
- `activation_bytes`: an estimate of one step's largest transient tensors from the shapes (the logits in fp32, the
  MLP's two intermediate projections, and one layer's attention scores for a prefill chunk), not a measurement.
- `sequences_that_fit`: how many sequences of `context_len` tokens fit in the device's free memory beside the weights
  and the activations (`free_bytes`: CUDA's free memory, or the host's available memory on the CPU).

`engine_figures(engine)` reads the same quantities off a built engine (its weights' bytes and the KV tensors it
allocated), the check beside the plan: tests/test_planner.py holds them equal for every KV dtype and quantization on
the bundled model.

    python -m inference_core memory-plan [--model M] [--dtype D] [--kv paged] [--kv-dtype int8] [--quant int4]
        [--max-seq-len N] [--max-num-seqs N] [--context N] [--check] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from inference_core.config import EngineConfig
from inference_core.engine.engine import Engine
from inference_core.kv import flex
from inference_core.kv.cache import INT4_BLOCK
from inference_core.model.llama import Linear
from inference_core.model.loader import LoadedModel, add_model_arguments, load_model
from inference_core.quant.linear import QuantConfig, compute_dtype, weight_bytes
from inference_core.quant.quantize import quantize
from inference_core.settings import LaneSettings, add_setting_arguments


@dataclass(frozen=True)
class MemoryPlan:
    weights_bytes: int
    kv_bytes_per_token: int
    kv_bytes_per_sequence: int
    kv_pool_bytes: int
    kv_tail_bytes: int
    activation_bytes: int
    free_bytes: int | None
    sequences_that_fit: int | None
    context_len: int
    num_seqs: int

    def as_dict(self) -> dict:
        return asdict(self)


def plan_memory(loaded: LoadedModel, config: EngineConfig, quant: QuantConfig = QuantConfig(),
                context_len: int | None = None, num_seqs: int | None = None,
                free_bytes: int | None = None) -> MemoryPlan:
    """The plan for `loaded` under `config` and `quant`, for `num_seqs` (default: the config's max_num_seqs)
    sequences of `context_len` tokens (default: the config's context length)."""
    model_config = loaded.config
    max_seq_len = config.context_length(model_config)
    context_len = min(context_len or max_seq_len, max_seq_len)
    num_seqs = num_seqs or config.max_num_seqs
    block = config.block_size if config.kv_mode == "paged" else INT4_BLOCK  # int4 keys' scales span a block
    per_token = model_config.kv_bytes_per_token(loaded.dtype, config.kv_dtype, block) \
        if config.kv_mode != "none" else 0
    window = config.attention_window(model_config)
    tail = num_seqs * block * model_config.kv_bytes_per_token(loaded.dtype) if config.kv_dtype == "int4" else 0
    if config.kv_mode == "paged":
        sinks = math.ceil(config.sink_tokens(model_config) / config.block_size) * config.block_size
        held = context_len if window is None else min(context_len, window + config.block_size + sinks)
        per_sequence = math.ceil(held / config.block_size) * config.block_size * per_token
        pool_blocks = config.num_kv_blocks(model_config)
        if config.attention == "flex":
            pool_blocks = flex.PoolLayout.for_pool(pool_blocks, config.block_size, loaded.device).total_pages
        pool = pool_blocks * config.block_size * per_token
    elif config.kv_mode == "contiguous":
        per_sequence = max_seq_len * per_token  # a slot holds the whole context, whatever the sequence uses
        pool = config.max_num_seqs * per_sequence
    else:
        per_sequence = pool = 0
    weights = quantized_weight_bytes(loaded, quant)
    activations = activation_bytes(loaded, config, num_seqs, context_len)
    free = free_bytes if free_bytes is not None else device_free_bytes(loaded.device)
    fits = None
    if free is not None and per_sequence:
        fits = max(0, (free - weights - activations - tail) // per_sequence)
    return MemoryPlan(weights, per_token, per_sequence, pool, tail, activations, free, fits, context_len, num_seqs)


def quantized_weight_bytes(loaded: LoadedModel, quant: QuantConfig) -> int:
    """The model's weights as stored under `quant` (see the module docstring)."""
    total = weight_bytes(loaded.model)
    if quant.scheme == "none":
        return total
    compute = compute_dtype(loaded.device.type, loaded.dtype, quant.scheme)
    scale_bytes = torch.finfo(compute).bits // 8
    counted: set[int] = set()
    for name, module in loaded.model.named_modules():
        if not isinstance(module, Linear) or (name == "lm_head" and not quant.lm_head):
            continue
        weight = module.weight
        in_features, out_features = weight.shape if module.in_out else weight.shape[::-1]
        if weight.data_ptr() not in counted and not _shared_elsewhere(loaded, name, module):
            total -= weight.numel() * weight.element_size()  # replaced, unless another layer keeps it
        counted.add(weight.data_ptr())
        if quant.scheme == "int8":
            total += out_features * in_features + out_features * scale_bytes
        else:
            groups = in_features // quant.group_size
            total += out_features * in_features // 2 + 2 * groups * out_features * scale_bytes
    return total


def _shared_elsewhere(loaded: LoadedModel, name: str, module: Linear) -> bool:
    """A tied LM head's weight is the embedding table, which stays when the head is quantized."""
    return name == "lm_head" and module.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()


def activation_bytes(loaded: LoadedModel, config: EngineConfig, num_seqs: int, context_len: int) -> int:
    """An estimate of one step's largest transients: the fp32 logits of every sequence, the MLP's gate and up
    projections of a full step's tokens, and one layer's attention scores (fp32) for a prefill chunk."""
    model_config, element = loaded.config, loaded.dtype.itemsize
    tokens = min(config.max_num_batched_tokens, num_seqs * context_len)
    logits = num_seqs * model_config.vocab_size * 4
    mlp = 2 * tokens * model_config.intermediate_size * element
    scores = model_config.num_heads * tokens * min(context_len, tokens + context_len) * 4
    return logits + mlp + scores


def device_free_bytes(device: torch.device) -> int | None:
    """Free memory on a CUDA device, or the host's available memory (Linux) for the CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def engine_figures(engine) -> dict:
    """What a built engine holds: its weights' bytes, its KV bytes per token and the KV tensors it allocated."""
    cache = engine.kv_cache
    if getattr(cache, "int4", None) is not None:
        tensors, tail = cache.int4.pool_tensors(), cache.int4.tail_bytes()
    else:
        tensors, tail = [tensor for tensor in (getattr(cache, "k", None), getattr(cache, "v", None))
                         if tensor is not None], 0
    return {"weights_bytes": weight_bytes(engine.loaded.model),
            "kv_bytes_per_token": getattr(cache, "bytes_per_token", 0),
            "kv_pool_bytes": sum(tensor.numel() * tensor.element_size() for tensor in tensors),
            "kv_tail_bytes": tail}


def add_memory_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """`python -m inference_core memory-plan`'s flags: the model's, the lane settings' (as `generate` has them), and
    the sequences to plan for."""
    add_model_arguments(parser)
    add_setting_arguments(parser)
    parser.add_argument("--quant-lm-head", action=argparse.BooleanOptionalAction, default=True,
                        help="quantize the LM head too (default: yes)")
    parser.add_argument("--max-seq-len", type=int, help="context length (default: the model's, at most 8192)")
    parser.add_argument("--max-num-seqs", type=int, default=8, help="sequences in one step (contiguous: slots)")
    parser.add_argument("--kv-cache-tokens", type=int, help="paged pool size in tokens (default: one context)")
    parser.add_argument("--context", type=int, help="tokens per planned sequence (default: the context length)")
    parser.add_argument("--check", action="store_true", help="also build the engine and show what it allocated")
    parser.add_argument("--json", action="store_true", help="print JSON")


def run_memory_plan(args) -> int:
    loaded = load_model(args.model, args.device, args.dtype)
    lane = LaneSettings.from_args(args)
    config = lane.engine_config(args.max_seq_len, max_num_seqs=args.max_num_seqs,
                                kv_cache_tokens=args.kv_cache_tokens)
    quant = lane.quant(args.quant_lm_head)
    plan = plan_memory(loaded, config, quant, args.context)
    report = {"model": loaded.name, "device": str(loaded.device), "dtype": str(loaded.dtype).removeprefix("torch."),
              "settings": lane.describe(), "quant": quant.name, "plan": plan.as_dict()}
    if args.check:
        report["engine"] = engine_figures(Engine(quantize(loaded, quant), config))
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    mib = 2**20
    print(f"{report['model']} on {report['device']} in {report['dtype']}: {report['settings']}")
    rows = [("weights", plan.weights_bytes / mib, "MiB"), ("KV per token", plan.kv_bytes_per_token / 1024, "KiB"),
            (f"KV per sequence of {plan.context_len} tokens", plan.kv_bytes_per_sequence / mib, "MiB"),
            ("KV pool these settings allocate", plan.kv_pool_bytes / mib, "MiB"),
            *([("int4 KV: newest blocks in the model dtype", plan.kv_tail_bytes / mib, "MiB")]
              if plan.kv_tail_bytes else []),
            ("activations of one step (estimate)", plan.activation_bytes / mib, "MiB")]
    if plan.free_bytes is not None:
        rows.append(("free memory", plan.free_bytes / mib, "MiB"))
    for what, value, unit in rows:
        print(f"  {what:<40} {value:12.2f} {unit}")
    if plan.sequences_that_fit is not None:
        print(f"  sequences of {plan.context_len} tokens that fit: {plan.sequences_that_fit}")
    if args.check:
        engine = report["engine"]
        print(f"  the engine allocated: weights {engine['weights_bytes'] / mib:.2f} MiB, KV "
              f"{engine['kv_pool_bytes'] / mib:.2f} MiB, {engine['kv_bytes_per_token'] / 1024:.2f} KiB per token")
    return 0
