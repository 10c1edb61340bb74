"""Weight-only quantized projections: int8 per output channel, int4 per group of input features (`QuantLinear`, the
layer `inference_core.quant.quantize` swaps in for each `Linear`), and the settings that name a scheme (`QuantConfig`).

Kernels are ATen's weight-only ones, on the CPU and on CUDA (`inference_core.quant.kernels` owns the calls and the
packed layouts): `_weight_int8pack_mm` (int8 weights, a scale per output channel; on CUDA also gpt-fast's F.linear
form, whichever measures faster) and tinygemm's int4 kernels (`_weight_int4pack_mm_for_cpu`, `_weight_int4pack_mm`
on CUDA: int4 weights packed two per byte, a scale and a zero per group of `group_size` input features). Each
dequantizes inside the matmul, so only the small weights stream from memory. On the CPU both are fast only with bf16
activations: one decode row against a 1536x576 int8 weight took 30 us in bf16 and 494 us in fp32 (an fp32 `F.linear`
on the full weight: 69 us), so an fp32 model's activations are cast to bf16 around each quantized projection where
that measures faster on this host (`compute_dtype`, measured once), as it does on CPUs with AVX-512 BF16 or AMX. On
CUDA tinygemm takes bf16 activations only, so an fp16 or fp32 model casts around its int4 projections the same way.
In a compiled decode step on the CPU, int8 and int4 projections of a few rows run through our own loop where it
measured faster (`model.row_kernel`: `int8_form`, `int4_form`), on the same numbers.
`QuantLinear.dequantized()` gives back the float weight the kernel computes with, the reference the tests hold the
kernels to.

Round to nearest: int8 symmetric (scale = max|w| / 127), int4 asymmetric per group (scale = (max - min) / 15, w = (q -
8) * scale + zero; `round_int4`). Scheme `awq` is int4 after activation-aware scaling (`inference_core.quant.awq`:
calibrated once, saved, then loaded). Quality is measured by `python -m inference_core quality`."""

from __future__ import annotations

import copy
import functools
import time
from dataclasses import dataclass

import torch
from torch import nn

from inference_core.config import ConfigError
from inference_core.model import row_kernel, w4a8_kernel
from inference_core.model.llama import Linear
from inference_core.quant import kernels

SCHEMES = ("none", "int8", "int4", "awq", "gptq")
CALIBRATED = ("awq", "gptq")  # int4 schemes calibrated once on the shipped text, then loaded from their file
INT4_SCHEMES = ("int4", *CALIBRATED)
GROUP_SIZES = (32, 64, 128)
# What an int4 projection multiplies its weight by: the activations in the model dtype (or `compute_dtype`'s), or
# rounded to int8 per block of 32 input features and multiplied in integers (`model.w4a8_kernel`, CPU only).
ACTIVATIONS = ("model", "int8")


@dataclass(frozen=True)
class QuantConfig:
    scheme: str = "none"  # none, int8 (per output channel), int4 (per group), awq (int4 after AWQ scaling) or gptq
    group_size: int = 32  # int4 and awq: input features sharing a scale and zero
    lm_head: bool = True  # quantize the LM head too (about a fifth of a small model's weights)
    activations: str = "model"  # int4 schemes: "int8" rounds each projection's input to int8 (`ACTIVATIONS`)

    def __post_init__(self):
        if self.scheme not in SCHEMES:
            raise ConfigError(f"unknown quantization {self.scheme!r}; one of {', '.join(SCHEMES)}.")
        if self.group_size not in GROUP_SIZES:
            raise ConfigError(f"quantization group size must be one of {', '.join(map(str, GROUP_SIZES))}, "
                              f"not {self.group_size}.")
        if self.activations not in ACTIVATIONS:
            raise ConfigError(f"unknown activations {self.activations!r}; one of {', '.join(ACTIVATIONS)}.")
        if self.activations == "int8" and self.scheme == "none":
            raise ConfigError("int8 activations go with quantized weights (int4, awq, gptq or int8), not none.")

    @property
    def name(self) -> str:
        """e.g. 'int4 g32', 'awq int4 g32', 'int4 g32 x int8 activations', 'int8 (LM head in the model dtype)'."""
        if self.scheme == "none":
            return "none"
        words = {"int8": "int8", "int4": f"int4 g{self.group_size}", "awq": f"awq int4 g{self.group_size}",
                 "gptq": f"gptq int4 g{self.group_size}"}[self.scheme]
        words += " x int8 activations" if self.activations == "int8" else ""
        return words + ("" if self.lm_head else " (LM head in the model dtype)")


