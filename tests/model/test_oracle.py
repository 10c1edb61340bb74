"""Greedy token ids from our engine equal Hugging Face transformers `generate` on the same weights (the bundled
SmolLM2-135M, fp32, CPU), 128 new tokens for each of five prompts from 12 to 277 tokens, in every KV mode (the
recompute mode over the first 12), paged with the prefix cache on and off. Long outputs give any wrong KV placement
time to show."""

from __future__ import annotations

import pytest

from inference_core import SamplingParams

from conftest import bench_prompt_ids, make_engine, transformers_greedy_ids

PROMPT_IDS = ("plain-1", "chat-short-3", "code-2", "grounded-1", "long-2")  # 12, 36, 106, 145, 277 tokens
NEW_TOKENS = 128
# Mode none keeps no KV, so no placement can go wrong over a long output; its steps recompute the whole text (each
# costs a prefill), so it is checked over fewer tokens.
RECOMPUTE_TOKENS = 12


@pytest.fixture(scope="module")
def prompts(bundled, bench_prompts) -> list[list[int]]:
    return bench_prompt_ids(bundled, bench_prompts, PROMPT_IDS)


@pytest.fixture(scope="module")
def reference(prompts) -> list[list[int]]:
    """transformers greedy ids, end-of-sequence ignored so every prompt yields the full 128 tokens."""
    return transformers_greedy_ids(prompts, NEW_TOKENS)


def test_prompts_span_many_blocks(prompts):
    assert [len(p) for p in prompts] == [12, 36, 106, 145, 277]  # the longest fills 17 blocks of 16


# Paged without the prefix cache is the same placement with fewer hits; the batching tests compare it id for id.
@pytest.mark.parametrize("kv_mode,prefix_cache", [("contiguous", False), ("paged", True), ("none", False)])
def test_greedy_ids_equal_transformers(bundled, prompts, reference, kv_mode, prefix_cache):
    # One engine for all prompts, as in serving: with the prefix cache on, chat prompts reuse the shared system block.
    engine = make_engine(bundled, kv_mode, prefix_cache=prefix_cache)
    new_tokens = RECOMPUTE_TOKENS if kv_mode == "none" else NEW_TOKENS
    cached = []
    for ids, expected in zip(prompts, reference):
        event = engine.complete(ids, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
        assert event.token_ids == expected[:new_tokens]
        cached.append(event.stats.cached_prompt_tokens)
    assert cached == ([0, 0, 16, 16, 16] if prefix_cache else [0] * 5)
    assert engine.blocks_in_use() == 0


def test_fully_cached_long_prompt_equals_transformers(bundled, prompts, reference):
    """The second run of the long prompt takes 272 of its 277 tokens from the cache and still matches."""
    engine = make_engine(bundled, "paged")
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    first = engine.complete(prompts[-1], params)
    second = engine.complete(prompts[-1], params)
    assert (first.stats.cached_prompt_tokens, second.stats.cached_prompt_tokens) == (0, 272)
    assert first.token_ids == second.token_ids == reference[-1]
