"""KV memory savers: the sliding window (against transformers' Mistral) and the int8 KV cache (against its own
float reference), on tiny random models that the tests build.

The window (8 tokens) is much shorter than the prompt (37 tokens) plus the 64 new ones, and with 4-token blocks a
sequence crosses many block boundaries, so a wrong mask or a block released too early shows in the greedy ids.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

import inference_core
from inference_core import Engine, EngineConfig, SamplingParams
from inference_core.kv.block_manager import FREED, BlockManager
from inference_core.config import ConfigError
from inference_core.kv.cache import dequantize_int8, quantize_int8
from inference_core.sequence import Sequence
from tiny_models import TINY, write_word_level_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WINDOW = 8
PROMPT = [(31 * i + 7) % 256 for i in range(37)]
NEW_TOKENS = 64
GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)


def _save_mistral(directory, sliding_window):
    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(**TINY, tie_word_embeddings=False, sliding_window=sliding_window)).eval()
    model.generation_config.eos_token_id = None
    model.save_pretrained(str(directory))
    write_word_level_tokenizer(directory)
    return model


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """A tiny Mistral whose checkpoint has an 8-token window, transformers' greedy ids for PROMPT, and our load."""
    directory = tmp_path_factory.mktemp("mistral-window")
    hf_model = _save_mistral(directory, WINDOW)
    input_ids = torch.tensor([PROMPT])
    with torch.no_grad():
        output = hf_model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=NEW_TOKENS,
                                   do_sample=False, eos_token_id=None, pad_token_id=0)
    return inference_core.load_model(str(directory), device="cpu", dtype="float32"), output[0, len(PROMPT):].tolist()


