"""The compiled query step (`inference_core.engine.query_graph`): speculative verification through a compiled
forward of several tokens a sequence, against the eager path it replaces.

One compiled engine (a tiny model, paged) compiles its packages once, before any request (`warm_up_compiled` with
the requests' speculative setting): the decode step and the query step of a chain's longest verification, which its
shorter drafts share. Greedy ids through it equal plain greedy decoding's (eager), with prompt lookup accepting and
rejecting drafts, with a sliding window, and for requests verified together, and sampled tokens equal the eager
engine's for the same seeds; every step runs compiled, the prompts in the flat step (the stats' buckets and
fallbacks say which), and no request's time includes a compile.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same_or_near_tie
from tiny_models import build_tiny_model, prompt

from inference_core import Engine, EngineConfig, SamplingParams
from inference_core.engine import compiled as compiled_module
from inference_core.engine.compiled import compile_unavailable
from inference_core.spec.decoding import SpecConfig

pytestmark = pytest.mark.skipif(compile_unavailable(torch.device("cpu")) is not None,
                                reason=f"{compile_unavailable(torch.device('cpu'))}")

SETTINGS = dict(kv_mode="paged", block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
LOOKUP = SpecConfig("ngram", k=4, ngram_min=1)  # 1-token matches: many drafts, many of them rejected


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama-queries"))


@pytest.fixture(scope="module")
def compiled(tiny):
    """A compiled engine with its flat step, its decode step and its 5-token query step (4 drafts) built before any
    request."""
    engine = Engine(tiny, EngineConfig(**SETTINGS, compile=True))
    assert not engine.decoder.ready(1, 5)
    assert engine.warm_up_compiled((1,), LOOKUP) > 0
    assert engine.decoder.ready(1, 5) and not engine.decoder.ready(1, 6)
    return engine


def repeating_prompts() -> list[list[int]]:
    """Prompts whose text repeats, so prompt lookup finds drafts (and the random model rejects many of them)."""
    return [prompt(9, seed) * 3 for seed in range(3)]


def test_compiled_verification_equals_plain_greedy_and_every_step_after_the_prompt_is_compiled(tiny, compiled):
    eager = Engine(tiny, EngineConfig(**SETTINGS))
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    graphs = compiled.compile_stats()["graphs"]
    drafted = accepted = 0
    for ids in repeating_prompts():
        want = eager.complete(ids, params).token_ids
        flat = compiled.compile_stats()["steps_by_bucket"].get("flat", 0)
        finish = compiled.complete(ids, params, spec=LOOKUP)
        assert_same_or_near_tie(tiny, ids, want, finish.token_ids)
        drafted, accepted = drafted + finish.stats.spec["drafted"], accepted + finish.stats.spec["accepted"]
        # The prompt (27 tokens) ran in the flat step, nothing eager; no step compiled anything.
        stats = compiled.compile_stats()
        assert stats["fallbacks"] == {} and stats["steps_by_bucket"]["flat"] == flat + 1
        assert finish.stats.compile["compile_s"] == 0
    assert 0 < accepted < drafted  # drafts both accepted and rejected (rolled back), shorter ones padded to 5
    stats = compiled.compile_stats()
    assert stats["graphs"] == graphs and stats["recompiles"] == 0
    assert stats["steps_by_bucket"]["1x5 query"] > 0  # verifications
    assert compiled.blocks_in_use() == 0


def test_compiled_verification_with_a_sliding_window_equals_plain_greedy(tiny, compiled):
    """A window shorter than the text: the query step's masks cut each query's keys, and blocks wholly out of the
    window go back to the pool mid-request; the packages are the unwindowed engine's (the window is in the masks)."""
    settings = dict(SETTINGS, sliding_window=8)
    eager = Engine(tiny, EngineConfig(**settings))
    windowed = Engine(tiny, EngineConfig(**settings, compile=True))
    windowed.warm_up_compiled((1,), LOOKUP)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    for ids in repeating_prompts()[:2]:
        finish = windowed.complete(ids, params, spec=LOOKUP)
        assert_same_or_near_tie(tiny, ids, eager.complete(ids, params).token_ids, finish.token_ids)
        assert finish.stats.spec["drafted"] > 0
    assert windowed.compile_stats()["steps_by_bucket"]["1x5 query"] > 0
    assert windowed.blocks_in_use() == 0


def test_compiled_sampled_verification_draws_what_eager_draws(tiny, compiled):
    """Sampling: the acceptance rule reads the same probabilities (to rounding), so each seed's tokens are the eager
    engine's."""
    eager = Engine(tiny, EngineConfig(**SETTINGS))
    ids = repeating_prompts()[0]
    for seed in range(3):
        params = SamplingParams(max_new_tokens=32, temperature=0.7, seed=seed, ignore_eos=True)
        want = eager.complete(ids, params, spec=LOOKUP)
        got = compiled.complete(ids, params, spec=LOOKUP)
        assert got.token_ids == want.token_ids
        assert got.stats.spec["accepted"] == want.stats.spec["accepted"]


def test_a_second_engine_finds_the_query_step_on_disk(tiny, compiled):
    compiled_module._LOADED_PACKAGES.clear()  # as in a new process
    engine = Engine(tiny, EngineConfig(**SETTINGS, compile=True))
    engine.warm_up_compiled((1,), LOOKUP)
    stats = engine.compile_stats()
    assert stats["from_disk"] == stats["graphs"] == 3  # the flat step, the decode step and the query step


def test_speculating_requests_verify_together_in_one_compiled_step(tiny, compiled):
    """Two requests at once: each step's chains (and plain tokens) go through the query step of batch bucket 2 (bucket 1
    once one has finished), and each answer is its solo plain greedy one."""
    eager = Engine(tiny, EngineConfig(**SETTINGS))
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    prompts = repeating_prompts()[:2]
    want = [eager.complete(ids, params).token_ids for ids in prompts]
    # Every step drafts (the engine left to choose could take plain steps at batch 2: `spec.pays`).
    engine = Engine(tiny, EngineConfig(**dict(SETTINGS, max_num_seqs=2), compile=True, speculate_when_it_pays=False))
    engine.warm_up_compiled((1, 2), LOOKUP)
    requests = [engine.submit(ids, params, spec=LOOKUP) for ids in prompts]
    while engine.has_work():
        engine.step()
    for ids, expected, request in zip(prompts, want, requests):
        assert_same_or_near_tie(tiny, ids, expected, request.events[-1].token_ids)
        assert request.events[-1].stats.compile["compile_s"] == 0
    stats = engine.compile_stats()
    assert stats["steps_by_bucket"]["2x5 query"] > 0 and stats["fallbacks"] == {}
    assert engine.blocks_in_use() == 0
