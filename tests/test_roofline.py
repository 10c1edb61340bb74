"""The roofline's counts (`inference_core.roofline`): FLOPs and bytes of a forward by hand on a small configuration,
decode against the memory roof and prefill far to its right, batching moving decode right, and the ceilings measured
once and then read from the cache."""

from __future__ import annotations

import pytest
import torch

from inference_core import roofline
from inference_core.config import ModelConfig

CONFIG = ModelConfig(architecture="llama", vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4, rope_scaling=None,
                     max_position_embeddings=512, tie_word_embeddings=False, qkv_bias=False, qk_norm=False,
                     eos_token_ids=(2,), bos_token_id=1)


def test_a_forward_counted_by_hand():
    # per layer: q 64x64, k and v 64x32 each, o 64x64, three MLP 64x128: 4096 + 4096 + 4096 + 24576 = 36864
    assert roofline.projection_weights(CONFIG) == 2 * 36864
    flops, moved = roofline.forward_work(CONFIG, weights_bytes=1000.0, kv_bytes_per_token=10.0, new_tokens=3,
                                         attended_keys=30, logits_rows=1)
    assert flops == 2 * 73728 * 3 + 2 * 64 * 1000 + 4 * 2 * 4 * 16 * 30
    assert moved == 1000 + 10 * (30 + 3)


def test_decode_sits_left_of_prefill_and_batching_moves_it_right():
    weights, per_token = 2 * (2 * 36864 + 64 * 1000), 2 * 2 * 2 * 16 * 2  # bf16
    solo = roofline.run_points(CONFIG, weights, per_token, prompt_tokens=200, cached_prompt_tokens=0,
                               generated_tokens=33, ttft_s=0.01, decode_s=0.1)
    prefill, decode = solo
    assert (prefill["phase"], decode["phase"]) == ("prefill", "decode")
    assert decode["intensity"] < 1.5 < prefill["intensity"]  # about a FLOP per bf16 byte when decoding alone
    batched = roofline.run_points(CONFIG, weights, per_token, 200, 0, 33, 0.01, 0.1, batch=8)[1]
    assert batched["intensity"] > 3 * decode["intensity"]
    assert decode["flops_per_s"] == pytest.approx(decode["flops"] / 0.1)
    # a prompt read whole from the prefix cache has no prefill point
    assert [p["phase"] for p in roofline.run_points(CONFIG, weights, per_token, 200, 200, 33, 0.01, 0.1)] == ["decode"]


def test_a_lab_mode_becomes_a_prefill_and_a_decode_point_from_its_step_reports():
    """`ui.batching_view.mode_points` on hand-made reports: request 1 prefills 4 tokens, then 1 and 2 decode together,
    then 2 is preempted and recomputes its 6 tokens from an empty cache in a mixed step with 1's decode."""
    from inference_core.engine.engine import StepReport
    from ui.batching_view import RunRecord, StepRecord, mode_points

    def step(index, work, preempted=()):
        return StepRecord(StepReport(index, 0.0, 10.0, tuple(work), tuple(preempted), (), 0, 2, 0), 1)

    record = RunRecord("continuous", 4, 8, 0.0)
    record.steps += [step(0, [(1, "prefill", 4), (2, "prefill", 5)]),
                     step(1, [(1, "decode", 1), (2, "decode", 1)], preempted=[2]),
                     step(2, [(1, "decode", 1), (2, "prefill", 6)])]
    weights, per_token = 1000.0, 10.0
    prefill, decode = mode_points(record, CONFIG, weights, per_token)
    assert (prefill["phase"], decode["phase"], decode["seconds"], prefill["seconds"]) == ("prefill", "decode", 0.01,
                                                                                          0.02)
    # the decode step: contexts 4 and 5, one token each; the mixed step: 1 at context 5, 2 again from 0
    assert decode["flops"] == roofline.forward_work(CONFIG, weights, per_token, 2, 5 + 6, 2)[0]
    first = roofline.forward_work(CONFIG, weights, per_token, 9, 10 + 15, 2)
    mixed = roofline.forward_work(CONFIG, weights, per_token, 7, 6 + 21, 2)
    assert (prefill["flops"], prefill["bytes"]) == (first[0] + mixed[0], first[1] + mixed[1])


def test_the_ceilings_are_measured_once_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(roofline, "cache_root", lambda: tmp_path)
    monkeypatch.setattr(roofline, "PROBE_BYTES", 8 << 20)
    monkeypatch.setattr(roofline, "MATMUL_SIZE", 256)
    first = roofline.measure_ceilings(torch.device("cpu"), torch.float32, repeats=2)
    assert first.bandwidth_bytes_per_s > 0 and first.peak_flops_per_s > 0 and first.ridge > 0
    monkeypatch.setattr(roofline, "_bandwidth", lambda *args: pytest.fail("measured again"))
    assert roofline.measure_ceilings(torch.device("cpu"), torch.float32) == first
    monkeypatch.setattr(roofline, "_bandwidth", lambda *args: 1.0)
    assert roofline.measure_ceilings(torch.device("cpu"), torch.float32, refresh=True).bandwidth_bytes_per_s == 1.0