CONFIGS = {
    "none": dict(kv_mode="none"),
    "contiguous": dict(kv_mode="contiguous"),
    "paged": dict(kv_mode="paged", block_size=4),
    "paged-no-prefix-cache": dict(kv_mode="paged", block_size=4, prefix_cache=False),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_checkpoint_window_greedy_ids_equal_transformers(windowed, name):
    loaded, reference = windowed
    assert loaded.config.sliding_window == WINDOW
    assert Engine(loaded, EngineConfig(**CONFIGS[name])).complete(list(PROMPT), GREEDY).token_ids == reference


def test_window_matters_and_can_be_set_per_engine(windowed, tmp_path):
    """Full attention on the same weights gives other ids (so the test above proves the window), and a checkpoint
    without a window, run with `sliding_window=8`, gives the windowed ids."""
    loaded, reference = windowed
    full = Engine(loaded, EngineConfig(kv_mode="contiguous", sliding_window=10_000)).complete(list(PROMPT), GREEDY)
    assert full.token_ids != reference
    _save_mistral(tmp_path, None)
    plain = inference_core.load_model(str(tmp_path), device="cpu", dtype="float32")
    assert plain.config.sliding_window is None
    engine = Engine(plain, EngineConfig(kv_mode="paged", block_size=4, sliding_window=WINDOW))
    assert engine.complete(list(PROMPT), GREEDY).token_ids == reference


def test_long_generation_with_a_window_holds_constant_blocks(windowed):
    """After the prompt's prefill, a windowed sequence holds at most ceil(8 / 4) + 1 blocks whatever its length, and
    the released blocks stay in the prefix cache: the same prompt again hits them and decodes the same ids."""
    loaded, reference = windowed
    engine = Engine(loaded, EngineConfig(kv_mode="paged", block_size=4))
    held = []
    for event in engine.generate(list(PROMPT), SamplingParams(max_new_tokens=200, ignore_eos=True)):
        if engine.scheduler.running:
            held.append(engine.kv_cache.blocks_in_use())
    assert held[0] == 10  # the first token after a whole-prompt prefill: all 37 tokens' blocks, released after
    assert set(held[1:]) <= {2, 3} and len(held) == 199
    again = engine.complete(list(PROMPT), GREEDY)
    assert again.token_ids == reference and again.stats.cached_prompt_tokens == 36


def test_release_before_frees_whole_blocks_only_and_keeps_the_hash_chain():
    manager = BlockManager(num_blocks=8, block_size=4)
    seq = Sequence(list(range(14)))
    manager.allocate(seq)
    manager.commit(seq, 14)
    assert seq.block_table == [0, 1, 2, 3]
    manager.release_before(seq, 9)  # positions 0-7 (blocks 0 and 1) are wholly before 9; block 2 holds 8-11
    assert seq.block_table == [FREED, FREED, 2, 3]
    assert manager.num_used_blocks == 2 and list(manager.evictable) == [0, 1]
    seq.token_ids.extend([14, 15])
    manager.commit(seq, 16)  # block 3 becomes full: registered under the hash chained through the released blocks
    other = Sequence(list(range(17)))
    assert manager._find_prefix_hits(other) == [0, 1, 2, 3]
    manager.free(seq)
    assert manager.num_used_blocks == 0 and seq.block_table == []


def test_int8_rows_round_trip_within_half_a_step():
    x = torch.randn(5, 3, 16) * torch.tensor([0.01, 1.0, 300.0])[None, :, None]
    packed = quantize_int8(x)
    assert packed.dtype == torch.int8 and packed.shape == (5, 3, 20)
    step = x.abs().amax(-1, keepdim=True) / 127
    assert ((dequantize_int8(packed, torch.float32) - x).abs() <= step / 2 + 1e-7 * step).all()


@pytest.mark.parametrize("kv_mode", ["contiguous", "paged"])
def test_int8_kv_cache_logits_track_the_float_cache(windowed, kv_mode):
    """Prefill then decode the same text with the float and the int8 cache: the logits stay close (random tiny
    weights; the bundled model's perplexity is measured by `quality`), and the bytes per token are head_dim + 4 per
    layer, KV head and tensor."""
    loaded, _ = windowed
    caches = {}
    for kv_dtype in ("auto", "int8"):
        engine = Engine(loaded, EngineConfig(kv_mode=kv_mode, block_size=4, kv_dtype=kv_dtype))
        seq = Sequence(list(PROMPT[:20]))
        engine.kv_cache.allocate(seq)
        logits = [engine.runner.run([seq])[0]]
        for token in PROMPT[20:]:
            seq.token_ids.append(token)
            logits.append(engine.runner.run([seq])[0])
        caches[kv_dtype] = (torch.stack(logits), engine.kv_cache.bytes_per_token)
    (reference, float_bytes), (quantized, int8_bytes) = caches["auto"], caches["int8"]
    assert float_bytes == 2 * 2 * 2 * 16 * 4 and int8_bytes == 2 * 2 * 2 * (16 + 4)
    assert not torch.equal(quantized, reference)
    error = (quantized - reference).abs()
    assert error.max() < 0.1 * reference.std() and error.mean() < 0.01 * reference.std(), (error.max(), error.mean(),
                                                                                       reference.std())


def test_int8_kv_cache_runs_batching_and_speculation(windowed):
    loaded, _ = windowed
    engine = Engine(loaded, EngineConfig(kv_mode="paged", block_size=4, kv_dtype="int8"))
    prompts = [PROMPT[:n] for n in (5, 17, 37)]
    batched = [engine.generate(list(p), SamplingParams(max_new_tokens=24, ignore_eos=True)) for p in prompts]
    finals = [list(events)[-1] for events in batched]
    assert [len(final.token_ids) for final in finals] == [24, 24, 24]
    from inference_core.spec.decoding import SpecConfig

    plain = Engine(loaded, EngineConfig(kv_mode="contiguous", kv_dtype="int8")).complete(list(PROMPT), GREEDY)
    spec = Engine(loaded, EngineConfig(kv_mode="contiguous", kv_dtype="int8")).complete(
        list(PROMPT), GREEDY, spec=SpecConfig(method="ngram", k=3))
    assert len(spec.token_ids) == NEW_TOKENS and spec.token_ids[:8] == plain.token_ids[:8]


def test_unsupported_combinations_say_what_to_change():
    with pytest.raises(ConfigError, match="int8 KV cache needs a KV cache"):
        EngineConfig(kv_mode="none", kv_dtype="int8")
    with pytest.raises(ConfigError, match="eager only"):
        EngineConfig(kv_mode="paged", kv_dtype="int8", compile=True)
    with pytest.raises(ConfigError, match="unknown KV dtype"):
        EngineConfig(kv_dtype="fp8")
    with pytest.raises(ConfigError, match="positive number of tokens"):
        EngineConfig(sliding_window=0)


def test_compiled_decode_keeps_the_window(windowed):
    """The compiled step's key mask hides what lies before the window, and its paged reads skip released blocks; so
    do several greedy steps a round trip (`CompiledDecoder.run_greedy`, which moves each step's mask on by itself)."""
    from inference_core.engine.compiled import compile_unavailable
    from conftest import assert_same_or_near_tie

    if (reason := compile_unavailable(torch.device("cpu"))) is not None:
        pytest.skip(reason)
    loaded, reference = windowed
    engine = Engine(loaded, EngineConfig(kv_mode="paged", block_size=4, max_num_seqs=1, compile=True))
    final = engine.complete(list(PROMPT), GREEDY)
    assert final.stats.compile["graphs"] == 2 and final.stats.compile["fallbacks"] == {}  # the prompt: the flat step
    assert_same_or_near_tie(loaded, list(PROMPT), reference, final.token_ids)
    burst = Engine(loaded, replace(engine.config, decode_steps=5))
    assert burst.complete(list(PROMPT), GREEDY).token_ids == final.token_ids
    assert burst.compile_stats()["compiled_steps"] > 0 and burst.blocks_in_use() == 0


def test_kv_view_shows_released_blocks_and_int8_storage(windowed):
    """Mid-generation, the pool picture marks the blocks that left the window, counts only held blocks as reserved,
    and says how an int8 pool stores its tokens."""
    from ui.kv_view import render_pool

    loaded, _ = windowed
    engine = Engine(loaded, EngineConfig(kv_mode="paged", block_size=4, kv_dtype="int8"))
    events = engine.generate(list(PROMPT), SamplingParams(max_new_tokens=40, ignore_eos=True))
    for _ in range(20):
        next(events)
    snapshot = engine.kv_snapshot()
    (request,) = snapshot["requests"]
    table = request["block_table"]
    # 56 tokens computed (the prompt and 19 decodes) in 14 blocks; the last forward's query was at position 55, so
    # no later query reads before 55 - 8 + 1 = 48: blocks 0-11 (positions 0-47) were given back.
    assert len(table) == 14 and table[:12] == [FREED] * 12 and FREED not in table[12:]
    assert snapshot["sliding_window"] == WINDOW and request["stored_tokens"] == 56 - 48
    page = render_pool(snapshot, lambda ids: " ".join(map(str, ids)), "pool")
    assert page.count("&rarr;&#10005;") == 12
    assert "Sliding window of 8 tokens" in page and "KV stored in int8" in page
    assert "<td>reserved by this paged pool (2 blocks x 4)</td><td>8</td>" in page
    events.close()
    assert engine.blocks_in_use() == 0
