"""Weight-only quantization of the projections: int8 per output channel, int4 per group of input features.

`quantize(loaded, QuantConfig(...))` returns a LoadedModel whose every `model.Linear` (the LM head too, unless
`lm_head=False`) is a `QuantLinear`; embeddings and norms stay in the model dtype and are shared with the original,
which is left as it was (the playground keeps both, one per lane).

Kernels are ATen's weight-only ones: `_weight_int8pack_mm` (int8 weights, a scale per output channel) and
`_weight_int4pack_mm_for_cpu` (int4 weights packed two per byte, a scale and a zero per group of `group_size` input
features, as tinygemm lays them out). Each dequantizes inside the matmul, so only the small weights stream from
memory. On the CPU both are fast only with bf16 activations: one decode row against a 1536x576 int8 weight took 30 us
in bf16 and 494 us in fp32 (an fp32 `F.linear` on the full weight: 69 us), so an fp32 model's activations are cast to
bf16 around each quantized projection where that measures faster on this host (`compute_dtype`, measured once), as it
does on CPUs with AVX-512 BF16 or AMX. `QuantLinear.dequantized()` gives back the float weight the kernel computes
with, the reference the tests hold the kernels to.

Round to nearest: int8 symmetric (scale = max|w| / 127), int4 asymmetric per group (scale = (max - min) / 15,
w = (q - 8) * scale + zero). Quality is measured by `python -m inference_core quality`.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import time
from dataclasses import dataclass

import torch
from torch import nn

from inference_core.config import ConfigError
from inference_core.model import Linear

SCHEMES = ("none", "int8", "int4")
GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class QuantConfig:
    scheme: str = "none"  # none, int8 (per output channel) or int4 (per group)
    group_size: int = 32  # int4: input features sharing a scale and zero
    lm_head: bool = True  # quantize the LM head too (about a fifth of a small model's weights)

    def __post_init__(self):
        if self.scheme not in SCHEMES:
            raise ConfigError(f"unknown quantization {self.scheme!r}; one of {', '.join(SCHEMES)}.")
        if self.group_size not in GROUP_SIZES:
            raise ConfigError(f"quantization group size must be one of {', '.join(map(str, GROUP_SIZES))}, "
                              f"not {self.group_size}.")

    @property
    def name(self) -> str:
        """e.g. 'int4 g32', 'int8 (LM head in the model dtype)'."""
        if self.scheme == "none":
            return "none"
        words = self.scheme + (f" g{self.group_size}" if self.scheme == "int4" else "")
        return words + ("" if self.lm_head else " (LM head in the model dtype)")


class QuantLinear(nn.Module):
    """A `model.Linear` with its weight quantized; same inputs and outputs."""

    def __init__(self, linear: Linear, scheme: str, group_size: int, compute: torch.dtype):
        super().__init__()
        weight = linear.weight.detach()
        weight = (weight.t() if linear.in_out else weight).float().contiguous()  # [out, in]
        self.out_features, self.in_features = weight.shape
        self.scheme, self.group_size, self.compute = scheme, group_size, compute
        self.bias = linear.bias
        if scheme == "int8":
            scale = weight.abs().amax(1).clamp(min=1e-8) / 127
            self.register_buffer("qweight", torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous())
            self.register_buffer("scales", scale.to(compute))
        elif scheme == "int4":
            if self.in_features % group_size:
                raise ConfigError(f"int4 groups of {group_size} do not divide {self.in_features} input features; "
                                  f"pick another --quant-group.")
            groups = weight.view(self.out_features, -1, group_size)
            low, high = groups.amin(-1), groups.amax(-1)
            scale = ((high - low) / 15).clamp(min=1e-8)
            q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
            zero = low + 8 * scale  # dequantized: (q - 8) * scale + zero
            self.register_buffer("qweight", torch._convert_weight_to_int4pack_for_cpu(
                q.view(self.out_features, self.in_features), 1))
            self.register_buffer("scales", torch.stack([scale.t(), zero.t()], -1).to(compute).contiguous())
        else:
            raise ConfigError(f"unknown quantization {scheme!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(self.compute)
        if self.scheme == "int8":
            out = torch._weight_int8pack_mm(flat, self.qweight, self.scales)
        else:
            out = torch._weight_int4pack_mm_for_cpu(flat, self.qweight, self.group_size, self.scales)
        out = out.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def dequantized(self) -> torch.Tensor:
        """The [out, in] float weight this layer computes with (the kernels' reference)."""
        if self.scheme == "int8":
            return self.qweight.float() * self.scales.float()[:, None]
        eye = torch.eye(self.in_features, dtype=self.compute)
        # The packed layout is the kernel's own: read it back through the kernel, column by column.
        return torch._weight_int4pack_mm_for_cpu(eye, self.qweight, self.group_size, self.scales).float().t()


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights as stored: parameters and quantized buffers, each tensor once."""
    seen, total = set(), 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total


@functools.cache
def compute_dtype(device_type: str, model_dtype: torch.dtype) -> torch.dtype:
    """The activation dtype of the quantized kernels: the model's, except on a CPU where bf16 measures faster (the
    kernels are tuned for it; an fp32 model's activations are then cast around each projection)."""
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

    return torch.bfloat16 if seconds(torch.bfloat16) * 1.1 < seconds(model_dtype) else model_dtype


def quantize(loaded, config: QuantConfig):
    """A LoadedModel with `config`'s quantized projections, sharing every other tensor with `loaded`."""
    if config.scheme == "none":
        return loaded
    if loaded.device.type != "cpu":
        raise ConfigError(f"weight quantization runs on the CPU so far, not on {loaded.device.type}.")
    memo = {id(tensor): tensor for tensor in [*loaded.model.parameters(), *loaded.model.buffers()]}
    model = copy.deepcopy(loaded.model, memo)  # the modules copied, the tensors shared
    compute = compute_dtype(loaded.device.type, loaded.dtype)
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, Linear)
               and (config.lm_head or name != "lm_head")]
    for name, module in targets:
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr,
                QuantLinear(module, config.scheme, config.group_size, compute))
    return dataclasses.replace(loaded, model=model, quant=config)
