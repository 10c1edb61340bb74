"""n > 1 (the API's `n`): copies of one prompt share its KV blocks in the paged cache. The first copy computes the
prompt; the others wait one step, then take its full blocks from the prefix cache, reference-counted (checked in the
block manager: each shared block has one reference per copy), and compute only the partial last block. Every block
goes back at the end; sampled copies with their own seeds still differ; engines that cannot share run copies
independently."""

from __future__ import annotations

from inference_core import SamplingParams

from conftest import assert_nothing_held, make_engine
from tiny_models import build_tiny_model

BLOCK = 4
PROMPT = list(range(10, 31))  # 21 tokens: 5 full blocks shareable (never the block of the last token)


def test_four_copies_share_the_prompts_blocks_and_return_them(tmp_path):
    loaded = build_tiny_model(tmp_path)
    engine = make_engine(loaded, "paged", block_size=BLOCK, max_num_seqs=8)
    params = [SamplingParams(max_new_tokens=6, temperature=1.0, seed=seed) for seed in range(4)]
    copies = engine.make_copies(PROMPT, params)
    for request in copies:
        engine.enqueue(request)
    first = engine.step()
    assert [request_id for request_id, _, _ in first.work] == [copies[0].request_id]  # the copies wait a step
    engine.step()  # the copies are admitted: their full prompt blocks are the first copy's
    shared = copies[0].seq.block_table[:5]
    blocks = engine.kv_cache.manager.blocks
    assert all(copy.seq.block_table[:5] == shared for copy in copies)
    assert [blocks[b].ref_count for b in shared] == [4] * 5
    assert all(blocks[b].owners == {c.seq.seq_id for c in copies} for b in shared)
    assert len({copy.seq.block_table[5] for copy in copies}) == 4  # the partial last block is each copy's own
    while engine.has_work():
        engine.step()
    finals = [request.events[-1] for request in copies]
    assert [f.stats.cached_prompt_tokens for f in finals] == [0, 20, 20, 20]
    assert len({tuple(f.token_ids) for f in finals}) > 1  # each copy samples with its own seed
    assert_nothing_held(engine)
    assert all(blocks[b].ref_count == 0 for b in shared)


def test_greedy_copies_equal_one_request_and_unshared_engines_run_them_alone(tmp_path):
    loaded = build_tiny_model(tmp_path)
    alone = make_engine(loaded, "paged", block_size=BLOCK).complete(PROMPT, SamplingParams(max_new_tokens=8))
    for engine, shares in ((make_engine(loaded, "paged", block_size=BLOCK), True),
                           (make_engine(loaded, "paged", block_size=BLOCK, prefix_cache=False), False),
                           (make_engine(loaded, "contiguous"), False)):
        assert engine.shares_prompts == shares
        copies = engine.make_copies(PROMPT, [SamplingParams(max_new_tokens=8)] * 3)
        assert all((copy.prompt_source is copies[0]) == shares for copy in copies[1:])
        for request in copies:
            engine.enqueue(request)
        while engine.has_work():
            engine.step()
        assert all(request.events[-1].token_ids == alone.token_ids for request in copies)
        assert_nothing_held(engine)
