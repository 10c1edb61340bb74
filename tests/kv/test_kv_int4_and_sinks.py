"""The int4 KV cache (`kv.int4`: keys per channel over a block, values per token in groups, the newest block in
full precision) and attention sinks beside a sliding window, on a tiny random Mistral the tests build (head_dim 16,
2 layers, 2 KV heads) with an 8-token window in its checkpoint.

The int4 cache is checked (on a full-attention twin) against the float cache (logits close, not equal), for its
block lifecycle (only a sequence's partial block in full precision between steps; full blocks int4; nothing left in
the tail once requests end), and through prefix caching, speculation and preemption (trees: test_draft_heads).
Sinks are checked against mode none, which recomputes the whole text every step under the same masks and keeps no
blocks: a paged pool that released a sink's block, or kept a wrong one, would give other ids.
"""

from __future__ import annotations

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

import inference_core
from inference_core import Engine, EngineConfig, SamplingParams
from inference_core.config import ConfigError
from inference_core.kv import int4
from inference_core.kv.block_manager import FREED, BlockManager
from inference_core.sequence import Sequence
from inference_core.spec.decoding import SpecConfig
from tiny_models import TINY, final, run_to_end, write_word_level_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WINDOW = 8
PROMPT = [(31 * i + 7) % 256 for i in range(37)]
REPEATING = [(5 * i) % 23 + 3 for i in range(12)] * 4  # prompt lookup finds drafts in it


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mistral-window")
    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(**TINY, tie_word_embeddings=False, sliding_window=WINDOW)).eval()
    model.save_pretrained(str(directory))
    write_word_level_tokenizer(directory)
    return inference_core.load_model(str(directory), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def full_attention(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mistral-full")
    torch.manual_seed(1)
    MistralForCausalLM(MistralConfig(**TINY, tie_word_embeddings=False, sliding_window=None)).save_pretrained(
        str(directory))
    write_word_level_tokenizer(directory)
    return inference_core.load_model(str(directory), device="cpu", dtype="float32")


def greedy(count: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=count, ignore_eos=True)


def test_int4_codes_round_trip_within_half_a_step_of_their_range():
    torch.manual_seed(0)
    # Keys with channels of very different sizes (KIVI's outlier channels): each has a scale of its own.
    keys = torch.randn(3, 4, 2, 16) * torch.logspace(-2, 2, 16)
    codes, ranges = int4.quantize_keys(keys)
    assert codes.dtype == torch.uint8 and codes.shape == (3, 4, 2, 8) and ranges.shape == (3, 2, 2, 16)
    step = (keys.amax(1, keepdim=True) - keys.amin(1, keepdim=True)) / int4.LEVELS
    assert ((int4.dequantize_keys(codes, ranges, torch.float32) - keys).abs() <= step * 0.51 + 1e-6).all()
    values = torch.randn(3, 4, 2, 64) * 5
    codes, ranges = int4.quantize_values(values, 32)
    assert codes.shape == (3, 4, 2, 32) and ranges.shape == (3, 4, 2, 2, 2)  # two groups, (minimum, scale) each
    grouped = values.unflatten(-1, (2, 32))
    step = ((grouped.amax(-1, keepdim=True) - grouped.amin(-1, keepdim=True)) / int4.LEVELS).expand_as(grouped)
    error = (int4.dequantize_values(codes, ranges, torch.float32) - values).unflatten(-1, (2, 32)).abs()
    assert (error <= step * 0.51 + 1e-6).all()


@pytest.mark.parametrize("kv_mode", ["contiguous", "paged"])
def test_int4_kv_cache_logits_track_the_float_cache(full_attention, kv_mode):
    """Prefill 20 tokens, then decode 17 more one at a time through the float and the int4 cache: the logits stay
    close; the bytes per token are the codes (head_dim / 2 per tensor) and the fp16 ranges (two per key channel and
    block, two per value group and token), per layer and KV head."""
    logits, sizes = {}, {}
    for kv_dtype in ("auto", "int4"):
        engine = Engine(full_attention, EngineConfig(kv_mode=kv_mode, block_size=4, kv_dtype=kv_dtype))
        seq = Sequence(list(PROMPT[:20]))
        engine.kv_cache.allocate(seq)
        steps = [engine.runner.run([seq])[0]]
        for token in PROMPT[20:]:
            seq.token_ids.append(token)
            steps.append(engine.runner.run([seq])[0])
        logits[kv_dtype], sizes[kv_dtype] = torch.stack(steps), engine.kv_cache.bytes_per_token
    block = 4 if kv_mode == "paged" else 16  # a contiguous slot's int4 blocks are 16 tokens
    assert sizes == {"auto": 2 * 2 * 2 * 16 * 4, "int4": 2 * 2 * (16 + 4 * 16 // block + 4 * 1)}
    reference, quantized = logits["auto"], logits["int4"]
    assert not torch.equal(quantized, reference)
    error = (quantized - reference).abs()
    # Random tiny weights give rougher keys than a trained model's (the bundled model's perplexity: `quality`)
    assert error.max() < 0.6 * reference.std() and error.mean() < 0.1 * reference.std(), (error.max(), error.mean())


def test_only_the_partial_block_stays_in_full_precision(full_attention):
    """Between steps a request's full blocks are int4 and its last, partly written block is in the tail; the KV
    view marks which is which; once every request has ended, the tail holds nothing."""
    from ui.kv_view import render_pool

    engine = Engine(full_attention, EngineConfig(kv_mode="paged", block_size=4, kv_dtype="int4"))
    events = engine.generate(list(PROMPT), greedy(20))
    for _ in range(6):
        next(events)
    snapshot = engine.kv_snapshot()
    (request,) = snapshot["requests"]
    storage = {block["id"]: block.get("storage") for block in snapshot["blocks"]}
    computed = request["stored_tokens"]  # 37 + 5 = 42: ten full blocks and two tokens of the eleventh
    table = request["block_table"]
    engine.kv_cache.int4.sweep(engine.kv_cache._block_state)  # what the next step's prepare does first
    assert computed == 42 and [storage[block] for block in table[:10]] == ["int4"] * 10
    assert storage[table[10]] == "tail" and len(engine.kv_cache.int4.tail_of) == 1
    page = render_pool(snapshot, lambda ids: " ".join(map(str, ids)), "pool")
    assert page.count('data-storage="tail"') == 1 and "KV stored in int4" in page and "1px dashed" in page
    list(events)
    engine.kv_cache.int4.sweep(engine.kv_cache._block_state)  # the next step's: its full blocks int4, the rest gone
    assert engine.kv_cache.int4.tail_of == {} and engine.blocks_in_use() == 0
    assert len(engine.kv_cache.int4.free_tail) == engine.kv_cache.int4.tail_k.shape[1]


def test_int4_prefix_cache_and_speculation_track_plain_decoding(full_attention):
    """A second request with the same prompt reads its first 36 tokens from int4 blocks the first one wrote; prompt
    lookup's verifications roll back rejected tokens in the tail; the ids follow plain int4 decoding (near-ties may
    part later: a verification that crosses into a new block attends to the block it filled unquantized, where a
    decode would see it quantized)."""
    config = EngineConfig(kv_mode="paged", block_size=4, kv_dtype="int4")
    engine = Engine(full_attention, config)
    first = engine.complete(list(PROMPT), greedy(24))
    again = engine.complete(list(PROMPT), greedy(24))
    assert again.stats.cached_prompt_tokens == 36 and again.token_ids[:8] == first.token_ids[:8]
    for kv_mode in ("contiguous", "paged"):
        config = EngineConfig(kv_mode=kv_mode, block_size=4, kv_dtype="int4")
        plain = Engine(full_attention, config).complete(list(REPEATING), greedy(40))
        engine = Engine(full_attention, config)
        spec = engine.complete(list(REPEATING), greedy(40), spec=SpecConfig(method="ngram", k=3))
        assert len(spec.token_ids) == 40 and spec.token_ids[:8] == plain.token_ids[:8], kv_mode
        assert 0 < spec.stats.spec["accepted"] < spec.stats.spec["drafted"]


def test_int4_survives_preemption_and_batching(full_attention):
    """A pool too small for three requests at once preempts and recomputes; every request finishes, and the tail
    holds at most a block per running request plus the step's writes."""
    engine = Engine(full_attention, EngineConfig(kv_mode="paged", block_size=4, kv_dtype="int4", kv_cache_tokens=64,
                                                 max_num_seqs=3))
    requests = [engine.submit(list(PROMPT[:n]), greedy(24)) for n in (9, 17, 25)]
    run_to_end(engine)
    finals = [final(request) for request in requests]
    assert [len(event.token_ids) for event in finals] == [24, 24, 24]
    assert sum(event.stats.preemptions for event in finals) > 0
    assert engine.kv_cache.int4.tail_k.shape[1] <= 16 and engine.blocks_in_use() == 0


def test_release_before_keeps_the_sink_blocks():
    manager = BlockManager(num_blocks=8, block_size=4)
    seq = Sequence(list(range(22)))
    manager.allocate(seq)
    manager.commit(seq, 22)
    manager.release_before(seq, 17, keep=5)  # positions 0-4 are sinks: blocks 0 and 1 stay; 2 and 3 go
    assert seq.block_table == [0, 1, FREED, FREED, 4, 5]


@pytest.mark.parametrize("kv_dtype", ["auto", "int4"])
def test_sinks_in_the_paged_pool_give_the_ids_of_recomputing_the_whole_text(windowed, kv_dtype):
    """Window 8 and 2 sinks over 37 + 40 tokens: the paged pool (giving back every block between the sink block and
    the window) and the contiguous cache decode the ids mode none computes from the whole text with the same masks;
    without sinks the ids differ; and the pool's blocks stay constant as the text grows, the sink block held, with
    the int4 cache too."""
    sinks = dict(attention_sinks=2)
    reference = Engine(windowed, EngineConfig(kv_mode="none", **sinks)).complete(list(PROMPT), greedy(40)).token_ids
    assert Engine(windowed, EngineConfig(kv_mode="none")).complete(list(PROMPT), greedy(40)).token_ids != reference
    if kv_dtype == "auto":
        for kv_mode in ("contiguous", "paged"):
            engine = Engine(windowed, EngineConfig(kv_mode=kv_mode, block_size=4, **sinks))
            assert engine.complete(list(PROMPT), greedy(40)).token_ids == reference, kv_mode
    engine = Engine(windowed, EngineConfig(kv_mode="paged", block_size=4, kv_dtype=kv_dtype, **sinks))
    held = []
    for _ in engine.generate(list(PROMPT), greedy(120)):
        if engine.scheduler.running:
            held.append(engine.kv_cache.blocks_in_use())
            table = engine.scheduler.running[0].seq.block_table
            assert table[0] != FREED
    assert set(held[1:]) <= {3, 4}  # the sink block beside the window's 2 or 3


def test_the_kv_view_marks_the_sink_block(windowed):
    from ui.kv_view import render_pool

    engine = Engine(windowed, EngineConfig(kv_mode="paged", block_size=4, attention_sinks=4))
    events = engine.generate(list(PROMPT), greedy(30))
    for _ in range(10):
        next(events)
    snapshot = engine.kv_snapshot()
    table = snapshot["requests"][0]["block_table"]
    assert snapshot["attention_sinks"] == 4 and table[0] != FREED and table[1] == FREED
    page = render_pool(snapshot, lambda ids: " ".join(map(str, ids)), "pool")
    assert "holds the attention sinks" in page and "The first 4 tokens stay in view as attention sinks" in page
    events.close()


def test_unsupported_combinations_say_what_to_change(full_attention):
    with pytest.raises(ConfigError, match="int4 KV cache needs a KV cache"):
        EngineConfig(kv_mode="none", kv_dtype="int4")
    with pytest.raises(ConfigError, match="int4 KV cache over a paged KV cache only"):
        EngineConfig(kv_mode="contiguous", kv_dtype="int4", compile=True)
    with pytest.raises(ConfigError, match="flex attention reads the pool in the model dtype"):
        EngineConfig(kv_mode="paged", kv_dtype="int4", attention="flex")
    with pytest.raises(ConfigError, match="attention sinks must be 0 or a positive"):
        EngineConfig(attention_sinks=-1)
    with pytest.raises(ConfigError, match="beside a sliding window"):
        Engine(full_attention, EngineConfig(attention_sinks=4))


def test_bench_rows_name_their_kv_dtype():
    from inference_core.bench.speed import parse_config

    assert parse_config("paged+kv-int4")[0].kv_dtype == "int4"
    assert parse_config("contiguous+kv-int8")[0].kv_dtype == "int8" and parse_config("paged")[0].kv_dtype == "auto"
    with pytest.raises(ConfigError, match="unknown bench configuration"):
        parse_config("paged+kv-int4+kv-int8")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_our_read_op_equals_the_torch_read(full_attention, our_ops, dtype):
    """`model.kv_kernel`'s op reads what the torch ops read: quantized blocks dequantized, a block still in the tail
    taken from there, padding block 0 among them."""
    from inference_core.model import kv_kernel

    torch.manual_seed(0)
    config = full_attention.config
    pool = int4.Int4Blocks(config, 12, 4, dtype, "cpu")
    writes = [(block, offset) for block in range(10) for offset in range(4)]
    slots = pool.write_slots(writes)
    for layer in range(config.num_layers):
        shape = (len(writes), config.num_kv_heads, config.head_dim)
        pool.write(layer, torch.randn(shape) * torch.logspace(-1, 1, config.head_dim), torch.randn(shape), slots)
    pool.sweep(lambda block: int4.PARTIAL if block == 9 else int4.FULL)
    assert set(pool.tail_of) == {9}
    table = torch.tensor([3, 0, 7, 9, 0, 5], dtype=torch.int32)
    for layer in range(config.num_layers):
        pool.fused = None
        reference = pool.read(layer, table)
        pool.fused = kv_kernel.read
        ours = pool.read(layer, table)
        for got, want in zip(ours, reference):
            assert got.dtype == dtype and got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-6 if dtype == torch.float32 else 1e-2, atol=1e-6)
        assert torch.equal(ours[0][3], pool.tail_k[layer][pool.tail_of[9]])


def test_an_engine_reads_an_int4_cache_through_our_op_where_it_is_built(full_attention, our_ops):
    engine = Engine(full_attention, EngineConfig(kv_mode="paged", block_size=4, kv_dtype="int4"))
    assert engine.kv_cache.int4.fused is not None
    fused = engine.complete(list(PROMPT), greedy(16)).token_ids
    engine.kv_cache.int4.fused = None
    assert engine.complete(list(PROMPT), greedy(16)).token_ids[:8] == fused[:8]
