"""Quantized weights and the int8 KV cache on CUDA (skipped without a GPU; the GPU run selects them with `pytest -m
cuda`): the int4 (tinygemm) and int8 layers against their dequantized weights and against the CPU's rounding, a tiny
random Llama quantized on the GPU against the same model with the dequantized weights in plain Linears, an AWQ file
calibrated on the CPU loaded onto the GPU and a calibration run on the GPU, and the int8 KV cache. Needs no bundled
model, no network and no Gradio."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from inference_core import Engine, EngineConfig, load_model
from inference_core.engine.runner import ModelRunner
from inference_core.kv.cache import RecomputeKVCache, dequantize_int8, quantize_int8
from inference_core.model.llama import Linear
from inference_core.quant import calibrated_file, kernels
from inference_core.quant.linear import QuantConfig, QuantLinear, compute_dtype, round_int4, shared_copy
from inference_core.quant.quantize import quantize
from inference_core.sequence import Sequence

from tiny_models import build_tiny_model, greedy, prompt

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
VOCAB = 256


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama-quant-cuda")
    build_tiny_model(directory)
    return directory


def on_cuda(directory, dtype: str):
    return load_model(str(directory), device="cuda", dtype=dtype)


def all_logits(loaded, ids: list[int]) -> torch.Tensor:
    """fp32 logits [len(ids), vocab] of one full forward, on the CPU."""
    runner = ModelRunner(loaded.model, RecomputeKVCache(), loaded.device)
    return runner.run([Sequence(list(ids))], num_logits=len(ids)).float().cpu()


def dequantized_reference(loaded):
    """The quantized model with each QuantLinear replaced by a plain Linear holding its dequantized weight in the
    model dtype: the same function computed without the quantized kernels."""
    model = shared_copy(loaded.model)
    for name, layer in [(name, module) for name, module in model.named_modules() if isinstance(module, QuantLinear)]:
        linear = Linear(layer.in_features, layer.out_features, bias=False)
        linear.weight = nn.Parameter(layer.dequantized().to(loaded.dtype), requires_grad=False)
        linear.bias = layer.bias
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, linear)
    return dataclasses.replace(loaded, model=model, quant=None)


def assert_close_relative(got: torch.Tensor, want: torch.Tensor, tolerance: float) -> None:
    """Largest difference within `tolerance` of the largest value."""
    error = ((got - want).abs().max() / want.abs().max()).item()
    assert error < tolerance, f"relative error {error:.4f} over {tolerance}"


def random_cuda_linear(out_features: int, in_features: int, dtype: torch.dtype) -> Linear:
    linear = Linear(in_features, out_features, bias=False)
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(1)) * 0.05
    linear.weight = nn.Parameter(weight.to("cuda", dtype), requires_grad=False)
    return linear


@pytest.mark.cuda
@pytest.mark.parametrize("path", ["triton", "tinygemm"])
def test_int4_layouts_equal_their_dequantized_weight_at_every_row_count(path, monkeypatch):
    """[192, 1024] in groups of 32, stored in either CUDA layout (`kernels.int4_path`, here fixed): rows 1 and 3
    (our Triton kernel, or tinygemm) and 6 (the dequantized matmul, or tinygemm) equal x times the dequantized
    weight; and the measured choice names one of the two."""
    from inference_core.quant import triton_int4

    if path == "triton" and not triton_int4.enabled():
        pytest.skip("Triton is not installed")
    monkeypatch.setattr(kernels, "int4_path", lambda device, in_features, group_size: path)
    layer = QuantLinear(random_cuda_linear(192, 1024, torch.bfloat16), "int4", 32, torch.bfloat16, "layers.0.q")
    assert layer.qweight.dtype == (torch.uint8 if path == "triton" else torch.int32)
    want_weight = layer.dequantized()
    for rows in (1, 3, 6):
        x = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(rows)).to("cuda", torch.bfloat16)
        assert_close_relative(layer.forward(x).float(), x.float() @ want_weight.t(), 1e-2)
    assert kernels._measured_int4_path(torch.device("cuda", 0), 32) in ("triton", "tinygemm")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scheme,path", [("int4", None), ("int8", "aten"), ("int8", "dequant")])
def test_layer_equals_its_dequantized_reference(scheme, path, dtype):
    """[96, 2112] (input features in three blocks of dequantized()'s reading, 2112 / 64: tinygemm's 4 inner k-tiles):
    the kernel's output equals x times the dequantized weight (bf16 rounding apart), and the int4 weight is the one
    the CPU rounds to, each value within half a step of the float weight (a wrong nibble order fails here)."""
    if path == "aten" and not kernels.has_cuda_int8_kernel():
        pytest.skip("this torch has no CUDA kernel for _weight_int8pack_mm")
    linear = random_cuda_linear(96, 2112, dtype)
    layer = QuantLinear(linear, scheme, 32, compute_dtype("cuda", dtype, scheme), "layers.0.mlp.down_proj")
    if path is not None:
        layer.int8_path = path
    assert layer.qweight.dim() == (4 if scheme == "int4" else 2)
    x = torch.randn(5, 2112, generator=torch.Generator().manual_seed(2)).to("cuda", dtype)
    got = layer.forward(x)
    assert got.dtype == dtype and got.shape == (5, 96)
    want = x.to(layer.compute).float() @ layer.dequantized().t()
    assert_close_relative(got.float(), want, 1e-2)
    if scheme == "int4":
        weight = linear.weight.float().cpu()
        groups = weight.view(96, -1, 32)
        step = ((groups.amax(-1) - groups.amin(-1)) / 15).repeat_interleave(32, 1)
        dequantized = layer.dequantized().cpu()
        assert ((dequantized - weight).abs() <= step / 2 + 0.01 * weight.abs().max()).all()
        # The CPU's rounding of the same weight: equal but for bf16's rounding of the kernel's fma, and for a rare
        # value at a rounding tie (bf16 weights make exact halves likely) one step apart; a wrong nibble order or
        # layout would move about 15 in 16 values.
        on_cpu = round_int4(weight, 32).dequantized(torch.bfloat16)
        agree = (dequantized - on_cpu).abs() <= 0.01 * weight.abs().max()
        assert agree.float().mean() > 0.99


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_tiny_llama_runs_on_cuda(tiny_dir, scheme, dtype):
    """The tiny Llama quantized on the GPU: every projection on the device's kernel, valid greedy ids from the paged
    engine, and logits close to the same model with the dequantized weights in plain Linears."""
    loaded = on_cuda(tiny_dir, dtype)
    quantized = quantize(loaded, QuantConfig(scheme, 32))
    layers = [module for module in quantized.model.modules() if isinstance(module, QuantLinear)]
    assert len(layers) == 9 and all(layer.qweight.is_cuda for layer in layers)
    ids = Engine(quantized, EngineConfig(kv_mode="paged")).complete(prompt(12, 0), greedy(24)).token_ids
    assert len(ids) == 24 and all(0 <= token < VOCAB for token in ids)
    ids = prompt(30, 1)
    assert_close_relative(all_logits(quantized, ids), all_logits(dequantized_reference(quantized), ids), 3e-2)


@pytest.mark.cuda
def test_calibrated_file_from_the_cpu_loads_onto_cuda_and_calibration_runs_there(tiny_dir, tmp_path):
    """bf16 (a layout both devices share, so one fingerprint): a file calibrated on the CPU loads onto the GPU in
    tinygemm's layout with logits close to the CPU's; calibrating on the GPU keeps every projection at most RTN's
    error, and its file loads back to the same logits."""
    sequences = [prompt(64, seed) for seed in range(4)]
    on_cpu = load_model(str(tiny_dir), device="cpu", dtype="bfloat16")
    cpu_awq, _, _ = calibrated_file.calibrate_and_save(on_cpu, 32, tmp_path / "cpu.safetensors", sequences=sequences)
    loaded = on_cuda(tiny_dir, "bfloat16")
    cuda_awq = calibrated_file.load(loaded, tmp_path / "cpu.safetensors")
    down = cuda_awq.model.layers[0].mlp.down_proj
    assert isinstance(down, QuantLinear) and down.qweight.is_cuda and down.qweight.dim() == 4
    assert cuda_awq.model.layers[0].input_layernorm.weight.is_cuda
    ids = prompt(30, 2)
    assert_close_relative(all_logits(cuda_awq, ids), all_logits(cpu_awq, ids), 3e-2)
    calibrated, calibration, _ = calibrated_file.calibrate_and_save(loaded, 32, tmp_path / "cuda.safetensors",
                                                             sequences=sequences)
    assert all(choice.awq_error <= choice.rtn_error for choice in calibration.choices.values())
    reloaded = calibrated_file.load(loaded, tmp_path / "cuda.safetensors")
    torch.testing.assert_close(all_logits(reloaded, ids), all_logits(calibrated, ids), rtol=1e-3, atol=1e-3)


@pytest.mark.cuda
def test_int8_kv_cache_on_cuda(tiny_dir):
    """quantize_int8 / dequantize_int8 give the CPU's bytes and values on the GPU; the fp32 tiny Llama with int8 KV
    gives the same greedy ids paged and contiguous on the GPU as paged on the CPU."""
    x = torch.randn(3, 5, 2, 16, generator=torch.Generator().manual_seed(3))
    stored = quantize_int8(x.cuda())
    assert stored.dtype == torch.int8 and torch.equal(stored.cpu(), quantize_int8(x))
    assert torch.equal(dequantize_int8(stored, torch.float32).cpu(), dequantize_int8(quantize_int8(x), torch.float32))
    loaded = on_cuda(tiny_dir, "float32")
    ids = prompt(20, 4)
    runs = {mode: Engine(loaded, EngineConfig(kv_mode=mode, kv_dtype="int8")).complete(ids, greedy(24)).token_ids
            for mode in ("paged", "contiguous")}
    on_cpu = load_model(str(tiny_dir), device="cpu", dtype="float32")
    want = Engine(on_cpu, EngineConfig(kv_mode="paged", kv_dtype="int8")).complete(ids, greedy(24)).token_ids
    assert runs["paged"] == runs["contiguous"] == want and len(want) == 24
