"""Whole requests on the bundled SmolLM2-135M (fp32, CPU): prefix-cache reuse between requests, no leaked KV memory
or active request however a request ends (finished, closed early, abandoned, failed), reproducible seeded sampling,
stop strings, the streamed events and their stats, and end-of-sequence handling.

Engines use a 512-token context so that the contiguous slot and the paged pool stay small; outputs are short (the
model decodes a few to ~17 tokens/s on two CPU cores) but every assertion is on exact ids, texts or byte counts.
"""

from __future__ import annotations

import time

import pytest

from inference_core import FinishEvent, SamplingParams, StopGeneration, TokenEvent
from inference_core.sequence import Sequence
from inference_core.spec.decoding import SpecConfig

from conftest import assert_nothing_held, make_engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest: stable run times on a busy CPU

CONTEXT = 512
BLOCK_SIZE = 16
KV_MODES = ("none", "contiguous", "paged")


def new_engine(bundled, kv_mode: str, **settings):
    return make_engine(bundled, kv_mode, max_seq_len=CONTEXT, **settings)


def assert_holding_one_request(engine) -> None:
    """The state in the middle of a request: proves that the later `assert_nothing_held` checks a real release."""
    assert engine.num_requests() == 1
    assert (engine.blocks_in_use() > 0) == (engine.config.kv_mode != "none")


def collect(events) -> tuple[list[TokenEvent], FinishEvent]:
    events = list(events)
    assert all(isinstance(e, TokenEvent) for e in events[:-1]) and isinstance(events[-1], FinishEvent)
    return events[:-1], events[-1]


# --- (a) Prefix caching ---------------------------------------------------------------------------------------------

