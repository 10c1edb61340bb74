"""The scheduler on a tiny random model, vLLM-style: every request of a batch, however it was scheduled (preempted and
recomputed, chunked, cancelled beside, in any batching mode or KV mode), gives the same token ids as its solo run.

The model is a 2-layer Llama with a 256-token vocabulary (built here with transformers, loaded by our loader), so a
step takes about a millisecond and hundreds of requests are cheap. Paged KV uses 4-token blocks and small pools, so
sequences span many blocks and run out of them. "Solo" is the same request alone on a fresh engine with a big pool;
ids must be equal, not close: a wrong block table, position or preemption shows up as a different token.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest

from inference_core import ConfigError, Engine, EngineConfig, SamplingParams
from inference_core.engine.request import FinishEvent, TokenEvent

from tiny_models import assert_pool_free, assert_solo_ids, BLOCK_SIZE, build_tiny_model, final, greedy, paged, prompt, run_to_end, solo

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest: stable run times on a busy CPU


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


def first_steps(reports) -> dict[int, int]:
    """Request id -> index (into reports) of its first scheduled step."""
    first: dict[int, int] = {}
    for index, report in enumerate(reports):
        for request_id, _, _ in report.work:
            first.setdefault(request_id, index)
    return first


def finish_steps(reports) -> dict[int, int]:
    return {request_id: index for index, report in enumerate(reports) for request_id in report.finished}


# --- preemption -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("prefix_cache", [True, False])
def test_tiny_pool_forces_preemption_and_every_request_still_matches_solo(tiny, prefix_cache):
    # 6 requests of 9..29 prompt tokens + 40 new need about 90 blocks together; the pool has 24 (96 tokens), enough
    # for the largest alone (29 + 40 - 1 = 68 tokens).
    engine = paged(tiny, 24, prefix_cache=prefix_cache)
    requests = [engine.submit(prompt(9 + 4 * i, seed=i), greedy(40)) for i in range(6)]
    reports = run_to_end(engine)
    preempted = [request_id for report in reports for request_id in report.preempted]
    assert len(preempted) > 0
    assert len(preempted) == sum(request.preemptions for request in requests)
    for request in requests:
        stats = final(request).stats
        assert (stats.finish_reason, stats.generated_tokens) == ("length", 40)
        assert stats.preemptions == request.preemptions == preempted.count(request.request_id)
    assert_solo_ids(tiny, requests)
    assert max(report.blocks_in_use for report in reports) <= 24
    assert_pool_free(engine)


def test_two_decodes_crossing_a_block_boundary_with_one_block_free(tiny):
    """Regression: the scheduler checked each decode against the free blocks without taking them, so both decodes
    were scheduled for the one free block and the second forward raised in the block manager."""
    engine = paged(tiny, 5)  # 20 tokens: each request (8 + 12 - 1 = 19 tokens) fits alone
    first, second = (engine.submit(prompt(8, seed=5 + i), greedy(12)) for i in range(2))
    reports = [engine.step()]  # both prompts: 2 blocks each, 1 block left; each now has 9 tokens
    assert (reports[0].blocks_in_use, reports[0].batch_size) == (4, 2)
    reports.append(engine.step())  # both need a 3rd block for token 9: the later admitted one gives way
    assert reports[1].preempted == (second.request_id,)
    assert reports[1].work == ((first.request_id, "decode", 1),)
    reports += run_to_end(engine)
    assert_solo_ids(tiny, [first, second])
    assert_pool_free(engine)


def test_waiting_requests_start_in_priority_order_then_arrival(tiny):
    engine = paged(tiny, max_num_seqs=1)
    running = engine.submit(prompt(6, seed=10), greedy(8))
    reports = [engine.step()]
    priorities = {"b": 5, "c": 1, "d": 5, "e": 0, "f": 1}  # submitted in this order while `running` runs
    waiting = {name: engine.submit(prompt(6, seed=11 + i), greedy(4), priority=priority)
               for i, (name, priority) in enumerate(priorities.items())}
    reports += run_to_end(engine)
    assert max(report.batch_size for report in reports) == 1
    first = first_steps(reports)
    order = sorted(waiting, key=lambda name: first[waiting[name].request_id])
    assert order == ["e", "c", "f", "b", "d"]  # lower priority number first; ties by arrival
    # A waiting request of higher priority does not preempt a running one: `running` finished first.
    assert finish_steps(reports)[running.request_id] < first[waiting["e"].request_id]
    assert_solo_ids(tiny, [running, *waiting.values()])
    assert_pool_free(engine)


def first_preemption(reports) -> tuple[int, ...]:
    return next(report.preempted for report in reports if report.preempted)


def test_preemption_victim_is_the_lowest_priority_running_request(tiny):
    # 12 blocks (48 tokens): each request (8 to 10 prompt + 36 new - 1 <= 45 tokens) fits alone, three do not.
    engine = paged(tiny, 12)
    low = engine.submit(prompt(8, seed=20), greedy(36), priority=2)
    reports = [engine.step()]  # `low` is admitted first, so it is not the most recently admitted one
    high = engine.submit(prompt(9, seed=21), greedy(36), priority=0)
    middle = engine.submit(prompt(10, seed=22), greedy(36), priority=1)
    reports += run_to_end(engine)
    assert first_preemption(reports) == (low.request_id,)
    assert high.preemptions == 0  # the top priority is never the victim while others run
    assert_solo_ids(tiny, [low, high, middle])
    assert_pool_free(engine)


def test_preemption_victim_among_equal_priorities_is_the_latest_admitted(tiny):
    engine = paged(tiny, 12)
    requests, reports = [], []
    for i in range(3):  # admitted one per step, in this order
        requests.append(engine.submit(prompt(8 + i, seed=30 + i), greedy(36)))
        reports.append(engine.step())
    reports += run_to_end(engine)
    assert first_preemption(reports) == (requests[2].request_id,)
    assert requests[0].preemptions == 0
    assert_solo_ids(tiny, requests)
    assert_pool_free(engine)


# --- ending requests in the middle of a batch ---------------------------------------------------------------------

def test_cancel_mid_batch_frees_exactly_the_cancelled_requests_blocks(tiny):
    engine = paged(tiny, prefix_cache=False)
    requests = [engine.submit(prompt(7 + 3 * i, seed=40 + i), greedy(30)) for i in range(4)]
    for _ in range(10):
        engine.step()
    victim = requests[1]
    held, in_use = len(victim.seq.block_table), engine.blocks_in_use()
    assert held == -(-(len(victim.seq) - 1) // BLOCK_SIZE) == 5  # 10 prompt + 9 fed back of 10 generated tokens
    engine.cancel(victim)
    assert engine.blocks_in_use() == in_use - held
    assert (engine.num_requests(), victim.state) == (3, "finished")
    others = [r for r in requests if r is not victim]
    run_to_end(engine)
    assert not any(isinstance(event, FinishEvent) for event in victim.events)
    assert [e.token_id for e in victim.events] == solo(tiny, prompt(10, seed=41), greedy(30))[:10]
    assert_solo_ids(tiny, others)
    assert_pool_free(engine)


def test_cancel_keeps_prefix_blocks_another_request_shares(tiny):
    engine = paged(tiny, prefix_cache=True)
    system = prompt(16, seed=50)  # 4 full blocks, shared by both requests
    writer = engine.submit(system + prompt(5, seed=51), greedy(30))
    engine.step()  # the writer's prefill registers its full blocks in the prefix cache
    reader = engine.submit(system + prompt(6, seed=52), greedy(30))
    for _ in range(5):
        engine.step()
    assert reader.seq.num_cached_tokens == 16
    assert writer.seq.block_table[:4] == reader.seq.block_table[:4]
    held, in_use = len(writer.seq.block_table), engine.blocks_in_use()
    engine.cancel(writer)
    assert engine.blocks_in_use() == in_use - (held - 4)  # the 4 shared blocks stay with the reader
    run_to_end(engine)
    assert_solo_ids(tiny, [reader])
    assert_pool_free(engine)


def test_stop_mid_batch_ends_with_the_tokens_so_far(tiny):
    engine = paged(tiny)
    requests = [engine.submit(prompt(6 + i, seed=60 + i), greedy(24)) for i in range(3)]
    for _ in range(6):
        engine.step()
    stopped = requests[1]
    so_far = list(stopped.seq.generated_token_ids)
    assert len(so_far) == 6
    engine.stop(stopped)
    report = engine.step()
    assert stopped.request_id in report.finished
    assert stopped.request_id not in [request_id for request_id, _, _ in report.work]
    run_to_end(engine)
    finish = final(stopped)
    assert (finish.stats.finish_reason, finish.token_ids) == ("stopped", so_far)
    assert so_far == solo(tiny, prompt(7, seed=61), greedy(24))[:6]
    assert_solo_ids(tiny, [requests[0], requests[2]])
    assert_pool_free(engine)


def test_request_that_can_never_fit_the_pool_is_refused_at_submit(tiny):
    engine = paged(tiny, 8)  # 32 tokens
    running = engine.submit(prompt(6, seed=70), greedy(10))
    engine.step()
    in_use = engine.blocks_in_use()
    long_prompt = prompt(20, seed=71)
    with pytest.raises(ConfigError, match=r"KV pool holds 32 tokens but this request needs up to 33 \(20 prompt"):
        engine.submit(long_prompt, greedy(14))
    assert (engine.num_requests(), engine.blocks_in_use()) == (1, in_use)  # nothing queued, nothing placed
    exactly_full = engine.submit(long_prompt, greedy(13))  # 20 + 13 - 1 = 32: the whole pool, once alone
    run_to_end(engine)
    assert_solo_ids(tiny, [running, exactly_full])
    assert_pool_free(engine)


# --- chunked prefill --------------------------------------------------------------------------------------------------

def prefill_chunks(reports, request) -> list[int]:
    return [tokens for report in reports for request_id, kind, tokens in report.work
            if request_id == request.request_id and kind == "prefill"]


def test_chunked_prefill_splits_a_long_prompt_within_the_token_budget(tiny):
    engine = paged(tiny, max_num_batched_tokens=8, chunked_prefill=True)
    decoding = engine.submit(prompt(5, seed=80), greedy(30))
    reports = [engine.step()]
    long = engine.submit(prompt(30, seed=81), greedy(8))
    reports += run_to_end(engine)
    # Each step: the running decode's token first, then 7 of the prompt, until the last 2 of 30.
    assert prefill_chunks(reports, long) == [7, 7, 7, 7, 2]
    chunk_steps = [r for r in reports if any(request_id == long.request_id and kind == "prefill"
                                             for request_id, kind, _ in r.work)]
    assert all((decoding.request_id, "decode", 1) in r.work for r in chunk_steps)
    assert max(report.num_tokens for report in reports) == 8
    assert_solo_ids(tiny, [decoding, long])
    assert_pool_free(engine)


def test_without_chunked_prefill_a_long_prompt_is_never_split(tiny):
    engine = paged(tiny, max_num_batched_tokens=8, chunked_prefill=False)
    decoding = engine.submit(prompt(5, seed=80), greedy(30))
    reports = [engine.step()]
    long = engine.submit(prompt(30, seed=81), greedy(8))
    reports += run_to_end(engine)
    assert prefill_chunks(reports, long) == [30]
    # Over the budget, it waits for a step of its own.
    (whole,) = [r for r in reports if (long.request_id, "prefill", 30) in r.work]
    assert whole.work == ((long.request_id, "prefill", 30),)
    assert all(report.num_tokens <= 8 for report in reports if report is not whole)
    assert_solo_ids(tiny, [decoding, long])
    assert_pool_free(engine)


# --- batching modes and KV modes -------------------------------------------------------------------------------------

MODE_NEW_TOKENS = [4, 12, 7, 9, 3, 10, 5]  # per request: members of a batch end at different steps


def submit_mode_requests(engine) -> list:
    return [engine.submit(prompt(5 + 2 * i, seed=90 + i), greedy(n)) for i, n in enumerate(MODE_NEW_TOKENS)]


def test_batching_none_runs_one_request_at_a_time_in_order(tiny):
    engine = paged(tiny, batching="none", max_num_seqs=3)
    requests = submit_mode_requests(engine)
    reports = run_to_end(engine)
    assert max(report.batch_size for report in reports) == 1
    first, finish = first_steps(reports), finish_steps(reports)
    for before, after in itertools.pairwise(requests):
        assert first[after.request_id] == finish[before.request_id] + 1
    assert_solo_ids(tiny, requests)
    assert_pool_free(engine)


def test_batching_static_runs_full_batches_each_after_the_previous_finished(tiny):
    engine = paged(tiny, batching="static", max_num_seqs=3)
    requests = submit_mode_requests(engine)
    reports, drained_at = [], []
    while engine.has_work():
        if engine.seconds_until_ready() == math.inf:
            drained_at.append([r.request_id for r in engine.scheduler.waiting])
            engine.drain()
        reports.append(engine.step())
    ids = [r.request_id for r in requests]
    batches = [ids[0:3], ids[3:6], ids[6:]]
    # Only the last, partial batch needed drain(); the others started because they were full.
    assert drained_at == [batches[2]]
    first, finish = first_steps(reports), finish_steps(reports)
    for batch, following in itertools.pairwise(batches):
        assert {first[i] for i in batch} == {first[batch[0]]}  # a batch starts together
        assert {first[i] for i in following} == {max(finish[i] for i in batch) + 1}  # once all of it finished
        assert all({i for i, _, _ in r.work} <= set(batch) for r in reports[first[batch[0]]:first[following[0]]])
    assert [r.batch_size for r in reports[:5]] == [3, 3, 3, 3, 2]  # the 4-token member left after step 4
    assert_solo_ids(tiny, requests)
    assert_pool_free(engine)


def test_static_batch_keeps_finished_members_rows_as_padding_until_the_longest_ends(tiny):
    """A padded static batch: a member that finishes still has its row computed (a padding token) and keeps its KV
    until the whole batch has finished; then every row's blocks go back."""
    engine = paged(tiny, batching="static", max_num_seqs=3)
    requests = [engine.submit(prompt(5 + 2 * i, seed=90 + i), greedy(n)) for i, n in enumerate([4, 12, 7])]
    reports = run_to_end(engine)
    assert len(reports) == 12  # the longest member's 12 tokens
    # Steps 1-4: three live rows; 5-7: two live + the 4-token member's padding row; 8-12: one live + two padding.
    assert [(r.batch_size, r.padding_rows) for r in reports] == [(3, 0)] * 4 + [(2, 1)] * 3 + [(1, 2)] * 5
    live_blocks = -(-(len(requests[1].seq.token_ids) - 1) // BLOCK_SIZE)  # the last live member's own blocks
    assert reports[-2].blocks_in_use > live_blocks  # the padding rows still hold theirs
    assert_solo_ids(tiny, requests)
    assert_pool_free(engine)


@pytest.mark.parametrize("kv_mode", ["paged", "contiguous"])
def test_static_batch_pads_every_prompt_to_the_longest(tiny, kv_mode):
    """A padded static batch computes each prompt as long as the batch's longest (padding after it, with the prompt's
    last chunk, even when the token budget splits the prompts over several steps); nobody's ids change."""
    lengths = [5, 19, 9]
    if kv_mode == "paged":
        engine = paged(tiny, batching="static", max_num_seqs=3, max_num_batched_tokens=16)
    else:
        engine = Engine(tiny, EngineConfig(kv_mode="contiguous", batching="static", max_num_seqs=3,
                                           max_num_batched_tokens=16))
    requests = [engine.submit(prompt(n, seed=110 + n), greedy(6)) for n in lengths]
    reports = run_to_end(engine)
    # All three joined the batch in its first step, though the budget (16) holds only the first prompt and a chunk.
    assert {r.request_id for r in requests} <= {i for r in reports[:3] for i, _, _ in r.work}
    assert sum(r.prompt_padding_tokens for r in reports) == sum(max(lengths) - n for n in lengths)
    assert [request.prompt_padding for request in requests] == [0, 0, 0]
    assert_solo_ids(tiny, requests)
    assert_pool_free(engine)


def test_only_static_batches_pad_prompts(tiny):
    engine = paged(tiny, batching="dynamic", max_num_seqs=3, batch_window_ms=0.0)
    for n in [5, 19, 9]:
        engine.submit(prompt(n, seed=120 + n), greedy(3))
    assert sum(r.prompt_padding_tokens for r in run_to_end(engine)) == 0


def test_batching_dynamic_waits_the_window_then_runs_the_batch_to_completion(tiny):
    window_ms = 40.0
    engine = paged(tiny, batching="dynamic", max_num_seqs=3, batch_window_ms=window_ms)
    early = [engine.submit(prompt(5 + i, seed=100 + i), greedy(10)) for i in range(2)]
    reports = [engine.step()]  # fewer than max_num_seqs wait: the step sleeps out the window, then starts both
    assert {request_id for request_id, _, _ in reports[0].work} == {r.request_id for r in early}
    assert early[0].first_scheduled_at - early[0].submitted_at >= window_ms / 1e3
    late = engine.submit(prompt(7, seed=102), greedy(5))  # arrives while the batch runs: waits for all of it
    reports += run_to_end(engine)
    first, finish = first_steps(reports), finish_steps(reports)
    assert first[late.request_id] == max(finish[r.request_id] for r in early) + 1
    # A full batch does not wait for the window (10 s here: had it waited, the queue time would show it).
    engine = paged(tiny, batching="dynamic", max_num_seqs=3, batch_window_ms=10_000.0)
    full = [engine.submit(prompt(5 + i, seed=103 + i), greedy(3)) for i in range(3)]
    assert engine.step().batch_size == 3
    run_to_end(engine)
    assert all(final(r).stats.queue_ms < 5_000 for r in full)
    assert_solo_ids(tiny, early + [late] + full)
    assert_pool_free(engine)


def test_batching_continuous_admits_a_request_while_others_run(tiny):
    engine = paged(tiny, batching="continuous", max_num_seqs=3)
    requests = submit_mode_requests(engine)
    reports = run_to_end(engine)
    first, finish = first_steps(reports), finish_steps(reports)
    assert [first[r.request_id] for r in requests[:3]] == [0, 0, 0]
    # The 4th request takes the row the 4-token request leaves, in the very next step, beside the other two.
    assert first[requests[3].request_id] == finish[requests[0].request_id] + 1 == 4
    joined = reports[4].work
    assert (requests[3].request_id, "prefill", 11) in joined and len(joined) == 3
    assert_solo_ids(tiny, requests)
    assert_pool_free(engine)


def test_continuous_with_join_every_lets_waiting_requests_in_at_most_every_n_steps(tiny):
    """`join_every` 5: a request that waits while a batch runs joins once 5 steps have run since requests last
    joined (the 4th here waits one step more than the row the first one leaves: step 5, not 4); one that finds
    nothing running starts at once; every request's ids still equal its run alone."""
    engine = paged(tiny, batching="continuous", max_num_seqs=3, join_every=5)
    requests = submit_mode_requests(engine)
    reports = run_to_end(engine)
    first, finish = first_steps(reports), finish_steps(reports)
    assert [first[r.request_id] for r in requests[:3]] == [0, 0, 0]
    assert finish[requests[0].request_id] + 1 == 4 and first[requests[3].request_id] == 5
    joins = sorted({first[r.request_id] for r in requests[3:]})

    def into_a_running_batch(step: int) -> bool:
        return any(first[r.request_id] < step <= finish[r.request_id] for r in requests)

    # Into a running batch at steps 5 apart; a request that finds nothing running starts at once.
    assert joins == [5, 10, 14] and [into_a_running_batch(step) for step in joins] == [True, True, False]
    assert_solo_ids(tiny, requests)
    assert_pool_free(engine)
    with pytest.raises(ConfigError, match="join_every must be a positive whole number"):
        EngineConfig(join_every=0)


@pytest.mark.parametrize("kv_mode", ["contiguous", "none"])
def test_other_kv_modes_batch_and_match_solo(tiny, kv_mode):
    engine = Engine(tiny, EngineConfig(kv_mode=kv_mode, max_num_seqs=3, max_seq_len=128))
    requests = submit_mode_requests(engine)
    reports = run_to_end(engine)
    assert max(report.batch_size for report in reports) == 3
    if kv_mode == "contiguous":  # one slot per running sequence
        assert max(report.blocks_in_use for report in reports) == 3
    assert_solo_ids(tiny, requests)
    assert_pool_free(engine)


def test_seeded_sampled_requests_give_the_same_ids_batched_as_alone(tiny):
    engine = paged(tiny)
    # The first two share their settings (one batched distribution, two generators); the third has its own.
    params = [SamplingParams(max_new_tokens=48, temperature=0.9, top_k=40, top_p=0.95, seed=1, ignore_eos=True),
              SamplingParams(max_new_tokens=48, temperature=0.9, top_k=40, top_p=0.95, seed=2, ignore_eos=True),
              SamplingParams(max_new_tokens=48, temperature=1.3, seed=3, ignore_eos=True), greedy(48)]
    requests = [engine.submit(prompt(6 + i, seed=110), p) for i, p in enumerate(params)]
    run_to_end(engine)
    assert_solo_ids(tiny, requests)
    ids = [final(r).token_ids for r in requests]
    assert ids[0] != solo(tiny, prompt(6, seed=110), greedy(48))  # really sampled
    assert_pool_free(engine)


# --- everything at once -----------------------------------------------------------------------------------------------

def random_params(rng: random.Random) -> SamplingParams:
    max_new_tokens, ignore_eos = rng.randint(1, 40), rng.random() < 0.5
    if rng.random() < 0.4:
        return SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=ignore_eos)
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=rng.choice([0.5, 1.0, 1.5]),
                          top_k=rng.choice([0, 20]), top_p=rng.choice([1.0, 0.9]), seed=rng.randrange(10**6),
                          ignore_eos=ignore_eos)


