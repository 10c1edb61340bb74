"""The ATen weight-only kernels a `QuantLinear` calls on each device, and the packed layouts they read (the layer
owns its weights; this module owns the calls, the packing and the shape rules). What each CUDA call expects was read
in torch's source (aten/src/ATen/native/cuda/int4mm.cu and int8mm.cu, torch/_meta_registrations.py).

int4 per group, on both devices tinygemm's convention: w = (q - 8) * scale + zero, q the unsigned nibble 0..15, one
scale and zero per group of input features, kept as `scales_and_zeros` [in / group, out, 2] (scale, zero).

- CPU: `_convert_weight_to_int4pack_for_cpu(q int32 [out, in], 1)` and `_weight_int4pack_mm_for_cpu(x, packed,
  group, scales_and_zeros)`, activations in bf16 or the model dtype (`linear.compute_dtype`).
- CUDA (compute capability 8.0+): `_convert_weight_to_int4pack(uint8 [out, in / 2], inner_k_tiles)` gives int32
  [out / 8, in / (inner_k_tiles * 16), 32, inner_k_tiles / 2]; `_weight_int4pack_mm(x, packed, group,
  scales_and_zeros)` takes x bf16 [rows, in], contiguous, and returns bf16 [rows, out]. Each input byte holds input
  column 2i in its high nibble and 2i + 1 in its low one (what the packing kernel, matrix_to_m16n8k16_Bint4_layout,
  and the matmul's unpacking agree on; tests/quant/test_kernels.py emulates both). The matmul kernel turns a nibble
  into (nibble - 8) in bf16 and applies one bf16 fma with its group's scale and zero: the convention above, with the
  weight rounded once to bf16. It checks: inner_k_tiles 2, 4 or 8, `in` a multiple of inner_k_tiles * 16, group
  32/64/128/256, scales_and_zeros [in / group, out, 2]; it reads scales_and_zeros as bf16 without checking the dtype
  (so we always store bf16) and writes `out` in tiles of 8 columns (so `out` must be a multiple of 8:
  `check_int4_cuda_shape`).

int8 per output channel (q int8 [out, in], scales [out]):

- CPU: `_weight_int8pack_mm(x, q, scales)`.
- CUDA: torch has had a CUDA kernel for `_weight_int8pack_mm` since 2.9 (int8mm.cu), but a plain one (the version
  read computes one output element per thread in fp32, the activations cast to fp32 on every call). The other form
  is gpt-fast's `F.linear(x, q.to(x.dtype)) * scales`: in eager the weight is cast on every call; compiled, inductor
  fuses the cast into the matmul when it turns a one-row mm into a multiply and a sum, which it does with
  `torch._inductor.config.coordinate_descent_tuning` on (gpt-fast's setting), whereas the ATen op stays an opaque
  call. So the path is timed once per device and dtype on a 4096 x 4096 decode row and the faster kept
  (`int8_path`); where torch has no CUDA kernel for the op, the F.linear form. Measured on an H100 (torch 2.11,
  eager, one bf16 row, medians of 50): [4096, 4096] bf16 F.linear 26.7 us, int8 ATen 150.0 us, int8 F.linear form
  79.4 us, int4 g128 28.8 us; [14336, 4096] 55.9, 302.4, 224.4 and 33.1 us. In eager, int8 on CUDA is slower than
  bf16 (the F.linear form was picked); int4 is up to 1.7x faster.
"""

from __future__ import annotations

import functools
import time

import torch
import torch.nn.functional as F

from inference_core import gpu
from inference_core.config import ConfigError
from inference_core.quant import triton_int4

INNER_K_TILES = (8, 4, 2)  # tinygemm's choices, widest (16-byte loads) first
K_TILE = 16  # tinygemm's m16n8k16 tile: input features per k-tile
N_TILE = 8  # output features per n-tile
INT8_PATHS = ("aten", "dequant")  # `_weight_int8pack_mm`, or F.linear on the weight cast to the activations' dtype
DEVICES = ("cpu", "cuda")  # device types with weight-only kernels here


def check_device(device: torch.device) -> None:
    """A ConfigError for a device with no weight-only kernels of ours."""
    if device.type not in DEVICES:
        raise ConfigError(f"weight quantization runs on the CPU and on CUDA, not on {device.type}; load the model "
                          f"with --device cpu or --device cuda, or use --quant none.")


# int4 ----------------------------------------------------------------------------------------------------------


