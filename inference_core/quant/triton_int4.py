"""int4 weight-only projections of a few rows (decode) on CUDA through a Triton kernel of ours.

tinygemm (`_weight_int4pack_mm`, `kernels.int4_mm`) reads small matrices slowly at one row: on an H100 a [4096, 4096]
int4 projection took 28.8 us (8.4 MB, 0.3 TB/s) and a [14336, 4096] one 33.1 us (0.9 TB/s), where the copy
bandwidth is 2.9 TB/s; at Llama-3-8B's shape the compiled int4 step read its weights at 34% of the bandwidth, the
bf16 step at 94% (docs/benchmarks.md, "The fourth H100 run"). This kernel reads the weight as stored, two nibbles a
byte [out, in / 2] (`kernels.pack_nibbles`), with tinygemm's scales and zeros [in / group, out, 2]: a program per
block of `BLOCK_N` output features and per split of the input features, enough programs for `PROGRAMS_PER_SM` a
multiprocessor (`split_for`), each turning a nibble q into (q - 8) * scale + zero in fp32 and summing its products
with up to `MAX_ROWS` rows of x in fp32; splits add their sums into an fp32 output atomically. The weight is rounded
once to fp32 here, to bf16 in tinygemm: the two differ by bf16 rounding of the weight.

More rows than `MAX_ROWS` (a batch) take the weight dequantized to bf16 and a cuBLAS matmul (`dequantized_mm`). On
the CPU the kernel runs under Triton's interpreter (`TRITON_INTERPRET=1`), which is how the tests check it. Whether a
layer stores this layout or tinygemm's is measured once per device (`kernels.int4_path`).
"""

from __future__ import annotations

import functools
import os

import torch

from inference_core import gpu

MAX_ROWS = 4  # rows of x the kernel takes; more run `dequantized_mm`
BLOCK_N = 64  # output features a program computes
BLOCK_K = 256  # input features a program reads per step of its loop (a multiple of the group size)
PROGRAMS_PER_SM, MAX_SPLITS = 4, 16


def enabled() -> bool:
    """Whether the kernel may run at all: asked for (`INFERENCE_CORE_TRITON_INT4=0` keeps tinygemm) and Triton
    importable."""
    return os.environ.get("INFERENCE_CORE_TRITON_INT4", "1") != "0" and _kernel() is not None


def takes(in_features: int, group_size: int) -> bool:
    """Whether the kernel's layout fits a weight of `in_features` in groups of `group_size`."""
    return BLOCK_K % group_size == 0 and group_size % 2 == 0 and in_features % BLOCK_K == 0


def split_for(multiprocessors: int, out_features: int, in_features: int) -> int:
    """Splits of the input features: a power of two giving about `PROGRAMS_PER_SM` programs a multiprocessor, each
    split a whole number of `BLOCK_K` steps."""
    blocks = -(-out_features // BLOCK_N)
    splits = 1
    while (splits * 2 <= MAX_SPLITS and blocks * splits < PROGRAMS_PER_SM * multiprocessors
           and in_features % (splits * 2 * BLOCK_K) == 0):
        splits *= 2
    return splits


def int4_rows(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, group_size: int,
              splits: int | None = None) -> torch.Tensor:
    """x [rows <= MAX_ROWS, in] (bf16) times the int4 weight q [out, in / 2] (nibbles) with `scales` [in / group,
    out, 2] (scale, zero): [rows, out] in x's dtype."""
    rows, in_features = x.shape
    out_features = q.shape[0]
    if rows > MAX_ROWS or not takes(in_features, group_size):
        raise ValueError(f"int4_rows takes up to {MAX_ROWS} rows and input features in whole steps of {BLOCK_K}")
    x = x.contiguous()
    splits = split_for(gpu.multiprocessors(x.device), out_features, in_features) if splits is None else splits
    if splits == 1:
        out = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    else:
        out = torch.zeros(rows, out_features, dtype=torch.float32, device=x.device)
    block_m = 1 << (rows - 1).bit_length()
    _kernel()[(-(-out_features // BLOCK_N), splits)](
        x, q, scales, out, rows, out_features, in_features, x.stride(0), q.stride(0), scales.stride(0),
        out.stride(0), GROUP=group_size, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, SPLIT_K=splits,
        num_warps=4 if block_m <= 2 else 8)
    return out.to(x.dtype)


def dequantized_mm(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """The same product for any number of rows: the weight dequantized to x's dtype, then a matmul."""
    out_features = q.shape[0]
    nibbles = torch.stack([q >> 4, q & 15], -1).view(out_features, -1).to(torch.float32) - 8  # [out, in]
    scale, zero = scales.float().permute(2, 1, 0).repeat_interleave(group_size, -1)  # each [out, in]
    return torch.nn.functional.linear(x, (nibbles * scale + zero).to(x.dtype))


@functools.cache
def _kernel():
    """The kernel, imported on first use (None where Triton is missing or does not load)."""
    try:
        from inference_core.quant._triton_int4_kernel import int4_rows as kernel
    except Exception:
        return None
    return kernel