def test_randomized_traffic_never_loses_or_leaks_a_request(tiny):
    rng = random.Random(2024)
    engine = paged(tiny, 40, max_num_seqs=8, max_num_batched_tokens=32)  # 160 tokens: preemption is common
    prefixes = [prompt(8, seed=120 + i) for i in range(3)]  # shared system prompts: prefix-cache hits
    pending = [(rng.choice(prefixes + [[]]) + prompt(rng.randint(1, 32), seed=1000 + i), random_params(rng),
                rng.randint(0, 3), rng.choice([None, "a", "b"])) for i in range(200)]
    requests, cancelled, stopped, reports = [], {}, {}, []
    while pending or engine.has_work():
        for _ in range(min(rng.randint(0, 3), len(pending))):
            prompt_ids, params, priority, salt = pending.pop(0)
            requests.append(engine.submit(prompt_ids, params, priority=priority, cache_salt=salt))
        live = [r for r in requests if not r.finished and r.request_id not in stopped]
        if live and rng.random() < 0.05:
            victim = rng.choice(live)
            cancelled[victim.request_id] = len(victim.seq.generated_token_ids)
            engine.cancel(victim)
        elif live and rng.random() < 0.05:
            victim = rng.choice(live)
            stopped[victim.request_id] = len(victim.seq.generated_token_ids)
            engine.stop(victim)
        if engine.has_work():
            reports.append(engine.step())
    assert len(requests) == 200 and len(cancelled) > 0 and len(stopped) > 0
    assert sum(len(report.preempted) for report in reports) > 0
    assert max(report.num_tokens for report in reports) <= 32
    assert max(report.batch_size for report in reports) <= 8
    for request in requests:
        prompt_ids = request.seq.token_ids[:request.seq.num_prompt_tokens]
        reference = solo(tiny, prompt_ids, request.params)
        if request.request_id in cancelled:
            tokens = [event.token_id for event in request.events]
            assert all(isinstance(event, TokenEvent) for event in request.events)
            assert tokens == reference[:cancelled[request.request_id]]
            continue
        finish = final(request)
        if request.request_id in stopped:
            assert finish.stats.finish_reason == "stopped"
            assert finish.token_ids == reference[:stopped[request.request_id]]
        else:
            assert finish.stats.finish_reason in ("length", "eos")
            assert finish.token_ids == reference
    assert_pool_free(engine)
    manager = engine.kv_cache.manager  # a pool invariant: every block is free or evictable again
    assert manager.num_free_blocks == manager.num_blocks
