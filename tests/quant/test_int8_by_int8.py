"""int8 weights by int8 activations (`QuantConfig("int8", activations="int8")`, bench's `+int8+a8`): the product
against its formula in torch ops, a compiled engine giving the eager ids with every step compiled, a package apart
from the weight-only int8 one's (the same tensors), and a GPU refused in words."""

from __future__ import annotations

import pytest
import torch

from inference_core import ConfigError, Engine, EngineConfig, SamplingParams
from inference_core.quant import kernels
from inference_core.model.llama import Linear
from inference_core.quant.linear import QuantConfig, QuantLinear
from inference_core.quant.quantize import quantize

from tiny_models import build_tiny_model, prompt


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama-w8a8"))


@pytest.mark.parametrize("rows, dtype", [(1, torch.bfloat16), (3, torch.float32), (40, torch.bfloat16)])
def test_it_multiplies_each_row_rounded_to_int8_by_the_int8_weight(rows, dtype):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=generator).to(dtype)
    x[0] = 0  # a row of zeros: scale clamped, zeros out
    q = torch.randint(-127, 128, (48, 96), generator=generator, dtype=torch.int8)
    scales = torch.rand(48, generator=generator).to(dtype) / 50
    x_scale = x.float().abs().amax(1, keepdim=True).clamp(min=1e-8) / 127
    xq = torch.round(x.float() / x_scale)
    want = (xq @ q.float().t()) * x_scale * scales.float()  # integers: exact in fp32 at these sizes
    got = kernels.int8_by_int8_mm(x, q, scales)
    assert got.dtype == dtype and got.shape == (rows, 48) and torch.equal(got[0], torch.zeros_like(got[0]))
    torch.testing.assert_close(got.float(), want.to(dtype).float(), rtol=0, atol=0)


def test_a_compiled_engine_gives_the_eager_ids_in_its_own_package(our_ops, tiny):
    """Prefill (the flat step) and decode compiled: the eager forward's ids (both run the same integer product).
    The weight-only int8 model holds the same tensors, so its package key must differ by how its layers compute."""
    ids = prompt(9, 3)
    w8a8 = quantize(tiny, QuantConfig("int8", activations="int8"))
    want = Engine(w8a8, EngineConfig(kv_mode="paged", block_size=4)).complete(ids, SamplingParams(
        max_new_tokens=10, ignore_eos=True)).token_ids
    compiled = Engine(w8a8, EngineConfig(kv_mode="paged", block_size=4, compile=True))
    finish = compiled.complete(ids, SamplingParams(max_new_tokens=10, ignore_eos=True))
    assert finish.token_ids == want and finish.stats.compile["fallbacks"] == {}
    weight_only = Engine(quantize(tiny, QuantConfig("int8")), EngineConfig(kv_mode="paged", block_size=4,
                                                                          compile=True))
    args = (torch.zeros(2, dtype=torch.long),)
    assert compiled.decoder._package_key(args) != weight_only.decoder._package_key(args)


def test_another_device_is_refused_in_words():
    """Only the CPU's int8 matmul is wired up: a weight elsewhere (here PyTorch's meta device, as a GPU's would be)
    is refused when the layer is made."""
    layer = Linear(8, 8, bias=False).to("meta")
    with pytest.raises(ConfigError, match="int8 weights by int8 activations run on a CPU only"):
        QuantLinear(layer, "int8", 32, torch.bfloat16, activations="int8")