def test_shared_system_prompt_reuses_full_blocks(bundled, bench_prompts):
    first_row, second_row = bench_prompts["shared-prefix-1"], bench_prompts["shared-prefix-2"]
    assert first_row["system"] == second_row["system"] and first_row["prompt"] != second_row["prompt"]
    params = SamplingParams(max_new_tokens=32)
    engine = new_engine(bundled, "paged", block_size=BLOCK_SIZE, prefix_cache=True)
    first_ids = engine.prompt_ids(first_row["prompt"], first_row["system"])
    second_ids = engine.prompt_ids(second_row["prompt"], second_row["system"])
    common = next(i for i, (a, b) in enumerate(zip(first_ids, second_ids)) if a != b)
    # Reused: the full blocks inside the common prefix, never covering the second prompt's last token (which must be
    # computed to get logits). The first request registered every full block of its prompt, so all of them match.
    expected_cached = min(common, len(second_ids) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert expected_cached > 0

    first = engine.complete(first_row["prompt"], params, system=first_row["system"])
    second = engine.complete(second_row["prompt"], params, system=second_row["system"])
    assert first.stats.cached_prompt_tokens == 0
    assert second.stats.cached_prompt_tokens == expected_cached
    assert second.stats.prompt_tokens == len(second_ids)
    assert second.stats.prefill_tokens_per_s > 0

    uncached = new_engine(bundled, "paged", block_size=BLOCK_SIZE, prefix_cache=False)
    baseline = uncached.complete(second_row["prompt"], params, system=second_row["system"])
    assert baseline.stats.cached_prompt_tokens == 0
    assert second.token_ids == baseline.token_ids
    assert second.text == baseline.text
    assert_nothing_held(engine)


# --- (b) Leaks --------------------------------------------------------------------------------------------------------

LEAK_PROMPT = "Why is the sky blue?"


@pytest.mark.parametrize("kv_mode", KV_MODES)
def test_finished_request_releases_everything(bundled, kv_mode):
    engine = new_engine(bundled, kv_mode)
    result = engine.complete(LEAK_PROMPT, SamplingParams(max_new_tokens=4))
    assert len(result.token_ids) == 4
    assert_nothing_held(engine)


@pytest.mark.parametrize("kv_mode", KV_MODES)
def test_closed_after_three_tokens_releases_everything(bundled, kv_mode):
    engine = new_engine(bundled, kv_mode)
    generator = engine.generate(LEAK_PROMPT, SamplingParams(max_new_tokens=50))
    indices = [next(generator).index for _ in range(3)]
    assert indices == [0, 1, 2]
    assert_holding_one_request(engine)
    generator.close()
    assert_nothing_held(engine)
    # The engine is usable again: the slot (contiguous) or blocks (paged) are really back.
    assert len(engine.complete(LEAK_PROMPT, SamplingParams(max_new_tokens=2)).token_ids) == 2
    assert_nothing_held(engine)


@pytest.mark.parametrize("kv_mode", KV_MODES)
def test_stop_after_three_tokens_ends_with_stats_and_releases_everything(bundled, kv_mode):
    engine = new_engine(bundled, kv_mode)
    generator = engine.generate(LEAK_PROMPT, SamplingParams(max_new_tokens=50))
    streamed = [next(generator) for _ in range(3)]
    assert streamed[0].cached_prompt_tokens == 0 and streamed[1].cached_prompt_tokens is None
    finish = generator.throw(StopGeneration)  # a plain step has no tokens pending: the final event comes at once
    assert isinstance(finish, FinishEvent)
    assert finish.token_ids == [event.token_id for event in streamed]
    assert finish.text == "".join(event.text for event in streamed)
    stats = finish.stats
    assert (stats.finish_reason, stats.generated_tokens) == ("stopped", 3)
    assert stats.ttft_ms == streamed[0].time_s * 1e3 and stats.total_ms >= streamed[-1].time_s * 1e3
    assert_nothing_held(engine)  # the step that produced the final event gave the KV back, for other requests
    generator.close()
    assert_nothing_held(engine)


def test_stop_in_the_middle_of_a_speculative_step_delivers_its_tokens_first(bundled, bench_prompts):
    engine = new_engine(bundled, "paged")
    generator = engine.generate(bench_prompts["grounded-1"]["prompt"], SamplingParams(max_new_tokens=100),
                                spec=SpecConfig("ngram", k=5))
    streamed = [next(generator)]
    while streamed[-1].draft != "accepted":  # stop right after an accepted draft: the rest of its step is pending
        streamed.append(next(generator))
    event = generator.throw(StopGeneration)
    while not isinstance(event, FinishEvent):
        assert event.draft in ("accepted", "replaced", "bonus")  # the step's own tokens; no new forward ran
        streamed.append(event)
        event = next(generator)
    assert streamed[-1].draft in ("replaced", "bonus")  # the step ran to its end
    assert event.stats.finish_reason == "stopped" and event.token_ids == [e.token_id for e in streamed]
    spec = event.stats.spec  # the engine's count covers exactly the delivered steps
    assert spec["accepted"] == sum(e.draft == "accepted" for e in streamed)
    assert spec["steps"] == sum(e.draft in ("replaced", "bonus") for e in streamed)
    generator.close()
    assert_nothing_held(engine)


def test_stop_before_the_first_step_runs_nothing(bundled):
    engine = new_engine(bundled, "paged")
    generator = engine.generate(LEAK_PROMPT, SamplingParams(max_new_tokens=50))
    with pytest.raises(StopGeneration):
        generator.throw(StopGeneration)
    assert_nothing_held(engine)


@pytest.mark.parametrize("kv_mode", KV_MODES)
def test_dropped_generator_releases_everything(bundled, kv_mode):
    engine = new_engine(bundled, kv_mode)
    generator = engine.generate(LEAK_PROMPT, SamplingParams(max_new_tokens=50))
    next(generator)
    assert_holding_one_request(engine)
    del generator  # no close(): the garbage collector finalizes the suspended generator
    assert_nothing_held(engine)


@pytest.mark.parametrize("kv_mode", KV_MODES)
def test_generator_abandoned_before_starting_holds_nothing(bundled, kv_mode):
    engine = new_engine(bundled, kv_mode)
    generator = engine.generate(LEAK_PROMPT, SamplingParams(max_new_tokens=50))
    assert_nothing_held(engine)  # validation only: nothing is placed until the first next()
    generator.close()
    assert_nothing_held(engine)
    unstarted = engine.generate(LEAK_PROMPT, SamplingParams(max_new_tokens=50))
    del unstarted
    assert_nothing_held(engine)
    assert len(engine.complete(LEAK_PROMPT, SamplingParams(max_new_tokens=2)).token_ids) == 2


@pytest.mark.parametrize("kv_mode", KV_MODES)
def test_failing_forward_releases_everything(bundled, kv_mode, monkeypatch):
    engine = new_engine(bundled, kv_mode)
    real_run = engine.runner.run
    calls = []

    def failing_run(seqs: list[Sequence], *args, **kwargs):
        calls.append(len(seqs))
        if len(calls) == 3:
            assert_holding_one_request(engine)
            raise RuntimeError("simulated device failure")
        return real_run(seqs, *args, **kwargs)

    monkeypatch.setattr(engine.runner, "run", failing_run)
    received = []
    with pytest.raises(RuntimeError, match="simulated device failure"):
        for event in engine.generate(LEAK_PROMPT, SamplingParams(max_new_tokens=50)):
            received.append(event)
    assert len(calls) == 3 and [e.index for e in received] == [0, 1]  # prefill + one decode delivered, then failed
    assert_nothing_held(engine)
    monkeypatch.undo()
    assert len(engine.complete(LEAK_PROMPT, SamplingParams(max_new_tokens=2)).token_ids) == 2
    assert_nothing_held(engine)


# --- (c) Seeded sampling ----------------------------------------------------------------------------------------------

def test_seeded_sampling_is_reproducible(bundled):
    engine = new_engine(bundled, "paged")

    def sampled(seed: int) -> list[int]:
        params = SamplingParams(max_new_tokens=24, temperature=0.8, top_k=50, top_p=0.9, seed=seed, ignore_eos=True)
        return engine.complete("Write a haiku about autumn rain.", params).token_ids

    first = sampled(1234)
    assert len(first) == 24
    assert sampled(1234) == first
    assert sampled(4321) != first  # 24 draws at temperature 0.8 agreeing by chance is vanishingly unlikely


# --- (d) Stop strings -------------------------------------------------------------------------------------------------

STOP_PROMPT = "Describe the water cycle step by step for a ten-year-old."


@pytest.fixture(scope="module")
def unstopped(bundled):
    """The greedy answer to STOP_PROMPT without stop strings (32 tokens)."""
    return new_engine(bundled, "paged").complete(STOP_PROMPT, SamplingParams(max_new_tokens=32))


def test_stop_string_ends_the_text_before_it(bundled, unstopped):
    full = unstopped.text
    assert unstopped.stats.finish_reason == "length" and len(full) > 40
    word_start = full.index(" ", len(full) // 2)
    stop = full[word_start:word_start + 8]  # a space and the next seven characters, from the middle of the answer
    expected_text = full[:full.find(stop)]
    assert expected_text  # the stop string does not occur at the very start

    engine = new_engine(bundled, "paged")
    tokens, finish = collect(engine.generate(STOP_PROMPT, SamplingParams(max_new_tokens=32, stop=(stop,))))
    assert finish.text == expected_text
    assert finish.stats.finish_reason == "stop"
    assert "".join(t.text for t in tokens) == finish.text
    # It stopped at the token that completed the stop string: greedy ids are a prefix of the unstopped ones.
    count = len(finish.token_ids)
    assert finish.token_ids == unstopped.token_ids[:count] and count < 32
    assert stop in bundled.tokenizer.decode(finish.token_ids)
    assert stop not in bundled.tokenizer.decode(finish.token_ids[:-1])
    assert finish.stats.generated_tokens == count
    assert_nothing_held(engine)


def test_stop_string_that_never_completes_changes_nothing(bundled, unstopped):
    # "e" starts the stop string and occurs all over the text, so deltas are held back and later released.
    never = "e\u2603"
    assert never not in unstopped.text and "e" in unstopped.text
    engine = new_engine(bundled, "paged")
    tokens, finish = collect(engine.generate(STOP_PROMPT, SamplingParams(max_new_tokens=32, stop=(never, "\u2603"))))
    assert finish.text == unstopped.text and finish.token_ids == unstopped.token_ids
    assert finish.stats.finish_reason == "length"
    assert "".join(t.text for t in tokens) == finish.text


# --- (e) Streaming events and stats -----------------------------------------------------------------------------------

EVENT_PROMPT = "What is the difference between a process and a thread?"
EVENT_TOKENS = 12


@pytest.mark.parametrize("kv_mode", KV_MODES)
def test_streamed_events_and_stats(bundled, kv_mode):
    engine = new_engine(bundled, kv_mode)
    prompt_ids = engine.prompt_ids(EVENT_PROMPT)
    tokens, finish = collect(engine.generate(EVENT_PROMPT, SamplingParams(max_new_tokens=EVENT_TOKENS)))
    count = len(tokens)
    assert count == EVENT_TOKENS  # the answer is longer than 12 tokens: no end-of-sequence here
    assert [t.index for t in tokens] == list(range(count))
    assert [t.token_id for t in tokens] == finish.token_ids
    assert "".join(t.text for t in tokens) == finish.text and finish.text.strip()
    times = [t.time_s for t in tokens]
    assert times[0] > 0 and times == sorted(times)
    assert all(t.step_ms > 0 for t in tokens)

    stats = finish.stats
    assert stats.kv_mode == kv_mode
    assert stats.prompt_tokens == len(prompt_ids)
    assert stats.cached_prompt_tokens == 0
    assert stats.generated_tokens == len(finish.token_ids) == count
    assert stats.finish_reason == "length"
    assert stats.ttft_ms == times[0] * 1e3  # the first token's busy time is the time to first token
    assert stats.total_ms >= times[-1] * 1e3
    assert stats.prefill_tokens_per_s > 0
    # Decode rate: tokens after the first over the busy time from the first to the end (at least times[-1] - [0]).
    assert 0 < stats.decode_tokens_per_s <= (count - 1) / (times[-1] - times[0]) * (1 + 1e-9)

    bytes_per_token = bundled.config.kv_bytes_per_token(bundled.dtype)
    assert bytes_per_token == 2 * 30 * 3 * 64 * 4  # K and V, 30 layers, 3 KV heads of 64 dims, fp32
    computed = len(prompt_ids) + count - 1  # the last sampled token is never fed back, so it has no KV
    if kv_mode == "none":
        assert (stats.kv_bytes_in_use, stats.kv_bytes_reserved) == (0, 0)
    elif kv_mode == "contiguous":
        assert stats.kv_bytes_in_use == computed * bytes_per_token
        assert stats.kv_bytes_reserved == CONTEXT * bytes_per_token
    else:
        assert stats.kv_bytes_in_use == computed * bytes_per_token
        assert stats.kv_bytes_reserved == -(-computed // BLOCK_SIZE) * BLOCK_SIZE * bytes_per_token
    assert stats.kv_bytes_reserved >= stats.kv_bytes_in_use
    assert stats.as_dict()["generated_tokens"] == count
    assert_nothing_held(engine)


def test_clock_stops_while_the_caller_holds_the_generator(bundled):
    engine = new_engine(bundled, "paged")
    generator = engine.generate(EVENT_PROMPT, SamplingParams(max_new_tokens=4))
    first = next(generator)
    time.sleep(1.5)
    second = next(generator)
    # One decode step of a 135M model is far below 1.5 s: had the sleep been counted, the gap would exceed it.
    assert 0 < second.time_s - first.time_s < 1.5
    generator.close()
    assert_nothing_held(engine)


# --- (f) End of sequence ----------------------------------------------------------------------------------------------

def test_chat_answer_ends_with_eos(bundled):
    engine = new_engine(bundled, "paged")
    tokens, finish = collect(engine.generate("What is the capital of France? Answer in one sentence.",
                                             SamplingParams(max_new_tokens=100)))
    assert finish.stats.finish_reason == "eos"
    assert finish.token_ids[-1] == 2 and 2 in bundled.eos_token_ids
    assert 2 not in finish.token_ids[:-1] and len(finish.token_ids) < 100
    assert tokens[-1].token_id == 2 and tokens[-1].text == ""
    assert finish.text == "The capital of France is Paris."  # no "<|im_end|>" at the end
    assert "".join(t.text for t in tokens) == finish.text
    assert_nothing_held(engine)


def test_compiling_is_left_out_of_ttft_and_decode_rate():
    """A compiled engine's first prefill loads the flat step's package and its first verification the query step's:
    that time counts in neither the TTFT nor the decode rate, whichever step it fell in (it once made the decode
    time negative, reported as 0 tok/s)."""
    from inference_core.engine.request import Request

    class Letters:
        def add(self, token: int) -> str:
            return "a"

    request = Request([1, 2, 3], SamplingParams(max_new_tokens=8), SpecConfig(), detokenizer=Letters(),
                      eos_ids=frozenset(), device="cpu")
    for step_s, compile_s in ((0.5, 0.4), (0.1, 0.05), (0.1, 0.0)):  # prefill and first token, then two decodes
        request.account_step(step_s, 1, 3 if step_s == 0.5 else 0, compile_s)
        request.record(7, step_s, 1)
    stats = request.stats("paged", (0, 0), {"graphs": 3})
    assert stats.ttft_ms == pytest.approx(100.0)
    assert stats.decode_tokens_per_s == pytest.approx(2 / 0.15)
    assert stats.compile["compile_s"] == pytest.approx(0.45)
