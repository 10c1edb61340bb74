"""The CUDA int4 and int8 paths (`inference_core.quant.kernels`), checked without a GPU: the nibble order and
tinygemm's packed layout (its CUDA packing kernel and its reading of the packed words emulated from int4mm.cu, so a
flipped nibble order shows here and not only on a GPU), the scales_and_zeros layout, the shape rules and their
messages, the kernel chosen by device, and the whole CUDA layer built and run on fake CUDA tensors (shapes and dtypes
through torch's meta kernels). tests/quant/test_cuda.py runs the same layers on a GPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from inference_core import ConfigError
from inference_core.model.llama import Linear
from inference_core.quant import calibrated_file, kernels
from inference_core.quant.linear import QuantConfig, QuantLinear, compute_dtype, round_int4
from inference_core.quant.quantize import quantize

from tiny_models import build_tiny_model


def random_q(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 16, (out_features, in_features), generator=torch.Generator().manual_seed(seed),
                         dtype=torch.int32)


def test_nibbles_hold_the_even_column_high_and_the_odd_column_low():
    assert kernels.pack_nibbles(torch.tensor([[1, 2, 3, 4], [15, 0, 0, 15]])).tolist() == [[0x12, 0x34], [0xF0, 0x0F]]
    q = random_q(24, 96)
    packed = kernels.pack_nibbles(q)
    assert packed.dtype == torch.uint8 and packed.shape == (24, 48) and packed.is_contiguous()
    unpacked = [[nibble for byte in row for nibble in (byte >> 4, byte & 15)] for row in packed.tolist()]
    assert unpacked == q.tolist()


def tinygemm_pack(nibbles: torch.Tensor, inner_k_tiles: int) -> torch.Tensor:
    """`_convert_weight_to_int4pack` on CUDA as int4mm.cu's matrix_to_m16n8k16_Bint4_layout writes it (NVIDIA):
    uint8 [n, k / 2] -> int32 words [n / 8, k / (inner * 16), 32 lanes, inner / 2]."""
    out_features, half = nibbles.shape
    words = torch.zeros(out_features // 8, 2 * half // (inner_k_tiles * 16), 32, inner_k_tiles // 2, dtype=torch.int64)
    lane = torch.arange(32)
    for n_tile in range(words.shape[0]):
        for k_outer in range(words.shape[1]):
            for inner in range(0, inner_k_tiles, 2):
                base = (k_outer * inner_k_tiles + inner) * 8  # byte index of this pair of 16-wide k-tiles
                bytes_ = [nibbles[n_tile * 8 + lane // 4, column].long() for column in
                          (base + lane % 4, base + lane % 4 + 4, base + 8 + lane % 4, base + 12 + lane % 4)]
                words[n_tile, k_outer, :, inner // 2] = sum(((byte & 15) << (16 + 4 * i)) | ((byte >> 4) << (4 * i))
                                                            for i, byte in enumerate(bytes_))
    return words


def tinygemm_read(words: torch.Tensor, inner_k_tiles: int) -> torch.Tensor:
    """The [n, k] nibbles the CUDA matmul reads from the words: convert_i4x8_to_bf16x2x4 makes register r of a word
    from nibbles r (low half) and r + 4 (high half); registers 0, 1 feed the first k-tile's m16n8k16 B fragment,
    2, 3 the second, and lane t's fragment is columns 2(t % 4), +1 and 2(t % 4) + 8, +9 of row n_tile * 8 + t / 4."""
    n_tiles, k_outers, _, pairs = words.shape
    q = torch.full((n_tiles * 8, k_outers * inner_k_tiles * 16), -1, dtype=torch.int64)
    lane = torch.arange(32)
    for n_tile in range(n_tiles):
        for k_outer in range(k_outers):
            for pair in range(pairs):
                nibble = [(words[n_tile, k_outer, :, pair] >> (4 * p)) & 15 for p in range(8)]
                for second in (0, 1):
                    column = (k_outer * inner_k_tiles + 2 * pair + second) * 16 + 2 * (lane % 4)
                    row = n_tile * 8 + lane // 4
                    q[row, column], q[row, column + 1] = nibble[2 * second], nibble[2 * second + 4]
                    q[row, column + 8], q[row, column + 9] = nibble[2 * second + 1], nibble[2 * second + 5]
    return q


@pytest.mark.parametrize("inner_k_tiles", [2, 4, 8])
def test_tinygemm_reads_back_the_columns_we_pack(inner_k_tiles):
    q = random_q(16, 128, inner_k_tiles)
    assert torch.equal(tinygemm_read(tinygemm_pack(kernels.pack_nibbles(q), inner_k_tiles), inner_k_tiles), q.long())
    swapped = ((q[:, 1::2] << 4) | q[:, 0::2]).to(torch.uint8)  # the other order (our AWQ file's) would not
    assert not torch.equal(tinygemm_read(tinygemm_pack(swapped, inner_k_tiles), inner_k_tiles), q.long())


def test_scales_and_zeros_are_group_major_scale_then_zero_in_bf16():
    rounded = round_int4(torch.randn(16, 128, generator=torch.Generator().manual_seed(2)), 32)
    layout = kernels.scales_and_zeros(rounded.scale, rounded.zero, torch.bfloat16)
    assert layout.shape == (4, 16, 2) and layout.dtype == torch.bfloat16 and layout.is_contiguous()
    assert torch.equal(layout[2, 5, 0], rounded.scale[5, 2].bfloat16())
    assert torch.equal(layout[2, 5, 1], rounded.zero[5, 2].bfloat16())


