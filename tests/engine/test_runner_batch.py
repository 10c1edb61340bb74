"""The runner takes a batch of sequences, each with its own positions and block table or cache slot; batch 1 is just
a batch of one. Greedy decoding of three sequences of different lengths in one batch must give the same tokens as
running each alone (the roadmap's continuous batching stands on this)."""

from __future__ import annotations

import pytest
import torch

from inference_core import SamplingParams
from inference_core.sequence import Sequence

from conftest import make_engine

STEPS = 24
RECOMPUTE_STEPS = 12  # mode none keeps no KV that could be misplaced, and each of its steps is a whole prefill


def _decode_batch(engine, prompts: list[list[int]], steps: int) -> list[list[int]]:
    seqs = [Sequence(list(p)) for p in prompts]
    for seq in seqs:
        engine.kv_cache.allocate(seq)
    try:
        for _ in range(steps):
            logits = engine.runner.run(seqs)  # [len(seqs), vocab]: one row per sequence
            assert logits.shape == (len(seqs), engine.loaded.config.vocab_size)
            for seq, row in zip(seqs, logits):
                seq.append(int(row.argmax()))
        return [seq.generated_token_ids for seq in seqs]
    finally:
        for seq in seqs:
            engine.kv_cache.free(seq)


@pytest.mark.parametrize("kv_mode", ["paged", "contiguous", "none"])
def test_batch_equals_one_at_a_time(bundled, kv_mode):
    engine = make_engine(bundled, kv_mode, block_size=8)  # contiguous: one slot per sequence (max_num_seqs)
    prompts = [engine.prompt_ids(text) for text in ("Why is the sky blue?", "Write a haiku about autumn rain.",
                                                     "Name three prime numbers and explain why each is prime.")]
    assert len({len(p) for p in prompts}) == 3  # different lengths, so positions and tables differ per sequence
    steps = RECOMPUTE_STEPS if kv_mode == "none" else STEPS
    alone = [engine.complete(p, SamplingParams(max_new_tokens=steps, ignore_eos=True)).token_ids for p in prompts]
    assert _decode_batch(engine, prompts, steps) == alone
    assert engine.blocks_in_use() == 0


def test_prefix_hit_inside_a_batch(bundled):
    """Two sequences sharing a cached prefix attend through the same physical blocks in one forward."""
    engine = make_engine(bundled, "paged", block_size=8)
    prompt = engine.prompt_ids("Why is the sky blue?")
    engine.complete(prompt, SamplingParams(max_new_tokens=2))  # leaves the prompt's full blocks in the cache
    first, second = Sequence(list(prompt)), Sequence(list(prompt))
    engine.kv_cache.allocate(first)
    engine.kv_cache.allocate(second)
    shared = (len(prompt) - 1) // 8
    assert first.block_table[:shared] == second.block_table[:shared]
    assert first.num_cached_tokens == second.num_cached_tokens == shared * 8
    logits = engine.runner.run([first, second])
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=1e-5)
    engine.kv_cache.free(first)
    engine.kv_cache.free(second)
    assert engine.blocks_in_use() == 0


def test_kv_memory_a_batched_decode_may_read_is_finite(bundled):
    """Batched decodes gather every sequence's blocks (or slot) up to the longest context and mask the rest; a masked
    position holding NaN would still poison the attention sum (0 x NaN). So the paged pool starts zeroed, and a
    contiguous slot is zeroed on its first use, however dirty the memory it was given."""
    paged = make_engine(bundled, "paged", max_seq_len=64)
    assert torch.isfinite(paged.kv_cache.k).all() and torch.isfinite(paged.kv_cache.v).all()
    contiguous = make_engine(bundled, "contiguous", max_seq_len=64, max_num_seqs=2)
    contiguous.kv_cache.k.fill_(float("nan"))  # memory as torch.empty may hand it over
    contiguous.kv_cache.v.fill_(float("nan"))
    seq = Sequence([1, 2, 3])
    contiguous.kv_cache.allocate(seq)
    slot = seq.cache_slot
    assert torch.isfinite(contiguous.kv_cache.k[:, slot]).all() and torch.isfinite(contiguous.kv_cache.v[:, slot]).all()
    contiguous.kv_cache.free(seq)



@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama-chunks"))


@pytest.mark.parametrize("window", [None, 6], ids=["full", "window-6"])
@pytest.mark.parametrize("kv_mode", ["paged", "contiguous", "none"])
def test_prefill_chunks_in_one_call_equal_one_at_a_time(tiny, kv_mode, window, monkeypatch):
    """One forward with a lone decode, a prompt after a prefix-cache hit (paged), a fresh prompt and a middle chunk
    of a longer one: attended in one padded call (`runner.ChunkBatch`), the logits and the KV written equal those of
    the same forward attending each sequence alone (CHUNK_PADDING 0; the padded call is taken here whatever its
    padding, 10 times the scores the chunks need)."""
    from inference_core.engine import runner as runner_module

    def forward(padding: float):
        monkeypatch.setattr(runner_module, "CHUNK_PADDING", padding)
        engine = make_engine(tiny, kv_mode, block_size=4, max_num_seqs=4, sliding_window=window)
        shared = list(range(3, 15))
        engine.complete(shared + [20], SamplingParams(max_new_tokens=1))  # its full blocks stay cached (paged)
        seqs = [Sequence(list(ids)) for ids in (list(range(40, 49)), shared + [21, 22, 23], list(range(60, 71)),
                                                 list(range(80, 102)))]
        for seq in seqs:
            engine.kv_cache.allocate(seq)
        engine.runner.run([seqs[0], seqs[3]], [8, 8])  # the first almost whole; the last's first chunk
        cached = seqs[1].num_computed_tokens
        news = [1, len(seqs[1]) - cached, len(seqs[2]), 8]
        batch = engine.runner.prepare(seqs, news)
        logits = engine.runner.run(seqs, news)
        written = [engine.kv_cache.k.clone()] if kv_mode != "none" else []
        return logits, written, batch, cached

    batched, batched_kv, together, cached = forward(10.0)
    alone, alone_kv, apart, _ = forward(0.0)
    chunks = together.chunks
    assert apart.chunks is None and chunks is not None and chunks.count == 4
    # Attending alone, a chunk after cached tokens (mode none recomputes from 0) or cut by the window needs a mask of
    # its own; attending together, none is built.
    assert any(mask is not None for mask in apart.attention_masks) == (kv_mode != "none" or window is not None)
    assert together.attention_masks == [None] * 4
    assert cached == (12 if kv_mode == "paged" else 0)  # the prefix hit: that chunk starts at position 12
    torch.testing.assert_close(batched, alone, rtol=1e-5, atol=1e-5)
    for ours, theirs in zip(batched_kv, alone_kv):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
