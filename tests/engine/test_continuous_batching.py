"""Acceptance test of continuous batching on the bundled SmolLM2-135M (fp32, CPU): eight requests of mixed kinds and
lengths, 96 greedy tokens each, batched under four scheduler configurations, give each request its solo token ids.

Batched forwards are not bitwise equal to solo ones: a matmul over 8 rows, a padded decode-attention gather or a
prefill chunk may add the same products in another order, so logits differ in their last bits. A greedy choice can
flip only where the two best logits are that close, so a difference is allowed at the first position where a request
diverges from its solo run only if the solo run's top-two margin there is below TIE_TOLERANCE; after such a
divergence the texts legitimately differ and the comparison of that request stops. Anything else (a wrong block
table, position, chunk boundary or recompute after preemption) changes logits by far more and fails.

The solo runs are computed once per module, with a plain greedy loop over the runner on a one-slot contiguous cache,
which also records the margins. Measured alone on the 2-core machine (one torch thread): solo runs 64 s, each
configuration 26 to 46 s; beside the suite's other worker about 1.5 times that.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from inference_core import SamplingParams
from inference_core.sequence import Sequence

from conftest import assert_nothing_held, make_engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest: stable run times on a busy CPU

NEW_TOKENS = 96
CONTEXT = 1024
BLOCK_SIZE = 16
# Two chat, two short and one longer code, two grounded (retrieved passage + question) and one long prompt:
# 36 to 277 prompt tokens, so sequences of very different lengths share every decode step.
PROMPT_IDS = ("chat-short-3", "chat-med-1", "code-1", "code-2", "grounded-1", "grounded-2", "long-2", "chat-short-1")
# Logit units. Batched and solo logits of these prompts differed by at most 1.3e-4 (measured over their first 16
# tokens, batch of 8, with and without 64-token chunks; logits are of order 10), so only a choice whose two best logits
# are closer than about 2.6e-4 can flip; 1e-3 leaves room. A real bug moves logits by far more.
TIE_TOLERANCE = 1e-3
CONFIGS = {
    "continuous-big-pool": dict(kv_cache_tokens=4096),
    # The largest request needs 277 + 95 = 372 tokens (24 blocks); all eight together need about 1,600.
    "continuous-preempting": dict(kv_cache_tokens=512),
    "chunked-prefill-64": dict(kv_cache_tokens=4096, max_num_batched_tokens=64, chunked_prefill=True),
    # 512 tokens a step, prompts never split: the first step takes the five prompts that fit whole (383 tokens), the
    # next the other three beside five decodes.
    "no-chunked-prefill": dict(kv_cache_tokens=4096, max_num_batched_tokens=512, chunked_prefill=False),
}


@dataclass(frozen=True)
class SoloRun:
    prompt_ids: list[int]
    token_ids: list[int]
    margins: list[float]  # per generated position: top-1 minus top-2 logit of the solo run


@pytest.fixture(scope="module")
def solo_runs(bundled, bench_prompts) -> dict[str, SoloRun]:
    engine = make_engine(bundled, "contiguous", max_seq_len=CONTEXT, max_num_seqs=1)
    runs = {}
    for prompt_id in PROMPT_IDS:
        row = bench_prompts[prompt_id]
        prompt_ids = engine.prompt_ids(row["prompt"], row.get("system"))
        seq = Sequence(list(prompt_ids))
        engine.kv_cache.allocate(seq)
        margins = []
        try:
            for _ in range(NEW_TOKENS):
                logits = engine.runner.run([seq])[0]  # [vocab] fp32, for the last token
                best = logits.topk(2).values
                margins.append(float(best[0] - best[1]))
                seq.append(int(logits.argmax()))
        finally:
            engine.kv_cache.free(seq)
        runs[prompt_id] = SoloRun(prompt_ids, seq.generated_token_ids, margins)
    return runs


def first_difference(token_ids: list[int], solo: SoloRun) -> int | None:
    """The first position where the batched ids leave the solo ones (None: equal); fails unless it is a near-tie."""
    assert len(token_ids) == NEW_TOKENS
    for position, (got, expected) in enumerate(zip(token_ids, solo.token_ids)):
        if got != expected:
            assert solo.margins[position] < TIE_TOLERANCE, (
                f"token {position} is {got}, solo {expected}, where the solo logits were {solo.margins[position]:.4f} "
                f"apart (tolerance {TIE_TOLERANCE})")
            return position
    return None


@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_batched_requests_match_their_solo_runs(bundled, solo_runs, config_name):
    engine = make_engine(bundled, "paged", max_seq_len=CONTEXT, block_size=BLOCK_SIZE, max_num_seqs=8,
                         **CONFIGS[config_name])
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    requests = {prompt_id: engine.submit(run.prompt_ids, params) for prompt_id, run in solo_runs.items()}
    reports = []
    while engine.has_work():
        reports.append(engine.step())
        assert len(reports) < 20 * NEW_TOKENS, "the engine stopped making progress"
    # All eight run together unless the pool is too small for them (512 tokens: at most five at once).
    assert max(report.batch_size for report in reports) == (5 if config_name == "continuous-preempting" else 8)

    # The configuration did what it is named for.
    chunks = {prompt_id: [tokens for report in reports for request_id, kind, tokens in report.work
                          if request_id == request.request_id and kind == "prefill"]
              for prompt_id, request in requests.items()}
    preemptions = sum(request.preemptions for request in requests.values())
    assert (preemptions > 0) == (config_name == "continuous-preempting")
    if config_name != "continuous-preempting":  # each prompt computed once (in one piece or in chunks) or cached
        cached = {p: request.cached_prompt_tokens for p, request in requests.items()}
        assert {p: sum(c) + cached[p] for p, c in chunks.items()} == {p: len(run.prompt_ids)
                                                                      for p, run in solo_runs.items()}
    if config_name == "chunked-prefill-64":
        assert max(report.num_tokens for report in reports) == 64
        assert len(chunks["long-2"]) > 4  # 277 tokens in chunks of at most 64
    if config_name == "no-chunked-prefill":
        assert all(len(c) == 1 for c in chunks.values())
        # The later three find the chat template's first 16 tokens (one block) in the prefix cache.
        assert [report.num_tokens for report in reports[:2]] == [383, 5 + (149 - 16) + (277 - 16) + (41 - 16)]

    differences = {}
    for prompt_id, request in requests.items():
        finish = request.events[-1]
        assert (finish.stats.finish_reason, finish.stats.preemptions) == ("length", request.preemptions)
        differences[prompt_id] = first_difference(finish.token_ids, solo_runs[prompt_id])
    # Shown with -s: how far this configuration came from bit-equal greedy choices.
    print(f"{config_name}: {len(reports)} steps, {preemptions} preemptions, near-tie divergences at "
          f"{ {p: d for p, d in differences.items() if d is not None} }")
    assert_nothing_held(engine)