def inner_k_tiles(in_features: int) -> int | None:
    """The widest inner k-tile count whose 16-feature tiles divide `in_features`; None if none does."""
    return next((tiles for tiles in INNER_K_TILES if in_features % (tiles * K_TILE) == 0), None)


def check_int4_cuda_shape(name: str, out_features: int, in_features: int) -> None:
    """A ConfigError naming the layer and what to change, where tinygemm cannot take an [out, in] weight."""
    problems = []
    if out_features % N_TILE:
        problems.append(f"its {out_features} output features are not a multiple of {N_TILE}")
    if inner_k_tiles(in_features) is None:
        problems.append(f"its {in_features} input features are not a multiple of {INNER_K_TILES[-1] * K_TILE}")
    if problems:
        advice = ("keep the LM head in the model dtype (--no-quant-lm-head)" if name == "lm_head"
                  else "use --quant int8 for this model")
        raise ConfigError(f"{name or 'a projection'} [{out_features}, {in_features}] does not fit the CUDA int4 "
                          f"kernel (tinygemm): {' and '.join(problems)}; {advice}.")


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """q [out, in] in 0..15 -> uint8 [out, in / 2]: column 2i in the high nibble, 2i + 1 in the low one (the input
    `_convert_weight_to_int4pack` reads on CUDA)."""
    even, odd = q.to(torch.uint8).unflatten(1, (-1, 2)).unbind(-1)  # ops rather than indexing: fake tensors run them
    return ((even << 4) | odd).contiguous()


