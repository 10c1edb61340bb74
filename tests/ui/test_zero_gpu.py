"""ZeroGPU as far as a machine without a ZeroGPU Space can show it (`serving.zero_gpu`): with the `spaces` package
installed but no Space, the page's handlers are left as they are and a race and a chat turn run through them; on a
Space (its configuration switched on, and `spaces.GPU` standing in for the scheduler: it asks the duration callable
with the call's own inputs, then runs the call), each call asks for our cost model's estimate of its work with the
margin, the run limit where there is no figure yet, and the card size from the memory plan; the figures a call's
worker measured reach the next estimate through the cache; Stop cancels the event on a Space only; and the GPUs by
name."""

from __future__ import annotations

import math
from functools import partial

import pytest
import spaces
from spaces.config import Config

import serving.zero_gpu as zero_gpu
from inference_core.cards import ZERO_GPU_SIZES, card
from serving.pool import EnginePool
from ui.chat import CHAT_OUTPUTS, run_remembered_chat
from ui.chat_answers import ChatMemory
from ui.control import RunControl
from ui.layout import _chat_job, _race_job
from ui.race import run_remembered_race
from ui.race_panels import RaceMemory
from ui.roofline_view import roofline_figure

from conftest import lane, race_outputs

# A slow device's figures (a decode step 120 ms), so that estimates stand well above the worker's start allowance.
FIGURES = {"decode_ms": 120.0, "forward_ms": {64: 400.0, 128: 700.0, 256: 1300.0, 512: 2600.0}}


def race_inputs(new_tokens: int = 4) -> list:
    return [RunControl(), RaceMemory(), "Name a fruit.", "", new_tokens, *lane("paged"), *lane("contiguous")]


def chat_inputs() -> list:
    return [RunControl(), ChatMemory(), "Hello!", [], [], "", 4, 1, *lane("paged")]


def final_race(updates: list) -> dict:
    return race_outputs(updates[-1])


def test_off_a_space_the_handlers_run_as_they_are(pool):
    assert not zero_gpu.on_zero_gpu()  # the package is here, the Space is not
    race = zero_gpu.gpu_task(pool, partial(run_remembered_race, pool), _race_job)
    assert race.func is run_remembered_race  # not wrapped
    # spaces.GPU itself, off a Space: the function as it is.
    chat = spaces.GPU(duration=60, size="large")(partial(run_remembered_chat, pool))
    last = final_race(list(race(*race_inputs())))
    assert list(last["summary"].columns[1:]) == ["Lane A", "Lane B"] and "Cannot start" not in str(last["status"])
    last = dict(zip(CHAT_OUTPUTS, list(chat(*chat_inputs()))[-1]))
    assert last["history"][-1]["role"] == "assistant" and last["history"][-1]["content"]


class Scheduler:
    """`spaces.GPU` on a Space, as far as our code meets it: the duration callable is asked with the call's inputs
    before the call, then the call runs (here, in this process)."""

    def __init__(self):
        self.calls = []

    def __call__(self, task, duration, size):
        def call(*args, **kwargs):
            self.calls.append((duration(*args, **kwargs), size))
            return task(*args, **kwargs)
        return call


@pytest.fixture
def space(monkeypatch, tmp_path):
    scheduler = Scheduler()
    monkeypatch.setattr(Config, "zero_gpu", True)
    monkeypatch.setattr(spaces, "GPU", scheduler)
    monkeypatch.setattr(zero_gpu, "_costs_path", lambda: tmp_path / zero_gpu.COSTS_FILE)
    return scheduler


