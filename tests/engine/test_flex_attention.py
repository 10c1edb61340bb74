"""Paged attention through FlexAttention (`attention="flex"`, `inference_core.kv.flex`) changes how attention reads
the pool, never the answer.

- The block masks: for random block tables, windows and query offsets, the mask_mod sees exactly the keys causal
  attention (within the window) allows, and the block lists cover every key it sees (a block listed as full holds no
  hidden key), without running a kernel.
- A tiny random model (tests/tiny_models.py) in every paged configuration: plain, batched with chunked prefill and
  prefix-cache hits, preempted, speculative (prompt lookup, early exit), windowed: greedy ids with flex equal
  gather's exactly, and a tree verification's logits are close. These run the uncompiled flex_attention (the same
  mask_mod, no compile time), which reads every key through the mask.
- The bundled model, compiled as the engine runs it: three benchmark prompts batched (decodes of different lengths in
  one padded call, a chunk after a prefix-cache hit) and an EAGLE tree verification give transformers' greedy ids.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from inference_core import Engine, EngineConfig, SamplingParams, load_model
from inference_core.config import ConfigError
from inference_core.kv import flex
from inference_core.sequence import Sequence
from inference_core.settings import LaneSettings, words
from inference_core.spec.decoding import SpecConfig

from conftest import assert_nothing_held, bench_prompt_ids, transformers_greedy_ids
from tiny_models import build_tiny_model, greedy, paged, prompt

NEW_TOKENS = 64


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("flex-tiny"))


@pytest.fixture
def uncompiled(monkeypatch):
    """The engine's flex calls run the uncompiled flex_attention (no compile time; block lists are not read)."""
    monkeypatch.setattr(flex, "kernel", lambda: flex_attention)


# --- the block masks ------------------------------------------------------------------------------------------------

def _visibility(call: flex.FlexCall, num_slots: int) -> torch.Tensor:
    """What the call's mask_mod sees: [rows, queries, slots] bool."""
    rows, queries = call.padded_rows, call.padded_queries
    b = torch.arange(rows)[:, None, None]
    q = torch.arange(queries)[None, :, None]
    kv = torch.arange(num_slots)[None, None, :]
    return call.block_mask.mask_mod(b, torch.zeros(()), q, kv).expand(rows, queries, num_slots)


@pytest.mark.parametrize("num_queries,window,group_pages", [(1, None, 1), (1, 7, 1), (37, None, 1), (37, 9, 1),
                                                             (37, None, 4), (1, None, 2)])
