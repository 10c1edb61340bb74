"""The race's memory panel (`ui.memory_view`): each finished lane's plan beside what its engine allocated and its
request held; the two agree on the weights, the KV per token and the pool, and a paged lane holds what the plan says
a sequence of its length takes."""

from __future__ import annotations

from inference_core import SamplingParams
from inference_core.settings import LaneSettings
from serving.pool import EnginePool
from ui.memory_view import EMPTY_NOTE, draw_memory
from ui.race_panels import RaceMemory
from ui.race_view import LaneTrace


def test_each_lane_is_planned_beside_what_it_used(bundled):
    pool = EnginePool(bundled, max_seq_len=512)
    traces = []
    for name, settings in (("A", LaneSettings(kv_mode="paged")), ("B", LaneSettings(kv_mode="contiguous",
                                                                                   kv_dtype="int8"))):
        trace = LaneTrace(name, settings, pool.get(name.lower(), settings), prompt_tokens=0)
        trace.stats = trace.engine.complete("Name three rivers.",
                                            SamplingParams(max_new_tokens=12, ignore_eos=True)).stats
        traces.append(trace)
    frame, note = draw_memory(pool, RaceMemory(traces=traces))
    rows = frame.set_index("quantity")
    assert list(frame.columns) == ["quantity", "A plan", "A used", "B plan", "B used"]
    for lane in "AB":
        assert (rows.iloc[[0, 1, 3]][f"{lane} plan"] == rows.iloc[[0, 1, 3]][f"{lane} used"]).all()
    assert rows.iloc[2]["A plan"] == rows.iloc[2]["A used"]  # a paged sequence holds whole blocks, as planned
    assert rows.iloc[1]["B plan"] < rows.iloc[1]["A plan"]  # int8 KV: about half the bytes per token
    assert rows.iloc[5]["A plan"] > 0 and "estimate" in note


def test_before_a_race_the_panel_says_what_will_appear(bundled):
    assert draw_memory(EnginePool(bundled, max_seq_len=512), RaceMemory())[1] == EMPTY_NOTE
