"""The same engine on CUDA (skipped without a GPU): every KV mode runs in bf16, and in fp32 greedy ids on the GPU
equal those on the CPU over a short output."""

from __future__ import annotations

import pytest
import torch

from inference_core import SamplingParams, load_model

from conftest import assert_nothing_held, make_engine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def cuda_bf16():
    return load_model("bundled", device="cuda", dtype="bfloat16")


@pytest.mark.parametrize("kv_mode", ["none", "contiguous", "paged"])
def test_bf16_generates_in_every_kv_mode(cuda_bf16, kv_mode):
    engine = make_engine(cuda_bf16, kv_mode)
    event = engine.complete("Why is the sky blue?", SamplingParams(max_new_tokens=32, ignore_eos=True))
    assert len(event.token_ids) == 32 and event.text.strip()
    assert event.stats.decode_tokens_per_s > 0
    assert_nothing_held(engine)


def test_fp32_greedy_matches_cpu(bundled):
    cuda = load_model("bundled", device="cuda", dtype="float32")
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    on_gpu = make_engine(cuda, "paged").complete("Why is the sky blue?", params).token_ids
    on_cpu = make_engine(bundled, "paged").complete("Why is the sky blue?", params).token_ids
    assert on_gpu == on_cpu
