"""Our int4 kernel for a few rows on CUDA (`quant.triton_int4`) against tinygemm's convention, w = (q - 8) * scale +
zero: rows 1 to 4, groups of 32 to 256, output features that are not a whole number of the kernel's blocks, input
features in 1 to 4 splits; the dequantized matmul that takes more rows; how the splits are chosen; and the kernel
compiled for an H100 with no GPU. On CUDA the kernel runs compiled; on the CPU under Triton's interpreter, where
Triton is installed (torch's CUDA builds bring it, the suite's CPU torch does not)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read by Triton's import and when the kernel is defined

from inference_core.quant import kernels, triton_int4  # noqa: E402

pytestmark = pytest.mark.cuda  # in the GPU run's tests (`pytest -m cuda`)
needs_triton = pytest.mark.skipif(triton_int4._kernel() is None, reason="Triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(rows: int, out_features: int, in_features: int, group: int, seed: int):
    """x, the packed nibbles, scales and zeros, and x times the fp32 weight they stand for."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (out_features, in_features), dtype=torch.int32, generator=generator)
    scale = torch.rand(out_features, in_features // group, generator=generator) * 0.1 + 0.01
    zero = torch.randn(out_features, in_features // group, generator=generator) * 0.1
    scales = kernels.scales_and_zeros(scale, zero, torch.bfloat16)
    weight = (q.float() - 8) * scales[..., 0].float().t().repeat_interleave(group, 1) \
        + scales[..., 1].float().t().repeat_interleave(group, 1)
    x = torch.randn(rows, in_features, generator=generator).to(torch.bfloat16)
    expected = x.float() @ weight.t()
    return x.to(DEVICE), kernels.pack_nibbles(q).to(DEVICE), scales.to(DEVICE), expected.to(DEVICE)


def _relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected).norm() / expected.norm()).item()


@needs_triton
@pytest.mark.parametrize("rows,out_features,in_features,group,splits", [
    (1, 96, 512, 32, 1), (1, 130, 1024, 64, 4), (3, 96, 512, 128, 2), (4, 64, 256, 256, 1), (2, 200, 768, 32, None)])
def test_kernel_equals_the_weight_it_stands_for(rows, out_features, in_features, group, splits):
    x, packed, scales, expected = _case(rows, out_features, in_features, group, seed=rows * 7 + group)
    out = triton_int4.int4_rows(x, packed, scales, group, splits)
    assert out.shape == (rows, out_features) and out.dtype == torch.bfloat16
    assert _relative(out, expected) < 5e-3  # bf16 rounding of the output
    if splits is None:  # through the op the compiled step calls
        torch.testing.assert_close(torch.ops.inference_core.int4_rows(x, packed, scales, group), out)


def test_more_rows_take_the_dequantized_weight():
    """Past `MAX_ROWS` rows (on CUDA, `kernels.int4_mm`) the product is x times the weight dequantized to bf16 (no
    Triton needed)."""
    x, packed, scales, expected = _case(6, 96, 512, 32, seed=3)
    out = kernels.int4_mm(x, packed, 32, scales) if DEVICE == "cuda" else triton_int4.dequantized_mm(x, packed,
                                                                                                     scales, 32)
    assert out.shape == (6, 96) and _relative(out, expected) < 5e-3


def test_splits_fill_the_device_in_whole_steps():
    """At least about 4 programs a multiprocessor (an H100 has 132), at most 16 splits, each a whole number of steps
    of 256 input features: a [4096, 4096] weight is 64 blocks of 64 features, so 16 splits of one step each; a
    [28672, 4096] one, 448 blocks, 2 splits."""
    assert triton_int4.split_for(132, 4096, 4096) == 16
    assert triton_int4.split_for(132, 28672, 4096) == 2
    assert triton_int4.split_for(132, 4096, 14336) == 8
    assert triton_int4.split_for(132, 1024, 768) == 1  # 768 = 3 steps: no power of two above 1 divides it
    assert triton_int4.takes(4096, 32) and triton_int4.takes(4096, 256)
    assert not triton_int4.takes(2112, 32) and not triton_int4.takes(4096, 512)


# Run in a process of its own: this module sets TRITON_INTERPRET (see tests/engine/test_triton_attention.py).
COMPILE_FOR_H100 = """
import inspect
from triton import compile
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from inference_core.quant._triton_int4_kernel import int4_rows
from inference_core.quant.triton_int4 import BLOCK_K, BLOCK_N

sizes = []
for block_m, splits in ((1, 1), (4, 8)):
    constants = {"GROUP": 32, "BLOCK_M": block_m, "BLOCK_N": BLOCK_N, "BLOCK_K": BLOCK_K, "SPLIT_K": splits}
    signature = {"x_ptr": "*bf16", "q_ptr": "*u8", "sz_ptr": "*bf16", "out_ptr": "*bf16" if splits == 1 else "*fp32",
                 **dict.fromkeys(("M", "N", "K", "x_row", "q_row", "sz_group", "out_row"), "i32"),
                 **dict.fromkeys(constants, "constexpr")}
    assert list(signature) == list(inspect.signature(int4_rows.fn).parameters), "the kernel's arguments changed"
    source = ASTSource(fn=int4_rows, signature=signature,
                       constexprs={(list(signature).index(name),): value for name, value in constants.items()})
    num_warps = 4 if block_m <= 2 else 8
    sizes.append(len(compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}).asm["cubin"]))
print(min(sizes))
"""


@needs_triton
def test_kernel_compiles_for_an_h100():
    """Compiled for sm_90 down to its binary, with no GPU, for one row in one split and four rows in eight."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE_FOR_H100], env=env, cwd=Path(__file__).resolve().parents[2],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) > 0