@dataclass
class Int4Weight:
    """An int4 weight before packing: q [out, in] int32 in 0..15; scale and zero [out, in / group_size] fp32; the
    weight it stands for is (q - 8) * scale + zero."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    @property
    def group_size(self) -> int:
        return self.q.shape[1] // self.scale.shape[1]

    def dequantized(self, compute: torch.dtype = torch.float32) -> torch.Tensor:
        """The [out, in] fp32 weight, with scale and zero rounded to `compute` as the kernel keeps them."""
        scale, zero = self.scale.to(compute).float(), self.zero.to(compute).float()
        groups = (self.q.view(*scale.shape, -1).float() - 8) * scale[..., None] + zero[..., None]
        return groups.view(self.q.shape)


def round_int4(weight: torch.Tensor, group_size: int, clip: torch.Tensor | None = None) -> Int4Weight:
    """Round-to-nearest int4 of an fp32 [out, in] weight, asymmetric per group of `group_size` input features.
    `clip` [out, in / group_size] (AWQ's): each group's range first cut to +-clip * its max |w|."""
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise ConfigError(f"int4 groups of {group_size} do not divide {in_features} input features; "
                          f"pick another --quant-group.")
    groups = weight.contiguous().view(out_features, -1, group_size)
    low, high = groups.amin(-1), groups.amax(-1)
    if clip is not None:
        bound = torch.maximum(-low, high) * clip
        low, high = torch.maximum(low, -bound), torch.minimum(high, bound)
    scale = ((high - low) / 15).clamp(min=1e-8)
    q = torch.round((groups - low.unsqueeze(-1)) / scale.unsqueeze(-1)).clamp(0, 15).to(torch.int32)
    zero = low + 8 * scale  # dequantized: (q - 8) * scale + zero
    return Int4Weight(q.view(out_features, in_features), scale, zero)


class QuantLinear(nn.Module):
    """A `model.Linear` with its weight quantized; same inputs and outputs. `name` (the module's, e.g.
    'layers.0.mlp.down_proj') only names it in errors."""

    def __init__(self, linear: Linear, scheme: str, group_size: int, compute: torch.dtype, name: str = "",
                 activations: str = "model"):
        super().__init__()
        self.activations = activations
        weight = linear.weight.detach()
        weight = (weight.t() if linear.in_out else weight).float().contiguous()  # [out, in], on the model's device
        self.out_features, self.in_features = weight.shape
        self.scheme, self.group_size, self.compute, self.name = scheme, group_size, compute, name
        self.bias = linear.bias
        if scheme == "int8":
            if activations == "int8" and weight.device.type != "cpu":
                raise ConfigError("int8 weights by int8 activations run on a CPU only; on a GPU set activations to "
                                  "model.")
            scale = weight.abs().amax(1).clamp(min=1e-8) / 127
            q = torch.round(weight / scale.unsqueeze(1)).clamp(-127, 127).to(torch.int8)  # [out, in]
            self.register_buffer("qweight", q.contiguous())
            self.register_buffer("scales", scale.to(compute))
            self.int8_path = kernels.int8_path(weight.device, compute)  # 'aten' or 'dequant' (kernels.INT8_PATHS)
        elif scheme == "int4":
            self._store_int4(round_int4(weight, group_size))
        else:
            raise ConfigError(f"unknown quantization {scheme!r}")

    @classmethod
    def from_int4(cls, weight: Int4Weight, bias: torch.Tensor | None, compute: torch.dtype,
                  name: str = "", activations: str = "model") -> QuantLinear:
        """An int4 layer from weights already rounded (AWQ's scaled ones, or ones read back from a file), on the
        device `weight` is on."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.out_features, layer.in_features = weight.q.shape
        layer.scheme, layer.group_size, layer.compute, layer.bias = "int4", weight.group_size, compute, bias
        layer.name, layer.activations = name, activations
        layer._store_int4(weight)
        return layer

    def extra_repr(self) -> str:
        """What the layer computes with (in the model's repr, which a compiled package's key hashes: int8 weights by
        the model's activations or by int8 ones hold the same tensors)."""
        return (f"{self.in_features}, {self.out_features}, {self.scheme}, group_size={self.group_size}, "
                f"activations={self.activations}")

    def _store_int4(self, weight: Int4Weight) -> None:
        if self.activations == "int8":  # our op's layout (`model.w4a8_kernel.pack`), its scales and zeros in bf16
            check_int8_activations(weight.q.device, self.name, self.out_features, self.in_features, self.group_size)
            nibbles, numbers = w4a8_kernel.pack(weight.q, weight.scale, weight.zero)
            self.register_buffer("nibbles", nibbles)
            self.register_buffer("numbers", numbers)
            return
        # qweight: the device kernel's packed layout (on CUDA tinygemm's, or the nibbles our Triton kernel reads,
        # whichever measured faster: `kernels.int4_path`); scales: [in / group_size, out, 2] (scale, zero).
        path = "tinygemm"
        if weight.q.device.type == "cuda":
            kernels.check_int4_cuda_shape(self.name, self.out_features, self.in_features)
            if self.compute != torch.bfloat16:  # tinygemm reads bf16 only (compute_dtype(..., "int4") says so)
                raise ValueError(f"the CUDA int4 kernel computes in bfloat16, not {self.compute}")
            path = kernels.int4_path(weight.q.device, self.in_features, self.group_size)
        self.register_buffer("qweight", kernels.pack_int4(weight.q, path))
        self.register_buffer("scales", kernels.scales_and_zeros(weight.scale, weight.zero, self.compute))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.scheme == "int8" and self.activations == "int8":
            out = kernels.int8_by_int8_mm(flat, self.qweight, self.scales)
        elif self.activations == "int8":  # the op takes the model's fp32 or bf16 as it is, and answers in it
            out = w4a8_kernel.linear(flat if flat.dtype in (torch.float32, torch.bfloat16) else flat.float(),
                                     self.nibbles, self.numbers, self.group_size)
        else:
            out = self._weight_only(flat.to(self.compute))
        out = out.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def _weight_only(self, flat: torch.Tensor) -> torch.Tensor:
        """flat [rows, in] in the compute dtype by the weight, through the kernel that takes it."""
        if self.scheme == "int8" and row_kernel.takes(flat, self.qweight):  # exporting a compiled decode step
            return row_kernel.linear_int8(flat, self.qweight, self.scales)
        if self.scheme == "int8":
            return kernels.int8_mm(flat, self.qweight, self.scales, self.int8_path)
        if row_kernel.takes_int4(flat, self.qweight):  # int4, exporting a compiled decode step
            return row_kernel.linear_int4(flat, kernels.unpack_int4_cpu(self.qweight), self.scales)
        return kernels.int4_mm(flat, self.qweight, self.group_size, self.scales)

    def dequantized(self) -> torch.Tensor:
        """The [out, in] fp32 weight this layer computes with (the kernels' reference), on its device."""
        if self.scheme == "int8":
            return self.qweight.float() * self.scales.float().unsqueeze(1)
        if self.activations == "int8":
            return Int4Weight(*w4a8_kernel.unpack(self.nibbles, self.numbers)).dequantized()
        # The packed layout is the kernel's own: read it back through the kernel, 1024 input features at a time
        # (rows of the identity; each output row is one input feature's column of the weight).
        columns = []
        for start in range(0, self.in_features, 1024):
            count = min(1024, self.in_features - start)
            eye = torch.zeros(count, self.in_features, dtype=self.compute, device=self.qweight.device)
            eye.diagonal(start).fill_(1)
            columns.append(kernels.int4_mm(eye, self.qweight, self.group_size, self.scales))
        return torch.cat(columns).float().t()


def fastest_quant(device: torch.device) -> QuantConfig:
    """The fastest weights inside the quality table's limits (docs/benchmarks.md, section 6: at most +10% perplexity)
    on `device`: on a CPU where our ops build, int4 at group 32 by int8 activations (+5.4% on the bundled model,
    `model.w4a8_kernel`), except where the CPU has BF16 dot products (`row_kernel.int4_capable`) and this machine did
    not measure those clearly faster than our int4 loop (`row_kernel.a8_faster`): int4 by the model's activations
    there (+4.6%); where our ops do not build, int4 through ATen's kernel on such a CPU, else int8; elsewhere the
    model's own weights (a GPU's int4 rows are measured at batch 1 only)."""
    if device.type != "cpu":
        return QuantConfig()
    if row_kernel.unavailable() is not None:
        return QuantConfig("int4") if row_kernel.int4_capable() else QuantConfig("int8")
    if row_kernel.int4_capable() and not row_kernel.a8_faster():
        return QuantConfig("int4")
    return QuantConfig("int4", activations="int8")


def check_int8_activations(device: torch.device, name: str, out_features: int, in_features: int,
                           group_size: int) -> None:
    """Refuses, in words, an int4 layer with int8 activations where our op cannot run it."""
    if device.type != "cpu":
        raise ConfigError("int8 activations run on a CPU only (our AVX2 kernel); on a GPU set them to model.")
    if not w4a8_kernel.fits(out_features, in_features, group_size):
        raise ConfigError(f"{name or 'a projection'} ({out_features} x {in_features}) does not fit the int8 "
                          f"activations' layout (out features a multiple of 8, groups of whole blocks of 32); set "
                          f"activations to model.")
    if (reason := row_kernel.unavailable()) is not None:
        raise ConfigError(f"int8 activations need our CPU kernel, which cannot run here: {reason}; set them to "
                          f"model.")


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights as stored: parameters and quantized buffers, each tensor once."""
    seen, total = set(), 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total


@functools.cache
def compute_dtype(device_type: str, model_dtype: torch.dtype, scheme: str = "int8") -> torch.dtype:
    """The activation dtype of `scheme`'s kernels: the model's, except on a CPU where bf16 measures faster (the
    kernels are tuned for it; an fp32 model's activations are then cast around each projection) and for int4 (and
    awq) on CUDA, whose kernel takes bf16 only."""
    if device_type == "cuda" and scheme in ("int4", "awq", "gptq"):
        return torch.bfloat16
    if device_type != "cpu" or model_dtype == torch.bfloat16:
        return model_dtype
    weight = torch.zeros(1536, 576, dtype=torch.int8)

    def seconds(dtype: torch.dtype) -> float:
        x, scales = torch.randn(1, 576, dtype=dtype), torch.ones(1536, dtype=dtype)
        torch._weight_int8pack_mm(x, weight, scales)
        started = time.perf_counter()
        for _ in range(20):
            torch._weight_int8pack_mm(x, weight, scales)
        return time.perf_counter() - started

    # On one thread: on a busy 2-core host two OpenMP threads wait on each other at every call (measured: 24 ms a
    # call in either dtype, which hid a 100x difference: 49 us in bf16, 4.8 ms in fp32 on one thread).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return torch.bfloat16 if seconds(torch.bfloat16) * 1.1 < seconds(model_dtype) else model_dtype
    finally:
        torch.set_num_threads(threads)


def quantize_projections(model: nn.Module, config: QuantConfig, device_type: str, model_dtype: torch.dtype,
                         skip: tuple[str, ...] = ()) -> None:
    """Swap every `Linear` of `model` (but those named in `skip`) for a `QuantLinear` rounded to nearest as `config`
    says, computing in `compute_dtype`'s dtype: the model's projections (`quantize`), or a draft head's beside them."""
    compute = compute_dtype(device_type, model_dtype, config.scheme)
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, Linear)
               and name not in skip]
    for name, module in targets:
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr,
                QuantLinear(module, config.scheme, config.group_size, compute, name, config.activations))


def shared_copy(model: nn.Module) -> nn.Module:
    """A copy of `model`'s modules that shares every tensor with it (swap modules in the copy freely; never change a
    tensor in place): parameters, buffers, and tensors a module keeps as plain attributes (`Linear`'s other layouts,
    among them oneDNN's packed bf16 weight, which cannot be copied at all)."""
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [value for module in model.modules() for value in vars(module).values()
                if isinstance(value, torch.Tensor)]
    memo = {id(tensor): tensor for tensor in tensors}
    return copy.deepcopy(model, memo)
