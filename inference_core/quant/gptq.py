"""GPTQ: int4 weights per group whose rounding errors are compensated, column by column, through the inverse Hessian
of the layer's inputs (Frantar, Ashkboos, Hoefler and Alistarh, "GPTQ: Accurate Post-Training Quantization for
Generative Pre-trained Transformers", 2022).

For a projection y = x W^T, a weight error E costs trace(E H E^T) in output error over the calibration inputs x,
with H = x^T x / tokens (the matrix AWQ's search scores with). Rounding one column j of W leaves an error e_j in it;
the change of the columns not yet rounded that minimizes the output error given that error (Optimal Brain Surgeon's
update) is -e_j [H^-1]_{j,k} / [H^-1]_{j,j} for each later column k, and GPTQ then goes on with the next column of the
updated weight. With U the upper Cholesky factor of H^-1 (H^-1 = U^T U), row j of U holds those coefficients for the
columns after j once the columns before it are fixed, so one factorization serves every column. Columns go in lazy
blocks of BLOCK: inside a block the updates touch the block only, and the block's errors reach the later columns in
one matmul.

- Dampening: H + DAMP * mean(diag H) * I, so a near-singular H (an input channel the calibration text barely uses)
  still factors; where the factorization fails anyway the dampening grows tenfold, up to three times.
- The grid is the kernels' own (`linear.Int4Weight`: asymmetric per group, w = (q - 8) * scale + zero) with scale
  and zero rounded to the compute dtype before any column is rounded, so the error carried forward is the error the
  kernel will compute with.
- Without activation order, a group's scale and zero come from its columns as they stand when GPTQ reaches its first
  column (the errors of the columns before it folded in). With static activation order (`act_order`) the columns
  are visited in order of decreasing diag(H), the input channels with the most energy first, while the most columns
  remain to absorb their errors; each group's scale and zero are then fixed beforehand from the original weights, so
  the file keeps the original column order and nothing is reordered at run time.

The statistics are AWQ's (`awq.walk_inputs`: the float model over the calibration text, layer by layer, every
projection's inputs as the float model computes them). With `awq_scales`, GPTQ runs on AWQ's folded weights (columns
times s, inputs over s: H becomes H / (s s^T)), the two methods composed. `gptq_file` saves and loads the result.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from inference_core.config import ConfigError
from inference_core.quant import awq
from inference_core.quant.linear import Int4Weight, compute_dtype, round_int4

DAMP = 0.01  # the dampening, a share of H's mean diagonal
BLOCK = 128  # columns per lazy block; a multiple of every group size (32, 64, 128)


@dataclass
class ProjectionResult:
    """GPTQ's int4 weight of one projection and its output errors (relative to the output's mean square)."""

    weight: Int4Weight
    rtn_error: float
    gptq_error: float


@dataclass
class Calibration:
    group_size: int
    act_order: bool
    results: dict[str, ProjectionResult] = field(default_factory=dict)  # by module name
    num_tokens: int = 0


def _grid(weight: torch.Tensor, group_size: int, compute: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's scale and zero [out, groups] of an fp32 [out, in] weight (round to nearest's min and max), as the
    kernel keeps them (rounded to `compute`)."""
    rounded = round_int4(weight, group_size)
    return rounded.scale.to(compute).float(), rounded.zero.to(compute).float()