def test_inner_k_tiles_and_shapes_that_do_not_fit_the_cuda_kernel():
    assert [kernels.inner_k_tiles(k) for k in (4096, 14336, 576, 64, 96, 48)] == [8, 8, 4, 4, 2, None]
    kernels.check_int4_cuda_shape("layers.0.mlp.down_proj", 1024, 3072)
    with pytest.raises(ConfigError, match=r"^lm_head \[32001, 4096\] does not fit the CUDA int4 kernel \(tinygemm\): "
                                          r"its 32001 output features are not a multiple of 8; keep the LM head in "
                                          r"the model dtype \(--no-quant-lm-head\)\.$"):
        kernels.check_int4_cuda_shape("lm_head", 32001, 4096)
    with pytest.raises(ConfigError, match=r"layers.1.self_attn.o_proj \[100, 48\] .* its 100 output features are "
                                          r"not a multiple of 8 and its 48 input features are not a multiple of 32; "
                                          r"use --quant int8"):
        kernels.check_int4_cuda_shape("layers.1.self_attn.o_proj", 100, 48)


def test_the_kernel_follows_the_device(monkeypatch):
    assert kernels.int8_path(torch.device("cpu"), torch.bfloat16) == "aten"
    with monkeypatch.context() as patch:  # a torch with no CUDA kernel for the op (a CPU build registers none)
        patch.setattr(kernels, "has_cuda_int8_kernel", lambda: False)
        assert kernels.int8_path(torch.device("cuda"), torch.bfloat16) == "dequant"
    assert compute_dtype("cuda", torch.float32, "int4") == torch.bfloat16  # tinygemm: bf16 activations only
    assert compute_dtype("cuda", torch.float16, "awq") == torch.bfloat16
    assert compute_dtype("cuda", torch.float16, "int8") == torch.float16
    assert compute_dtype("cpu", torch.bfloat16, "int4") == torch.bfloat16


def test_devices_without_kernels_are_refused(tmp_path):
    tiny = build_tiny_model(tmp_path)
    on_mps = dataclasses.replace(tiny, device=torch.device("mps"))
    for scheme in ("int8", "int4", "awq"):
        with pytest.raises(ConfigError, match="runs on the CPU and on CUDA, not on mps; load the model with"):
            quantize(on_mps, QuantConfig(scheme))
    with pytest.raises(ConfigError, match="not on mps"):
        calibrated_file.load(on_mps, tmp_path / "any.safetensors")


def fake_cuda_linear(mode: FakeTensorMode, out_features: int, in_features: int) -> Linear:
    linear = Linear(in_features, out_features, bias=False)
    with mode:
        linear.weight = torch.nn.Parameter(torch.empty(out_features, in_features, device="cuda"), requires_grad=False)
    return linear


@pytest.mark.parametrize("in_features,inner_k_tiles", [(256, 8), (576, 4), (96, 2)])
def test_the_cuda_layers_build_and_run_on_fake_cuda_tensors(in_features, inner_k_tiles, monkeypatch):
    """The CUDA code path end to end on fake tensors: the packed weight has tinygemm's shape, the scales are bf16
    [in / group, out, 2], an fp32 input comes back fp32 through bf16 (int4) and through both int8 forms, and
    dequantized() reads the layout back."""
    monkeypatch.setattr(kernels, "int8_path", lambda device, dtype: "dequant")  # never time fake tensors
    monkeypatch.setattr(kernels, "int4_path", lambda device, in_features, group_size: "tinygemm")
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    int4_linear, int8_linear = fake_cuda_linear(mode, 96, in_features), fake_cuda_linear(mode, 96, in_features)
    with mode:
        int4 = QuantLinear(int4_linear, "int4", 32, torch.bfloat16, "layers.0.mlp.down_proj")
        int8 = QuantLinear(int8_linear, "int8", 32, torch.float32)
        x = torch.empty(3, 5, in_features, device="cuda")
        for layer, path in ((int4, None), (int8, "dequant"), (int8, "aten")):
            layer.int8_path = path
            out = layer.forward(x)
            assert out.device.type == "cuda" and out.dtype == torch.float32 and out.shape == (3, 5, 96)
            assert layer.dequantized().shape == (96, in_features)
    assert int4.qweight.device.type == "cuda" and int4.qweight.dtype == torch.int32
    assert int4.qweight.shape == (96 // 8, in_features // (inner_k_tiles * 16), 32, inner_k_tiles // 2)
    assert int4.scales.shape == (in_features // 32, 96, 2) and int4.scales.dtype == torch.bfloat16
    assert int8.qweight.dtype == torch.int8
    misfit, fp16 = fake_cuda_linear(mode, 100, 256), fake_cuda_linear(mode, 96, 256)
    with mode, pytest.raises(ConfigError, match=r"^layers.0.mlp.up_proj \[100, 256\] does not fit"):
        QuantLinear(misfit, "int4", 32, torch.bfloat16, "layers.0.mlp.up_proj")
    with mode, pytest.raises(ValueError, match="computes in bfloat16"):
        QuantLinear(fp16, "int4", 32, torch.float16)
