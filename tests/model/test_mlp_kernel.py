"""Our op for the flat step's MLP activation (`inference_core.model.mlp_kernel`): silu(gate) * up against what
inductor compiles and what the eager forward computes, and that the flat step calls it for a bf16 model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inference_core.model import mlp_kernel


def reference(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in fp32, rounded once to bf16 (what inductor's fused kernel computes)."""
    half = x.shape[1] // 2
    return (F.silu(x[:, :half].float()) * x[:, half:].float()).bfloat16()


@pytest.mark.parametrize("rows, features", [(1, 1536), (7, 64), (3, 37), (2, 5), (33, 16)])
def test_it_equals_silu_times_up_rounded_once(our_ops, rows, features):
    """Whole vectors and a remainder (37, 5: fewer features than a vector), one row and several; values from deep
    in the negative tail (where e^-x overflows fp32) to far positive. Every output within one bf16 step of the
    reference, nearly all equal."""
    generator = torch.Generator().manual_seed(rows * features)
    x = (torch.randn(rows, 2 * features, generator=generator) * 6).bfloat16()
    x[0, 0], x[-1, features - 1] = -120.0, 95.0
    got, want = mlp_kernel.silu_mul(x), reference(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, features)
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-30)
    differ = got != want
    differ[0, 0] = False  # -120: e^-120 is below fp32's normal numbers, the op's 1e-37 where torch's is 0
    assert differ.float().mean() < 0.01


def test_it_reads_rows_with_a_stride_and_keeps_nan(our_ops):
    """A view whose rows lie apart (a wider tensor's first columns) reads as its copy; a NaN stays NaN."""
    wide = torch.randn(4, 200).bfloat16()
    wide[1, 3] = float("nan")
    view = wide[:, :128]
    got = mlp_kernel.silu_mul(view)
    assert torch.equal(got.nan_to_num(7.0), mlp_kernel.silu_mul(view.contiguous()).nan_to_num(7.0))
    assert got[1, 3].isnan()


def test_it_refuses_what_it_cannot_take(our_ops):
    assert not mlp_kernel.takes(torch.zeros(2, 8)) and not mlp_kernel.takes(torch.zeros(2, 7).bfloat16())
    with pytest.raises(RuntimeError, match="2-D bf16 tensor"):
        mlp_kernel.silu_mul(torch.zeros(2, 8))