def test_block_masks_see_what_causal_attention_sees(num_queries, window, group_pages):
    rng = random.Random(num_queries * 100 + (window or 0) + group_pages)
    page_size, num_pages = 4, 64
    layout = flex.PoolLayout(num_pages, page_size, group_pages, 16, group_pages == 1)
    rows = 3 if num_queries == 1 else 1
    free = rng.sample(range(num_pages), num_pages)
    firsts, tables = [], []
    for _ in range(rows):
        first = rng.randrange(0, 60)
        span = -(-(first + num_queries) // page_size)
        table = [free.pop() for _ in range(span)]
        if window:  # pages wholly before the window went back to the pool
            table = [-1 if (page + 1) * page_size <= first - window + 1 else block for page, block in enumerate(table)]
        firsts.append(first)
        tables.append(table)
    call = flex.build_call(layout, tables, firsts, num_queries, window, torch.device("cpu"))
    slots = layout.total_pages * page_size
    seen = _visibility(call, slots)
    expected = torch.zeros_like(seen)
    for row, (table, first) in enumerate(zip(tables + [tables[0]] * (call.padded_rows - rows),
                                             firsts + [firsts[0]] * (call.padded_rows - rows))):
        for query in range(num_queries):
            position = first + query
            for key in range(position + 1):
                if (window is None or key > position - window) and table[key // page_size] >= 0:
                    expected[row, query, table[key // page_size] * page_size + key % page_size] = True
    assert torch.equal(seen[:, :num_queries], expected[:, :num_queries])
    # Block lists: every seen key lies in a listed block; a full block hides nothing from its query block.
    mask = call.block_mask
    block_keys, block_queries = page_size * group_pages, layout.query_block
    for row in range(call.padded_rows):
        for query_block in range(mask.kv_num_blocks.shape[-1]):
            queries = seen[row, query_block * block_queries:min((query_block + 1) * block_queries, num_queries)]
            partial = mask.kv_indices[row, 0, query_block, :mask.kv_num_blocks[row, 0, query_block]].tolist()
            full = mask.full_kv_indices[row, 0, query_block, :mask.full_kv_num_blocks[row, 0, query_block]].tolist()
            assert not set(partial) & set(full)
            tiles = queries.reshape(queries.shape[0], slots // block_keys, block_keys)  # [queries, blocks, keys]
            needed = set(torch.nonzero(tiles.any(-1).any(0)).flatten().tolist())
            assert needed <= set(partial) | set(full), (row, query_block)
            for block in full:  # (padding queries past num_queries are dropped: their blocks are never listed)
                assert tiles[:, block].all(), (row, query_block, block)
            if num_queries == 1 and layout.uniform:  # the CPU kernel's single-token rows list equal counts
                assert mask.kv_num_blocks.unique().numel() == mask.full_kv_num_blocks.unique().numel() == 1


# --- a tiny model, every paged configuration ------------------------------------------------------------------------

def _run(engine: Engine, prompts: list[list[int]]) -> tuple[list[list[int]], int]:
    """Every prompt's greedy ids, and the preemptions it took."""
    requests = [engine.submit(list(ids), greedy(NEW_TOKENS)) for ids in prompts]
    while engine.has_work():
        engine.step()
    assert_nothing_held(engine)
    return [request.seq.token_ids[request.seq.num_prompt_tokens:] for request in requests], \
        sum(request.preemptions for request in requests)


SHARED = prompt(8, 99)
PROMPTS = [prompt(5, 1), SHARED + prompt(15, 2), prompt(50, 3), SHARED + prompt(1, 4)]
SMALL_POOL = 96  # blocks of 4 tokens: room for the four prompts and their outputs (the uncompiled kernel reads it all)
CONFIGS = {
    "plain": (dict(num_blocks=SMALL_POOL), PROMPTS[2:3]),
    "batched-chunked-prefix-hits": (dict(num_blocks=SMALL_POOL, max_num_batched_tokens=16), PROMPTS),
    "preempted": (dict(num_blocks=40), PROMPTS),
    "windowed": (dict(num_blocks=SMALL_POOL, sliding_window=6), PROMPTS),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_tiny_flex_ids_equal_gather(tiny, uncompiled, name):
    settings, prompts = CONFIGS[name]
    gather, gather_preemptions = _run(paged(tiny, attention="gather", **settings), prompts)
    engine = paged(tiny, attention="flex", **settings)
    assert engine.kv_cache.flex_layout is not None
    ids, preemptions = _run(engine, prompts)
    assert ids == gather
    assert (preemptions > 0) == (gather_preemptions > 0) == (name == "preempted")


@pytest.mark.parametrize("spec,window", [(SpecConfig("ngram", k=4), None), (SpecConfig("early-exit", k=3), 9)],
                         ids=["prompt-lookup", "early-exit-windowed"])
def test_tiny_speculative_flex_equals_gather(tiny, uncompiled, spec, window):
    repetitive = prompt(6, 7) * 4  # prompt lookup finds its matches
    plain = paged(tiny, SMALL_POOL, attention="gather", sliding_window=window).complete(list(repetitive),
                                                                                       greedy(NEW_TOKENS))
    engine = paged(tiny, SMALL_POOL, attention="flex", sliding_window=window)
    fast = engine.complete(list(repetitive), greedy(NEW_TOKENS), spec=spec)
    assert fast.token_ids == plain.token_ids and fast.stats.spec["accepted"] > 0
    assert_nothing_held(engine)


@pytest.mark.parametrize("window", [None, 5])
def test_tiny_tree_verification_logits_match_gather(tiny, uncompiled, window):
    """A tree of 5 nodes (the root, two children, a grandchild under each) over a 21-token context."""
    depths = [0, 1, 1, 2, 2]
    parents = [-1, 0, 0, 1, 2]
    tree_mask = torch.zeros(5, 5, dtype=torch.bool)
    for node in range(5):
        ancestor = node
        while ancestor >= 0:
            tree_mask[node, ancestor] = True
            ancestor = parents[ancestor]
    results = []
    for attention in ("gather", "flex"):
        engine = paged(tiny, SMALL_POOL, attention=attention, sliding_window=window)
        seq = Sequence(prompt(22, 11))
        engine.kv_cache.allocate(seq)
        engine.runner.run([seq], [21])  # the context; the last prompt token is the tree's root
        seq.token_ids.extend([17, 23, 40, 41])
        logits, hidden = engine.runner.run_tree(seq, depths, tree_mask)
        results.append(logits)
        engine.kv_cache.free(seq)
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=1e-4)


def test_flex_needs_the_paged_cache_in_the_model_dtype(tiny):
    """Refusals that name what to change on each surface; gather is the default."""
    refusals = {"needs the paged cache": [dict(kv_mode="contiguous"), dict(kv_mode="none")],
                "an int8 KV cache": [dict(kv_dtype="int8")]}
    for words_said, cases in refusals.items():
        for settings in cases:
            with pytest.raises(ConfigError, match=words_said) as refused:
                EngineConfig(attention="flex", **settings)
            said = refused.value.in_words(words("cli")), refused.value.in_words(words("page"))
            assert "--attention to gather" in said[0] and "'attention (paged)' to gather" in said[1]
    with pytest.raises(ConfigError, match="unknown attention 'paged'; use one of: gather, flex"):
        EngineConfig(attention="paged")
    assert EngineConfig().attention == LaneSettings().engine_config(512).attention == "gather"
    assert LaneSettings(attention="flex").engine_config(512).attention == "flex"
    assert Engine(tiny, EngineConfig(kv_mode="paged")).kv_cache.flex_layout is None


# --- the bundled model, compiled, against transformers --------------------------------------------------------------

BUNDLED_PROMPTS = ("plain-1", "chat-short-3", "code-1")  # 12, 36, 50 tokens; the chat ones share the system block
BUNDLED_TOKENS = 48


@pytest.fixture(scope="module")
def bundled_reference(bundled, bench_prompts):
    prompts = bench_prompt_ids(bundled, bench_prompts, BUNDLED_PROMPTS)
    return prompts, transformers_greedy_ids(prompts, BUNDLED_TOKENS)


def test_bundled_batched_flex_equals_transformers(bundled, bundled_reference):
    prompts, reference = bundled_reference
    engine = Engine(bundled, EngineConfig(kv_mode="paged", attention="flex", max_seq_len=1024))
    engine.complete(prompts[1], SamplingParams(max_new_tokens=1))  # the chat prompts' system block in the cache
    params = SamplingParams(max_new_tokens=BUNDLED_TOKENS, ignore_eos=True)
    requests = [engine.submit(ids, params) for ids in prompts]
    while engine.has_work():
        engine.step()
    assert [request.seq.token_ids[request.seq.num_prompt_tokens:] for request in requests] == reference
    assert [request.cached_prompt_tokens for request in requests] == [0, 32, 16]
    assert_nothing_held(engine)


def test_bundled_tree_verification_flex_equals_transformers(bundled, bundled_reference):
    prompts, reference = bundled_reference
    engine = Engine(bundled, EngineConfig(kv_mode="paged", attention="flex", max_seq_len=1024))
    params = SamplingParams(max_new_tokens=BUNDLED_TOKENS, ignore_eos=True)
    tree = engine.complete(prompts[2], params, spec=SpecConfig("eagle", k=3, tree_width=3))
    assert tree.token_ids == reference[2] and tree.stats.spec["accepted"] > 0
    assert_nothing_held(engine)


# --- CUDA (skipped without a GPU; `gpu-report` runs these with -m cuda) ---------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("block_size", [4, 16])  # 4: four pages make one of Triton's 16-key blocks
@pytest.mark.parametrize("name", ["batched-chunked-prefix-hits", "windowed"])
def test_cuda_flex_ids_equal_gather(tiny, name, block_size):
    cuda = load_model(tiny.name, device="cuda", dtype="float32")
    settings, prompts = CONFIGS[name]
    settings = {**{key: value for key, value in settings.items() if key != "num_blocks"}, "block_size": block_size,
                "kv_cache_tokens": settings["num_blocks"] * 4}
    runs = [_run(Engine(cuda, EngineConfig(kv_mode="paged", attention=attention, **settings)), prompts)
            for attention in ("gather", "flex")]
    assert runs[0] == runs[1]


@needs_cuda
@pytest.mark.cuda
def test_cuda_bf16_flex_logits_match_gather(tiny):
    """bf16: a batch's prefill and then its decodes give logits close to gather's."""
    cuda = load_model(tiny.name, device="cuda", dtype="bfloat16")
    logits = []
    for attention in ("gather", "flex"):
        engine = Engine(cuda, EngineConfig(kv_mode="paged", block_size=16, attention=attention))
        seqs = [Sequence(list(ids)) for ids in PROMPTS]
        for seq in seqs:
            engine.kv_cache.allocate(seq)
        steps = [engine.runner.run(seqs)]
        for seq, row in zip(seqs, steps[0]):
            seq.append(int(row.argmax()))
        steps.append(engine.runner.run(seqs))  # four decodes of different lengths in one call
        logits.append(torch.cat(steps).float().cpu())
        for seq in seqs:
            engine.kv_cache.free(seq)
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=0.05)
