"""The compiled decode step's kernels alone on a GPU. `gpu-report --parts attention`: the Triton kernel
(`engine.triton_attention`) with one program a (sequence, KV head) and with its keys in splits (`splits_for`),
against the ATen ops it replaced (`compiled._read_context` and `compiled._attend_one`), at the decode shapes' heads
(Llama-3-8B: 32 query heads over 8 KV heads; Qwen3-0.6B: 16 over 8; head size 128), bf16, a paged pool of 16-token
blocks, batches of 1 to 64 and contexts of 144 to 4,096 keys. Each time is the median of 5 replays of a CUDA graph
of 20 calls (so the host's launches are not what is timed), per call, in microseconds; the bytes a call must read
(the keys and values of the context) over that time give its bandwidth.

`gpu-report --parts int4`: one decode row through Llama-3-8B's four projection shapes in int4 (groups of 32, as
`QuantConfig` has them), through tinygemm and through our Triton kernel (`quant.triton_int4`), against bf16's
F.linear, timed the same way; the bytes each reads (the weight as stored, scales and zeros included) over its time
give its bandwidth."""

from __future__ import annotations

import time

import torch

from inference_core import gpu
from inference_core.engine import triton_attention
from inference_core.engine.compiled import _attend_one, _read_context
from inference_core.quant import kernels, triton_int4

HEADS = {"llama-3-8b": 32, "qwen3-0.6b": 16}  # query heads over 8 KV heads of 128
KV_HEADS, HEAD_DIM, BLOCK = 8, 128, 16
CASES = [(shape, batch, keys) for shape in HEADS for batch, keys in ((1, 144), (1, 1024), (1, 4096), (8, 1024),
                                                                     (64, 1024))]
CALLS, REPLAYS = 20, 5
INT4_SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # Llama-3-8B: qkv, o, gate and up, down
INT4_GROUP = 32


def unavailable(device: torch.device) -> str | None:
    """Why the kernel cannot be timed here (None: it can)."""
    if device.type != "cuda":
        return "the kernel is timed on a GPU only (on the CPU it runs under Triton's interpreter)"
    if not triton_attention.enabled():
        return "the Triton kernel is off or Triton is not installed"
    return None


def time_attention(device: torch.device, deadline: float) -> dict:
    """Every case of `CASES` that starts before `deadline` (`time.perf_counter()`): {"rows": [...], "left_out"}."""
    reason = unavailable(device)
    if reason:
        return {"skipped": reason, "rows": []}
    rows, left_out = [], []
    for shape, batch, keys in CASES:
        if time.perf_counter() > deadline:
            left_out.append(f"{shape} batch {batch} keys {keys}: budget")
            continue
        inputs = _inputs(device, HEADS[shape], batch, keys)
        splits = triton_attention.splits_for(device, batch, KV_HEADS)
        row = {"shape": shape, "batch": batch, "keys": keys, "splits": splits,
               "one_program_us": _per_call_us(lambda: triton_attention.decode_attention(*inputs, paged=True,
                                                                                          splits=1)),
               "split_us": _per_call_us(lambda: triton_attention.decode_attention(*inputs, paged=True,
                                                                                   splits=splits)),
               "aten_us": _per_call_us(lambda: _aten(*inputs))}
        read = 2 * batch * keys * KV_HEADS * HEAD_DIM * 2  # the context's keys and values, bf16
        row["split_gb_s"] = round(read / row["split_us"] / 1e3, 1)
        rows.append(row)
    return {"rows": rows, "left_out": left_out}


