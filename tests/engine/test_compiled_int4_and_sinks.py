"""The compiled steps over an int4 KV cache (`kv.int4`, read a layer at a time by our op inside each package:
`engine.query_graph.layer_pool`) and beside attention sinks (the masks the decode and query steps take, the flat
op's window input, the greedy burst's mask update), against the eager engine with the same cache and settings.

The tiny model (fp32, head_dim 16) runs the decode step's inline attention and the flat op; greedy ids through the
compiled packages equal the eager engine's, plain and with prompt lookup (drafts accepted and rolled back), every
step compiled. Sinks change the answer beside a short window (so a step that ignored them would fail here), and the
greedy burst (`decode_steps`) keeps them in its mask.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import build_tiny_model, prompt

from inference_core import Engine, EngineConfig, SamplingParams
from inference_core.config import ConfigError
from inference_core.engine.compiled import compile_unavailable
from inference_core.kv.block_manager import FREED
from inference_core.spec.decoding import SpecConfig

pytestmark = [pytest.mark.skipif(compile_unavailable(torch.device("cpu")) is not None,
                                 reason=f"{compile_unavailable(torch.device('cpu'))}"),
              pytest.mark.usefixtures("one_torch_thread", "our_ops")]

SETTINGS = dict(kv_mode="paged", block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
LOOKUP = SpecConfig("ngram", k=4, ngram_min=1)  # 1-token matches: many drafts, many of them rejected
PARAMS = SamplingParams(max_new_tokens=40, ignore_eos=True)
WINDOWED = dict(sliding_window=8, attention_sinks=4)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama-int4-sinks"))


def repeating_prompts() -> list[list[int]]:
    """27-token prompts whose text repeats, so prompt lookup finds drafts."""
    return [prompt(9, seed) * 3 for seed in range(2)]


def compiled_engine(tiny, **settings) -> Engine:
    engine = Engine(tiny, EngineConfig(**SETTINGS, **settings, compile=True))
    engine.warm_up_compiled((1,), LOOKUP)
    return engine


def test_compiled_steps_over_an_int4_cache_give_the_eager_int4_ids(tiny):
    eager = Engine(tiny, EngineConfig(**SETTINGS, kv_dtype="int4"))
    engine = compiled_engine(tiny, kv_dtype="int4")
    graphs = engine.compile_stats()["graphs"]
    accepted = 0
    for ids in repeating_prompts():
        assert engine.complete(ids, PARAMS).token_ids == eager.complete(ids, PARAMS).token_ids
        finish = engine.complete(ids, PARAMS, spec=LOOKUP)
        assert finish.token_ids == eager.complete(ids, PARAMS, spec=LOOKUP).token_ids
        accepted += finish.stats.spec["accepted"]
        assert finish.stats.compile["compile_s"] == 0
    stats = engine.compile_stats()
    assert stats["fallbacks"] == {} and stats["graphs"] == graphs and stats["recompiles"] == 0
    assert {"flat", "1x1", "1x5 query"} <= set(stats["steps_by_bucket"]) and accepted > 0
    # Between steps only a sequence's partial block is in full precision; its earlier blocks are int4.
    int4 = engine.kv_cache.int4
    request = engine.submit(repeating_prompts()[0], SamplingParams(max_new_tokens=12, ignore_eos=True))
    for _ in range(7):
        engine.step()
    engine.kv_cache.settle()
    seq, size = request.seq, SETTINGS["block_size"]
    full = seq.num_computed_tokens // size
    assert seq.num_computed_tokens % size and [int4.storage(block) for block in seq.block_table[:full + 1]] == \
        ["int4"] * full + ["tail"]
    while engine.has_work():
        engine.step()
    assert engine.blocks_in_use() == 0


@pytest.mark.parametrize("kv_dtype", ["auto", "int4"])
def test_compiled_steps_keep_the_attention_sinks(tiny, kv_dtype):
    eager = Engine(tiny, EngineConfig(**SETTINGS, **WINDOWED, kv_dtype=kv_dtype))
    engine = compiled_engine(tiny, **WINDOWED, kv_dtype=kv_dtype)
    no_sinks = Engine(tiny, EngineConfig(**SETTINGS, sliding_window=8, kv_dtype=kv_dtype))
    differs = False
    for ids in repeating_prompts():
        want = eager.complete(ids, PARAMS).token_ids
        assert engine.complete(ids, PARAMS).token_ids == want
        assert engine.complete(ids, PARAMS, spec=LOOKUP).token_ids == eager.complete(ids, PARAMS, spec=LOOKUP).token_ids
        differs |= no_sinks.complete(ids, PARAMS).token_ids != want
    assert differs  # the sinks change what the model sees
    assert engine.compile_stats()["fallbacks"] == {}
    # The pool keeps the sink block and gives back the blocks between it and the window.
    request = engine.submit(repeating_prompts()[0], SamplingParams(max_new_tokens=16, ignore_eos=True))
    for _ in range(8):
        engine.step()
    table = request.seq.block_table
    assert table[0] != FREED and FREED in table[1:]
    while engine.has_work():
        engine.step()


def test_a_greedy_burst_keeps_the_attention_sinks_in_its_mask(tiny):
    """`decode_steps` runs several compiled decode steps back to back, the mask updated by our op between them: from a
    3-token prompt the sinks are among the keys that leave the window as the burst goes."""
    eager = Engine(tiny, EngineConfig(**SETTINGS, **WINDOWED))
    burst = Engine(tiny, EngineConfig(**SETTINGS, **WINDOWED, compile=True, decode_steps=4))
    burst.warm_up_compiled((1,))
    for ids in [prompt(3, 0)] + repeating_prompts():
        assert burst.complete(ids, PARAMS).token_ids == eager.complete(ids, PARAMS).token_ids


def test_what_the_compiled_steps_cannot_read_is_refused_in_words():
    with pytest.raises(ConfigError, match="int4 KV cache over a paged KV cache only"):
        EngineConfig(kv_mode="contiguous", kv_dtype="int4", compile=True)
    with pytest.raises(ConfigError, match="int8 KV cache runs eager only"):
        EngineConfig(kv_mode="paged", kv_dtype="int8", compile=True)
    EngineConfig(kv_mode="paged", kv_dtype="int4", compile=True, sliding_window=64, attention_sinks=4)