def _round(column: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A column's int4 values (0..15) on its groups' grid, and the weights they stand for."""
    q = torch.round((column - zero) / scale + 8).clamp(0, 15)
    return q, (q - 8) * scale + zero


def _inverse_factor(hessian: torch.Tensor, damp: float) -> torch.Tensor:
    """The upper Cholesky factor of (H + dampening)^-1, in fp64, the dampening grown where H will not factor."""
    diagonal = hessian.diagonal()
    for attempt in range(4):
        damped = hessian + (damp * 10 ** attempt) * diagonal.mean() * torch.eye(len(hessian), dtype=hessian.dtype,
                                                                                  device=hessian.device)
        factor, info = torch.linalg.cholesky_ex(damped)
        if info.item() == 0:
            return torch.linalg.cholesky(torch.cholesky_inverse(factor), upper=True)
    raise ConfigError("GPTQ: the inputs' Hessian does not factor even with 1000x the dampening; calibrate on more "
                      "text.")


def gptq_weight(weight: torch.Tensor, gram: torch.Tensor, group_size: int, compute: torch.dtype = torch.float32,
                act_order: bool = True, damp: float = DAMP, block: int = BLOCK) -> Int4Weight:
    """GPTQ's int4 form of an fp32 [out, in] weight, given gram [in, in] = x^T x / tokens of its inputs."""
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise ConfigError(f"int4 groups of {group_size} do not divide {in_features} input features; pick another "
                          "--quant-group.")
    if block % group_size:
        raise ValueError(f"GPTQ's block of {block} columns must hold whole groups of {group_size}")
    hessian = gram.double().clone()
    dead = hessian.diagonal() == 0  # an input no calibration token used: its column is only rounded
    hessian[dead, dead] = 1.0
    order = torch.argsort(hessian.diagonal(), descending=True) if act_order else torch.arange(in_features)
    order = order.to(weight.device)
    groups = in_features // group_size
    if act_order:  # static groups: every grid fixed from the original weights
        scale, zero = _grid(weight, group_size, compute)
    else:
        scale = torch.empty(out_features, groups, device=weight.device)
        zero = torch.empty_like(scale)
    work = weight[:, order].clone()
    factor = _inverse_factor(hessian[order][:, order], damp).float()
    q = torch.empty(out_features, in_features, device=weight.device)
    for start in range(0, in_features, block):
        end = min(start + block, in_features)
        columns, errors = work[:, start:end].clone(), torch.zeros(out_features, end - start, device=weight.device)
        inner = factor[start:end, start:end]
        for i in range(end - start):
            column = order[start + i].item()
            group = column // group_size
            if not act_order and column % group_size == 0:  # the group's grid from its columns as they stand now
                scale[:, group:group + 1], zero[:, group:group + 1] = _grid(columns[:, i:i + group_size], group_size,
                                                                            compute)
            q[:, start + i], rounded = _round(columns[:, i], scale[:, group], zero[:, group])
            error = (columns[:, i] - rounded) / inner[i, i]
            columns[:, i:] -= error[:, None] * inner[i, i:][None, :]
            errors[:, i] = error
        work[:, end:] -= errors @ factor[start:end, end:]
    unordered = torch.empty_like(q)
    unordered[:, order] = q
    return Int4Weight(unordered.to(torch.int32), scale, zero)


def gptq_projection(weight: torch.Tensor, stats: awq.InputStats, group_size: int, compute: torch.dtype,
                    act_order: bool = True, scale: torch.Tensor | None = None) -> ProjectionResult:
    """GPTQ on one projection's fp32 [out, in] weight, with its output errors against round to nearest's on the same
    weight. With AWQ's column `scale`, `weight` is the folded layer's (`awq.fold_scales`), whose inputs are the
    recorded ones divided by the scale."""
    gram = (stats.gram / stats.count).float()
    if scale is not None:  # the folded layer reads x / s: its inputs' Gram matrix is G / (s s^T)
        gram = gram / (scale[:, None] * scale[None, :])
    rtn = round_int4(weight, group_size)
    quantized = gptq_weight(weight, gram, group_size, compute, act_order)
    return ProjectionResult(quantized, awq.output_error(weight, rtn.dequantized(compute), gram),
                            awq.output_error(weight, quantized.dequantized(compute), gram))


def calibrate(loaded, group_size: int, sequences: list[list[int]], act_order: bool = True,
              awq_scales: dict[str, torch.Tensor] | None = None, on_projection=None) -> Calibration:
    """GPTQ's int4 weight of every projection (the LM head included) of `loaded`'s float model."""
    awq.check_group_size(loaded, group_size)
    compute = compute_dtype(loaded.device.type, loaded.dtype, "gptq")
    calibration = Calibration(group_size, act_order, num_tokens=sum(len(ids) for ids in sequences))
    # AWQ's scales fold into the weights (columns times s, and the v and up rows over the next projection's s): GPTQ
    # rounds the folded weights, on the statistics of the float model's own inputs.
    folded = awq.fold_scales(loaded, awq_scales) if awq_scales is not None else loaded
    for name, _, stats in awq.walk_inputs(loaded, sequences):
        scale = awq_scales[name] if awq_scales is not None else None
        result = gptq_projection(awq.out_in(folded.model.get_submodule(name)), stats, group_size, compute, act_order,
                                 scale)
        calibration.results[name] = result
        if on_projection is not None:
            on_projection(name, result)
    return calibration