def scales_and_zeros(scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """scale and zero [out, in / group] -> [in / group, out, 2] in `dtype`, contiguous (both kernels' layout)."""
    return torch.stack([scale.t(), zero.t()], -1).to(dtype).contiguous()


def pack_int4(q: torch.Tensor, path: str = "tinygemm") -> torch.Tensor:
    """q int32 [out, in] in 0..15, on its device -> the packed weight that device's int4 kernel reads (on CUDA, by
    `path`: tinygemm's int32 tiles, or the nibbles [out, in / 2] our Triton kernel reads)."""
    if q.device.type == "cuda":
        if path == "triton":
            return pack_nibbles(q)
        return torch.ops.aten._convert_weight_to_int4pack(pack_nibbles(q), inner_k_tiles(q.shape[1]))
    return torch._convert_weight_to_int4pack_for_cpu(q, 1)


def unpack_int4_cpu(packed: torch.Tensor) -> torch.Tensor:
    """The CPU's tinygemm layout back to q [out, in] uint8 in 0..15, for an AVX-512 build's pack of a weight whose
    output features are a multiple of 64 (`row_kernel.takes_int4` checks both): per 64 output features and input
    feature k, 32 bytes, byte d holding output d in its low nibble and output 32 + d in its high one."""
    out_features, in_features = packed.shape[0], packed.shape[1] * 2
    blocks = packed.view(out_features // 64, in_features, 32)
    halves = torch.stack([blocks & 15, blocks >> 4], 1)  # [out / 64, 2, in, 32]
    return halves.transpose(2, 3).reshape(out_features, in_features)


def int4_mm(x: torch.Tensor, packed: torch.Tensor, group_size: int, scales: torch.Tensor) -> torch.Tensor:
    """x [rows, in] -> [rows, out] through the int4 kernel of the packed weight's layout (on CUDA x must be bf16):
    on CUDA, nibbles (uint8) through our Triton kernel for a few rows and dequantized for more, or tinygemm's int32
    tiles; on the CPU, the CPU's tinygemm layout."""
    if x.device.type == "cuda" and packed.dtype == torch.uint8:
        if x.shape[0] <= triton_int4.MAX_ROWS:
            return torch.ops.inference_core.int4_rows(x, packed, scales, group_size)
        return triton_int4.dequantized_mm(x, packed, scales, group_size)
    if x.device.type == "cuda":
        return torch.ops.aten._weight_int4pack_mm(x.contiguous(), packed, group_size, scales)
    return torch._weight_int4pack_mm_for_cpu(x, packed, group_size, scales)


@torch.library.custom_op("inference_core::int4_rows", mutates_args=())
def _int4_rows(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """`triton_int4.int4_rows` as one op the compiler does not look into (it launches a Triton kernel)."""
    return triton_int4.int4_rows(x, packed, scales, group_size)


@_int4_rows.register_fake
def _int4_rows_shape(x, packed, scales, group_size):
    return x.new_empty(x.shape[0], packed.shape[0])


def int4_path(device: torch.device, in_features: int, group_size: int) -> str:
    """'tinygemm' or 'triton' (`triton_int4`) for an int4 weight on CUDA: the Triton kernel where it is enabled, takes
    the layout and measured faster on this device (once, `_measured_int4_path`)."""
    if device.type != "cuda" or not triton_int4.enabled() or not triton_int4.takes(in_features, group_size):
        return "tinygemm"
    return _measured_int4_path(torch.device("cuda", device.index or 0), group_size)


@functools.cache
def _measured_int4_path(device: torch.device, group_size: int) -> str:
    # A decode row against a 4096 x 4096 weight (Llama-3-8B's attention projections), each kernel in a CUDA graph (as
    # the compiled step calls it: the launches are not timed).
    q, scales = random_int4(device, 4096, 4096, group_size, seed=0)
    x = torch.randn(1, 4096, device=device).to(torch.bfloat16)

    def seconds(path: str) -> float:
        packed = pack_int4(q, path)
        return gpu.graph_seconds(lambda: int4_mm(x, packed, group_size, scales))

    return "triton" if seconds("triton") < seconds("tinygemm") else "tinygemm"


def random_int4(device: torch.device, out_features: int, in_features: int, group_size: int,
                seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random int4 weight to time kernels on: q int32 [out, in] in 0..15 and its scales and zeros (bf16, small
    scales, zero zeros), seeded."""
    generator = torch.Generator(device=device).manual_seed(seed)
    q = torch.randint(0, 16, (out_features, in_features), dtype=torch.int32, device=device, generator=generator)
    groups = in_features // group_size
    scales = scales_and_zeros(torch.rand(out_features, groups, device=device, generator=generator) / 50,
                              torch.zeros(out_features, groups, device=device), torch.bfloat16)
    return q, scales


# int8 ----------------------------------------------------------------------------------------------------------


def int8_mm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, path: str) -> torch.Tensor:
    """x [rows, in] -> [rows, out] with the int8 weight [out, in] and its scales [out], by `path` (INT8_PATHS)."""
    if path == "dequant":
        return F.linear(x, qweight.to(x.dtype)) * scales
    return torch._weight_int8pack_mm(x.contiguous(), qweight, scales)


def int8_by_int8_mm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [rows, in] -> [rows, out] in x's dtype: x rounded to int8 per row (symmetric, its largest magnitude to 127),
    multiplied by the int8 weight [out, in] in integers (`torch._int_mm`: oneDNN's int8 matmul, VNNI's dot products
    where the CPU has them), then by both scales. On the 2-vCPU Zen 4 host a 512-token prompt's projections ran at
    406-430 G multiply-adds a second this way, against 200-215 for oneDNN's bf16 matmul."""
    xf = x.float()
    x_scale = xf.abs().amax(1, keepdim=True).clamp(min=1e-8) / 127
    xq = torch.round(xf / x_scale).to(torch.int8)
    return (torch._int_mm(xq, qweight.t()).float() * x_scale * scales.float()).to(x.dtype)


def has_cuda_int8_kernel() -> bool:
    """Whether this torch registers a CUDA kernel for `_weight_int8pack_mm`."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("aten::_weight_int8pack_mm", "CUDA")


def int8_path(device: torch.device, dtype: torch.dtype) -> str:
    """'aten' on the CPU; on CUDA the faster form, measured once (see the module docstring)."""
    if device.type != "cuda":
        return "aten"
    if not has_cuda_int8_kernel():
        return "dequant"
    return _measured_int8_path(torch.device("cuda", device.index or 0), dtype)


@functools.cache
def _measured_int8_path(device: torch.device, dtype: torch.dtype) -> str:
    # A decode row against a 4096 x 4096 weight (Llama-3-8B's attention projections): warmed up, the device
    # synchronized before each clock read, the median of 5 runs of 10 calls.
    weight = torch.ones(4096, 4096, dtype=torch.int8, device=device)
    x, scales = torch.ones(1, 4096, dtype=dtype, device=device), torch.ones(4096, dtype=dtype, device=device)

    def seconds(path: str) -> float:
        runs = []
        for _ in range(6):
            torch.cuda.synchronize(device)
            started = time.perf_counter()
            for _ in range(10):
                int8_mm(x, weight, scales, path)
            torch.cuda.synchronize(device)
            runs.append(time.perf_counter() - started)
        return sorted(runs[1:])[2]  # the first run is the warm-up

    return "aten" if seconds("aten") <= seconds("dequant") else "dequant"
