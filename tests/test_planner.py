"""The memory planner (`inference_core.planner`) against what the engine allocates: on the bundled model, for every
weight quantization and KV dtype, paged (gather and FlexAttention's pool) and contiguous, the planned weight bytes,
KV bytes per token and KV pool bytes equal the engine's exactly; a finished request's reserved KV equals the plan's
bytes per sequence; a sliding window caps it; the sequences that fit follow from the free memory."""

from __future__ import annotations

import json

import pytest

from inference_core import Engine, EngineConfig, SamplingParams
from inference_core.cli import main
from inference_core.planner import engine_figures, plan_memory
from inference_core.quant.linear import QuantConfig
from inference_core.quant.quantize import quantize

KV_SETTINGS = [dict(kv_mode="paged"), dict(kv_mode="paged", kv_dtype="int8"), dict(kv_mode="paged", attention="flex"),
               dict(kv_mode="paged", kv_dtype="int4"), dict(kv_mode="contiguous"),
               dict(kv_mode="contiguous", kv_dtype="int8"), dict(kv_mode="contiguous", kv_dtype="int4")]


@pytest.mark.parametrize("quant", [QuantConfig("none"), QuantConfig("int8"), QuantConfig("int4", 64),
                                   QuantConfig("int8", lm_head=False)], ids=lambda q: q.name)
def test_the_plan_equals_what_the_engine_allocates(bundled, quant):
    model = quantize(bundled, quant)
    for settings in KV_SETTINGS:
        config = EngineConfig(max_seq_len=512, max_num_seqs=3, **settings)
        plan = plan_memory(bundled, config, quant)
        figures = engine_figures(Engine(model, config))
        assert (plan.weights_bytes, plan.kv_bytes_per_token, plan.kv_pool_bytes) == (
            figures["weights_bytes"], figures["kv_bytes_per_token"], figures["kv_pool_bytes"]), settings


def test_a_run_reserves_what_the_plan_says_per_sequence(bundled):
    config = EngineConfig(kv_mode="paged", block_size=16, max_seq_len=512)
    engine = Engine(bundled, config)
    prompt = engine.prompt_ids("Why is the sky blue?")
    final = engine.complete(prompt, SamplingParams(max_new_tokens=20, ignore_eos=True))
    plan = plan_memory(bundled, config, context_len=len(prompt) + 20 - 1)  # the last token's KV is never written
    assert final.stats.kv_bytes_reserved == plan.kv_bytes_per_sequence
    # A sliding window of 32 tokens spans at most 3 blocks of 16, whatever the length: the plan's figure is that
    # most, which this run reaches (at other lengths the window can sit in 2 blocks).
    windowed_config = EngineConfig(kv_mode="paged", block_size=16, max_seq_len=512, sliding_window=32)
    windowed = Engine(bundled, windowed_config).complete(prompt, SamplingParams(max_new_tokens=60, ignore_eos=True))
    plan = plan_memory(bundled, windowed_config, context_len=400)
    assert windowed.stats.kv_bytes_reserved == plan.kv_bytes_per_sequence == 48 * plan.kv_bytes_per_token
    # 4 attention sinks keep their block beside the window's; an int4 cache also writes a block per sequence in the
    # model dtype.
    sinks_config = EngineConfig(kv_mode="paged", block_size=16, max_seq_len=512, sliding_window=32, attention_sinks=4,
                                kv_dtype="int4", max_num_seqs=2)
    sinks = Engine(bundled, sinks_config).complete(prompt, SamplingParams(max_new_tokens=60, ignore_eos=True))
    plan = plan_memory(bundled, sinks_config, context_len=400)
    assert sinks.stats.kv_bytes_reserved == plan.kv_bytes_per_sequence == 64 * plan.kv_bytes_per_token
    assert plan.kv_tail_bytes == 2 * 16 * bundled.config.kv_bytes_per_token(bundled.dtype)


def test_the_sequences_that_fit_follow_from_the_free_memory(bundled):
    config = EngineConfig(kv_mode="paged", max_seq_len=512)
    plan = plan_memory(bundled, config, context_len=512, free_bytes=2 * 2**30)
    assert plan.sequences_that_fit == (2 * 2**30 - plan.weights_bytes - plan.activation_bytes) // (
        512 * plan.kv_bytes_per_token)
    assert plan_memory(bundled, config, free_bytes=plan.weights_bytes).sequences_that_fit == 0


def test_the_command_prints_the_plan_beside_the_engine(bundled, capsys):
    assert main(["memory-plan", "--dtype", "float32", "--kv", "paged", "--kv-dtype", "int8", "--quant", "int8",
                 "--max-seq-len", "512", "--context", "256", "--check", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    plan, engine = report["plan"], report["engine"]
    assert plan["context_len"] == 256 and plan["kv_bytes_per_sequence"] == 256 * plan["kv_bytes_per_token"]
    assert {key: plan[key] for key in engine} == engine
