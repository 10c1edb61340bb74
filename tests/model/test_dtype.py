"""`--dtype auto` (`inference_core.model.loader.choose_dtype`): bf16 on a CPU only with native bf16 math and a measured win,
float32 otherwise, always with the reason in words; the page header shows it. In bf16 on such a CPU, a step's
batched decodes attend through bf16 matmuls (`model.decode_attention_kernel`)."""

from __future__ import annotations

import pytest
import torch

from inference_core.model import loader
from inference_core.model.loader import choose_dtype, load_model
from inference_core.model.llama import attend_decodes_matmul, decode_attention_kernel

CPU = torch.device("cpu")


@pytest.fixture
def host(monkeypatch):
    """A pretend CPU: which native bf16 features it has and how long the two probe matmuls take (ms)."""
    def set_host(bf16: bool, amx: bool = False, fp32_ms: float = 1.0, bf16_ms: float = 1.0):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
        monkeypatch.setattr(loader, "_projection_ms",
                            lambda config, dtype, layout: fp32_ms if dtype == torch.float32 else bf16_ms)
    return set_host


def test_no_native_bf16_keeps_float32(bundled, host):
    host(bf16=False, fp32_ms=1.0, bf16_ms=0.1)  # not even measured: emulated bf16 is never chosen
    dtype, reason = choose_dtype(CPU, bundled.config)
    assert dtype == torch.float32 and "has no native bf16 math" in reason


def test_native_bf16_that_measures_faster_is_chosen(bundled, host):
    host(bf16=True, fp32_ms=0.2, bf16_ms=0.1)
    dtype, reason = choose_dtype(CPU, bundled.config)
    assert dtype == torch.bfloat16 and "AVX-512 BF16" in reason and "2.0x faster" in reason
    host(bf16=False, amx=True, fp32_ms=0.2, bf16_ms=0.1)
    assert choose_dtype(CPU, bundled.config)[1].count("AMX") == 1


def test_native_bf16_that_is_not_faster_keeps_float32(bundled, host):
    host(bf16=True, fp32_ms=0.105, bf16_ms=0.1)  # under the 10% margin
    dtype, reason = choose_dtype(CPU, bundled.config)
    assert dtype == torch.float32 and "no faster in bf16" in reason


def test_load_model_auto_records_the_choice_and_an_explicit_dtype_is_kept(bundled, host):
    host(bf16=True, fp32_ms=0.3, bf16_ms=0.1)
    loaded = load_model("bundled", device="cpu", dtype="auto")
    assert loaded.dtype == torch.bfloat16 and loaded.dtype_name == "bfloat16"
    assert loaded.dtype_reason.startswith("this CPU has native bf16 math")
    assert (bundled.dtype, bundled.dtype_reason) == (torch.float32, "as asked")


def test_the_probe_measures_real_matmuls(bundled):
    for dtype, layout in ((torch.float32, "in_out"), (torch.bfloat16, "out_in")):
        assert 0 < loader._projection_ms(bundled.config, dtype, layout, repeats=3) < 1000


def test_batched_decodes_attend_through_bf16_matmuls_only_with_native_bf16(host):
    host(bf16=True)
    assert decode_attention_kernel(CPU, torch.bfloat16) == "matmul"
    assert decode_attention_kernel(CPU, torch.float32) == decode_attention_kernel(torch.device("cuda"),
                                                                                   torch.bfloat16) == "sdpa"
    host(bf16=False)
    assert decode_attention_kernel(CPU, torch.bfloat16) == "sdpa"


def test_the_bf16_matmul_decode_attention_agrees_with_fp32_sdpa_and_ignores_masked_keys():
    generator = torch.Generator().manual_seed(0)
    decodes, heads, kv_heads, keys, head_dim = 5, 6, 2, 37, 16
    q = torch.randn(decodes, heads, 1, head_dim, generator=generator).bfloat16()
    # k and v as the paged gather gives them: [decodes, keys, kv_heads, head_dim] seen as [.., kv_heads, keys, ..]
    gathered_k, gathered_v = (torch.randn(decodes, keys, kv_heads, head_dim, generator=generator).bfloat16()
                              for _ in range(2))
    k, v = gathered_k.transpose(1, 2), gathered_v.transpose(1, 2)
    lengths = torch.tensor([37, 1, 20, 5, 33])
    mask = (torch.arange(keys) < lengths[:, None])[:, None, None, :]
    expected = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                                                scale=0.25, enable_gqa=True)
    out = attend_decodes_matmul(q, k, v, mask, 0.25)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    assert (out.float() - expected).abs().max() < 0.03
    past = ~mask[:, 0, 0, :]  # [decodes, keys]: past each sequence's length (padding in the gathered buffer)
    gathered_k[past], gathered_v[past] = 1e4, -1e4  # finite, as the zeroed pool guarantees
    assert torch.equal(attend_decodes_matmul(q, k, v, mask, 0.25), out)