def time_int4(device: torch.device, deadline: float) -> dict:
    """Every shape of `INT4_SHAPES` that starts before `deadline`: {"rows": [...], "left_out"}."""
    if device.type != "cuda":
        return {"skipped": "the kernels are timed on a GPU only", "rows": []}
    rows, left_out = [], []
    for out_features, in_features in INT4_SHAPES:
        if time.perf_counter() > deadline:
            left_out.append(f"[{out_features}, {in_features}]: budget")
            continue
        q, scales = kernels.random_int4(device, out_features, in_features, INT4_GROUP, seed=out_features + in_features)
        x = torch.randn(1, in_features, device=device).to(torch.bfloat16)
        weight = torch.randn(out_features, in_features, device=device).to(torch.bfloat16)
        tiles = kernels.pack_int4(q, "tinygemm")
        row = {"shape": [out_features, in_features],
               "bf16_us": _per_call_us(lambda: torch.nn.functional.linear(x, weight)),
               "tinygemm_us": _per_call_us(lambda: kernels.int4_mm(x, tiles, INT4_GROUP, scales))}
        if triton_int4.enabled() and triton_int4.takes(in_features, INT4_GROUP):
            nibbles = kernels.pack_int4(q, "triton")
            row["triton_us"] = _per_call_us(lambda: kernels.int4_mm(x, nibbles, INT4_GROUP, scales))
        read = out_features * in_features // 2 + scales.numel() * scales.element_size()
        for name in ("tinygemm", "triton"):
            if f"{name}_us" in row:
                row[f"{name}_gb_s"] = round(read / row[f"{name}_us"] / 1e3, 1)
        rows.append(row)
    return {"rows": rows, "left_out": left_out}


def format_int4(part: dict) -> list[str]:
    """The int4 part's Markdown lines."""
    if part.get("skipped"):
        return ["", f"int4 kernel timing: skipped ({part['skipped']})"]
    lines = ["", f"int4 projections alone, one row, groups of {INT4_GROUP} (us a call; CUDA graph replays):", "",
             "| shape | bf16 F.linear | tinygemm | GB/s | Triton (ours) | GB/s |", "|---|---|---|---|---|---|"]
    lines += [f"| {row['shape']} | {row['bf16_us']} | {row['tinygemm_us']} | {row['tinygemm_gb_s']} | "
              f"{row.get('triton_us', '-')} | {row.get('triton_gb_s', '-')} |" for row in part["rows"]]
    return lines + [f"- left out: {item}" for item in part.get("left_out", [])]


def _inputs(device: torch.device, heads: int, batch: int, keys: int) -> tuple:
    """One decode step's arguments: every sequence `keys` cached positions, in blocks scattered over the pool."""
    blocks = -(-keys // BLOCK)
    generator = torch.Generator(device=device).manual_seed(batch * 10_000 + keys)

    def rand(*shape):
        return torch.randn(*shape, device=device, dtype=torch.bfloat16, generator=generator)

    pool_blocks = batch * blocks + 1
    k_pool, v_pool = rand(pool_blocks, BLOCK, KV_HEADS, HEAD_DIM), rand(pool_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    table = (torch.randperm(pool_blocks - 1, device=device, generator=generator) + 1)[:batch * blocks]
    read_index = table.view(batch, blocks).to(torch.int32)
    key_mask = torch.ones(batch, blocks * BLOCK, dtype=torch.bool, device=device)
    lengths = torch.full((batch,), keys, dtype=torch.long, device=device)
    key_mask[:, keys:] = False
    return (rand(batch, heads, HEAD_DIM), rand(batch, KV_HEADS, HEAD_DIM), rand(batch, KV_HEADS, HEAD_DIM), k_pool,
            v_pool, read_index, key_mask, lengths, HEAD_DIM ** -0.5)


def _aten(q, k, v, k_pool, v_pool, read_index, key_mask, lengths, scale):
    k_ctx, v_ctx = _read_context(k_pool, v_pool, read_index, read_index.shape[1], True)
    return _attend_one(q, k, v, k_ctx, v_ctx, key_mask, scale)


def _per_call_us(call) -> float:
    """Microseconds a call, from CUDA graph replays (`gpu.graph_seconds`: `CALLS` calls, the median of `REPLAYS`)."""
    return round(gpu.graph_seconds(call, CALLS, REPLAYS) * 1e6, 2)


def format_attention(part: dict) -> list[str]:
    """The part's Markdown lines."""
    if part.get("skipped"):
        return ["", f"attention kernel timing: skipped ({part['skipped']})"]
    lines = ["", "attention alone (bf16, paged, us a call; CUDA graph replays):", "",
             "| shape | batch | keys | splits | one program | splits | ATen ops | splits' GB/s |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {row['shape']} | {row['batch']} | {row['keys']} | {row['splits']} | {row['one_program_us']} | "
              f"{row['split_us']} | {row['aten_us']} | {row['split_gb_s']} |" for row in part["rows"]]
    return lines + [f"- left out: {item}" for item in part.get("left_out", [])]