def test_on_a_space_each_call_asks_for_the_estimate_with_its_margin(bundled, space):
    pool = EnginePool(bundled, max_seq_len=512)
    try:
        race = zero_gpu.gpu_task(pool, partial(run_remembered_race, pool), _race_job)
        chat = zero_gpu.gpu_task(pool, partial(run_remembered_chat, pool), _chat_job)
        # No figure yet in this process (a Space's main process never probes the device): the run limit.
        assert zero_gpu.gpu_seconds(pool, _race_job(*race_inputs())) == \
            math.ceil(zero_gpu.WORKER_START_S + pool.max_run_s)
        pool.costs.adopt(FIGURES)
        # A long run (2 lanes x 400 tokens x 120 ms, with the margin) is capped at the run limit, which the admission
        # refuses past anyway.
        long_run = _race_job(*race_inputs(new_tokens=400))
        assert zero_gpu.gpu_seconds(pool, long_run) == math.ceil(zero_gpu.WORKER_START_S + pool.max_run_s)
        inputs = race_inputs(new_tokens=40)
        prompt_tokens = len(bundled.tokenizer.prompt_ids("Name a fruit."))
        estimate = 2 * (FIGURES["forward_ms"][64] * prompt_tokens / 64 + 39 * FIGURES["decode_ms"]) / 1e3
        expected = math.ceil(zero_gpu.WORKER_START_S + zero_gpu.ESTIMATE_MARGIN * estimate)
        updates = list(race(*inputs))
        assert space.calls == [(expected, "large")]  # the bundled model fits half a card with room to spare
        assert list(final_race(updates)["summary"].columns[1:]) == ["Lane A", "Lane B"]
        last = dict(zip(CHAT_OUTPUTS, list(chat(*chat_inputs()))[-1]))
        assert last["history"][-1]["content"] and len(space.calls) == 2
        assert zero_gpu.WORKER_START_S < space.calls[1][0] < expected  # 4 new tokens against 2 lanes of 40
    finally:
        pool.loop.close()


def test_a_workers_figures_reach_the_next_calls_estimate(bundled, space):
    worker, main = EnginePool(bundled, max_seq_len=512), EnginePool(bundled, max_seq_len=512)
    measured = [FIGURES]
    try:
        handler = zero_gpu.gpu_task(worker, lambda: worker.costs.adopt(measured[-1]))  # a call's steps, measured
        handler()  # the call ends: its worker keeps the figures
        job = _race_job(*race_inputs(new_tokens=40))
        first = zero_gpu.gpu_seconds(main, job)
        assert first == zero_gpu.gpu_seconds(worker, job) < math.ceil(zero_gpu.WORKER_START_S + main.max_run_s)
        assert main.costs.figures() == worker.costs.figures()
        measured.append({**FIGURES, "decode_ms": 2 * FIGURES["decode_ms"]})  # a later call measured slower steps
        handler()
        assert zero_gpu.gpu_seconds(main, job) > first  # the newer figures replace the earlier ones
    finally:
        worker.loop.close()
        main.loop.close()


def test_stop_cancels_the_event_on_a_space_only(space):
    from ui.layout import _stop_cancels

    assert _stop_cancels(["event"]) == {"cancels": ["event"]}  # another process: Stop cancels the event instead
    Config.zero_gpu = False  # (the fixture puts it back)
    assert _stop_cancels(["event"]) == {}  # Stop reaches the run through the visitor's RunControl


def test_the_size_follows_the_memory_plan(pool, monkeypatch):
    assert zero_gpu.gpu_size(pool) == "large"
    half = ZERO_GPU_SIZES["large"]
    monkeypatch.setitem(ZERO_GPU_SIZES, "large", type(half)(half.name, 64 << 20, half.bandwidth_bytes_per_s))
    assert zero_gpu.gpu_size(pool) == "xlarge"  # a plan over 90% of a 64 MiB half


def test_cards_by_name():
    assert card("NVIDIA H200 MIG 3g.71gb").memory_bytes == 71 * 10 ** 9  # the slice, not the whole H200
    assert card("NVIDIA H200").bandwidth_bytes_per_s == 4.8e12 and card("AMD EPYC") is None
    assert ZERO_GPU_SIZES["xlarge"].memory_bytes == 2 * ZERO_GPU_SIZES["large"].memory_bytes
    ceilings = {"bandwidth_bytes_per_s": 2.9e12, "peak_flops_per_s": 7e14, "device": "NVIDIA H100 80GB HBM3",
                "dtype": "bfloat16"}
    note = roofline_figure(ceilings, {}).layout.annotations[0].text
    assert "2900.0 GB/s (87% of the datasheet's 3350)" in note
    assert "datasheet" not in roofline_figure({**ceilings, "device": "AMD EPYC"}, {}).layout.annotations[0].text
