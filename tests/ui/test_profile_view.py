"""The profile action of the race and the batching lab (`ui.profile_view`), and the lab's roofline: each lane or mode
of the visitor's last run is profiled on a fresh engine with the same settings, and the breakdown sums to the step
time the profile measured; each finished lab mode becomes a prefill and a decode point under the device's roofs."""

from __future__ import annotations

import gzip
import json

import pytest

from inference_core import SamplingParams
from inference_core.settings import LaneSettings
from serving.pool import EnginePool
from tiny_models import run_to_end
from ui.batching import LabMemory, run_batching
from ui.profile_view import DEFAULT_STEPS, profile_lab, profile_race
from ui.race_panels import RaceMemory
from ui.race_view import LaneTrace
from ui.roofline_view import LAB_NOTE, draw_lab_roofline


@pytest.fixture(scope="module")
def pool(bundled):
    return EnginePool(bundled, max_seq_len=512)


def test_each_lane_of_the_last_race_is_profiled(pool):
    traces = []
    for name, settings in (("A", LaneSettings(kv_mode="paged")), ("B", LaneSettings(kv_mode="contiguous"))):
        engine = pool.get(name.lower(), settings)
        request = engine.submit("Name three rivers.", SamplingParams(max_new_tokens=6, ignore_eos=True))
        run_to_end(engine)
        traces.append(LaneTrace(name, settings, engine, prompt_tokens=len(request.seq.token_ids) - 6,
                                request=request))
    figure, note, files = profile_race(pool, RaceMemory(traces=traces), 3)
    assert note.count("ms a step") == 2 and "**A: " in note and "**B: " in note
    assert {bar.name for bar in figure.data} >= {"projections", "attention", "Python (scheduler, runner)"}
    for bar in figure.data:  # one bar per lane, stacked by category
        assert len(bar.y) == 2 and bar.y[0].startswith("A: ")
    for path in files:  # Chrome traces of the recorded steps, gzipped
        assert path.endswith(".json.gz") and json.loads(gzip.open(path).read())["traceEvents"]
    assert pool.blocks_in_use() == 0  # the profiles' engines are not the lanes' and hold nothing after


def test_refusals_say_what_to_do(pool):
    assert "run a race first" in profile_race(pool, RaceMemory(), DEFAULT_STEPS)[1]
    assert "run the lab first" in profile_lab(pool, LabMemory(), DEFAULT_STEPS)[1]
    engine = pool.get("a", LaneSettings(kv_mode="paged"))
    traces = [LaneTrace("A", LaneSettings(kv_mode="paged"), engine, 0, request=engine.make_request("Hello"))]
    assert "from 1 to 32" in profile_race(pool, RaceMemory(traces=traces), 0)[1]
    assert draw_lab_roofline(pool, None)[1] == LAB_NOTE


def test_the_lab_draws_and_profiles_each_mode_of_its_last_run(pool):
    memory = LabMemory()
    frames = list(run_batching(pool, None, "16 short chats", "race: continuous vs static", 6, 8,
                               "max new tokens for every request", 3, 0, "all at once (burst)", 4.0, 0,
                               memory=memory))
    assert "Finished." in frames[-1][4] and [record.mode for record in memory.records] == ["continuous", "static"]
    figure, note = draw_lab_roofline(pool, memory.records)
    points = {trace.name: trace for trace in figure.data if trace.mode == "markers"}
    assert set(points) == {f"{mode} batching {phase}" for mode in ("continuous", "static")
                           for phase in ("prefill", "decode")}, set(points)
    assert "continuous batching decode" in note and "memory-bound side" in note
    # A decode step reads the weights for one token per sequence; a prefill step for whole prompts.
    assert points["continuous batching decode"].x[0] < points["continuous batching prefill"].x[0]
    figure, note, files = profile_lab(pool, memory, 2)
    assert note.count("ms a step") == 2 and "**continuous**" in note and len(files) == 2
    assert "3.0 sequences" in note  # every request at once: max_num_seqs of them per step
