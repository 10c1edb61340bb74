"""The engine loop on the tiny random model (see test_scheduler): callers in other threads submit, stream, stop and
cancel; the loop thread alone steps the engines, batching requests of one engine and sharing the device between
engines.

Every wait has a timeout (`next_event(timeout=...)`, a deadline for `merge`), so a bug fails a test instead of hanging
the suite; each test closes its loop.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time

import pytest

from inference_core.engine.loop import EngineLoop, merge
from inference_core.engine.request import FinishEvent, TokenEvent

from tiny_models import build_tiny_model, greedy, paged, prompt, solo

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest: stable run times on a busy CPU

TIMEOUT_S = 10.0
LONG = 480  # new tokens of a request that must still be running when the test ends it (prompt 12: 492 of 512)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama-loop"))


@pytest.fixture
def loop():
    loop = EngineLoop()
    yield loop
    loop.close()


def collect(handle, received: list[TokenEvent] = ()) -> tuple[list[TokenEvent], FinishEvent]:
    """The handle's events (after those already `received`) up to its FinishEvent, each waited for at most
    TIMEOUT_S."""
    tokens = list(received)
    while not isinstance(event := handle.next_event(timeout=TIMEOUT_S), FinishEvent):
        tokens.append(event)
    assert [t.index for t in tokens] == list(range(len(tokens)))
    assert [t.token_id for t in tokens] == event.token_ids
    return tokens, event


@contextlib.contextmanager
def paused(loop: EngineLoop):
    """Hold the loop thread between two steps (inside a command of its own); what other threads queue meanwhile runs
    together once it lets go, before the next step."""
    entered, release = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        release.wait(TIMEOUT_S)

    holder = threading.Thread(target=loop.call, args=(hold,))
    holder.start()
    assert entered.wait(TIMEOUT_S)
    try:
        yield
    finally:
        release.set()
        holder.join(TIMEOUT_S)


def assert_engine_free(loop, engine) -> None:
    assert loop.call(engine.num_requests) == 0
    assert loop.call(engine.blocks_in_use) == 0


def test_two_threads_on_one_engine_get_their_own_events_in_shared_steps(tiny, loop):
    engine = paged(tiny)
    reports = []
    loop.on_step(engine, reports.append)
    prompts = {"a": prompt(7, seed=200), "b": prompt(11, seed=201)}
    results, about_to_submit = {}, {name: threading.Event() for name in prompts}

    def client(name: str) -> None:
        about_to_submit[name].set()
        handle = loop.submit(engine, prompts[name], greedy(48))
        results[name] = (handle.request_id, collect(handle)[1])

    with paused(loop):  # both submissions land between the same two steps
        threads = [threading.Thread(target=client, args=(name,)) for name in prompts]
        for thread in threads:
            thread.start()
        assert all(event.wait(TIMEOUT_S) for event in about_to_submit.values())
        time.sleep(0.1)  # let both reach the loop's command queue
    for thread in threads:
        thread.join(TIMEOUT_S)
    assert sorted(results) == ["a", "b"]
    for name, (_, finish) in results.items():
        assert finish.token_ids == solo(tiny, prompts[name], greedy(48))
    both = {results["a"][0], results["b"][0]}
    assert any({request_id for request_id, _, _ in report.work} == both for report in reports)
    assert_engine_free(loop, engine)


def test_cancel_from_another_thread_frees_the_kv(tiny, loop):
    engine = paged(tiny)
    handle = loop.submit(engine, prompt(12, seed=210), greedy(LONG))
    first = [handle.next_event(timeout=TIMEOUT_S) for _ in range(3)]
    with paused(loop):  # the request cannot finish while we look
        canceller = threading.Thread(target=handle.cancel)
        canceller.start()
        time.sleep(0.1)
    canceller.join(TIMEOUT_S)
    assert handle.done and handle.request.finished
    assert_engine_free(loop, engine)
    later = []  # tokens of the steps before the cancel landed; never a FinishEvent
    while True:
        try:
            later.append(handle.queue.get_nowait()[1])
        except queue.Empty:
            break
    assert all(isinstance(event, TokenEvent) for event in later)
    tokens = [event.token_id for event in first + later]
    assert 3 <= len(tokens) < LONG and tokens == solo(tiny, prompt(12, seed=210), greedy(LONG))[:len(tokens)]


def test_stop_ends_with_finish_reason_stopped(tiny, loop):
    engine = paged(tiny)
    handle = loop.submit(engine, prompt(12, seed=220), greedy(LONG))
    first = handle.next_event(timeout=TIMEOUT_S)
    handle.stop()
    _, finish = collect(handle, [first])
    assert finish.stats.finish_reason == "stopped"
    assert 1 <= finish.stats.generated_tokens == len(finish.token_ids) < LONG
    assert finish.token_ids == solo(tiny, prompt(12, seed=220), greedy(LONG))[:len(finish.token_ids)]
    assert_engine_free(loop, engine)


def test_a_failing_step_fails_its_request_and_the_loop_serves_the_next(tiny, loop, monkeypatch, caplog):
    engine = paged(tiny)
    real_run, failures = engine.runner.run, []

    def run_failing_once(*args, **kwargs):
        if not failures:
            failures.append(True)
            raise RuntimeError("simulated device failure")
        return real_run(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "run", run_failing_once)
    with caplog.at_level(logging.ERROR, logger="inference_core.engine.loop"):
        doomed = loop.submit(engine, prompt(9, seed=230), greedy(8))
        with pytest.raises(RuntimeError, match="simulated device failure"):
            doomed.next_event(timeout=TIMEOUT_S)  # the prefill failed: no token came before the error
        assert doomed.done
        later = loop.submit(engine, prompt(10, seed=231), greedy(16))
        _, finish = collect(later)
    assert finish.token_ids == solo(tiny, prompt(10, seed=231), greedy(16))
    assert [record.getMessage() for record in caplog.records] == ["engine step failed"]
    assert_engine_free(loop, engine)


def test_two_engines_submitted_together_both_progress(tiny, loop):
    engines = [paged(tiny), paged(tiny, prefix_cache=False)]
    stepped = []  # engine index per step, in the loop thread's order
    for index, engine in enumerate(engines):
        loop.on_step(engine, lambda report, index=index: stepped.append(index))
    prompts = [prompt(8, seed=240), prompt(9, seed=241)]
    # Both queued by one command, so they become busy between the same two steps.
    handles = loop.call(lambda: [loop.submit(engine, prompt_ids, greedy(32))
                                 for engine, prompt_ids in zip(engines, prompts)])
    finishes = [collect(handle)[1] for handle in handles]
    for engine in engines:  # a command runs between steps: the listeners of the last step have run by then
        assert_engine_free(loop, engine)
    for finish, prompt_ids in zip(finishes, prompts):
        assert finish.token_ids == solo(tiny, prompt_ids, greedy(32))
    assert sorted(stepped) == [0] * 32 + [1] * 32
    first = [stepped.index(index) for index in (0, 1)]
    last = [len(stepped) - 1 - stepped[::-1].index(index) for index in (0, 1)]
    assert max(first) < min(last)  # each engine stepped before the other's last step: interleaved


def test_merge_yields_every_event_of_handles_sharing_a_sink(tiny, loop):
    engine = paged(tiny)
    sink: queue.Queue = queue.Queue()
    new_tokens = [5, 17, 11]
    prompts = [prompt(6 + i, seed=250 + i) for i in range(3)]
    handles = [loop.submit(engine, p, greedy(n), sink=sink, tag=i) for i, (p, n) in enumerate(zip(prompts, new_tokens))]
    deadline = time.perf_counter() + TIMEOUT_S  # past it merge stops the handles, and the test fails below
    events = {handle.tag: [] for handle in handles}
    for handle, event in merge(handles, should_stop=lambda: time.perf_counter() > deadline):
        events[handle.tag].append(event)
    assert all(handle.done for handle in handles)
    for tag, received in events.items():
        assert [type(e) for e in received] == [TokenEvent] * new_tokens[tag] + [FinishEvent]
        assert received[-1].stats.finish_reason == "length"
        assert received[-1].token_ids == solo(tiny, prompts[tag], greedy(new_tokens[tag]))
    assert_engine_free(loop, engine)


def test_a_thread_that_hands_the_loop_work_frees_its_idle_openmp_workers():
    """`engine.openmp`: after a parallel op on two threads, this thread's OpenMP worker is an OS thread of the
    process; a call to the loop frees it (the loop's own team is then the only one)."""
    import os

    import torch

    from inference_core.engine.openmp import release_idle_workers

    if not release_idle_workers():
        pytest.skip("torch runs on an OpenMP runtime other than libgomp here")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.ones(1 << 22).sum()  # a parallel part: this thread's team gets its worker
        with_team = len(os.listdir("/proc/self/task"))
        loop = EngineLoop()
        try:
            loop.call(lambda: None)  # the loop thread starts (one more OS thread), this one frees its worker
            assert len(os.listdir("/proc/self/task")) == with_team
        finally:
            loop.close()
    finally:
        torch.set_num_threads(threads)
