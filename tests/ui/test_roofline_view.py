"""The race's roofline panel (`ui.roofline_view`): a finished race's two lanes become prefill and decode points under
the device's roofs, decode on the memory-bound side; before any race the panel says what will appear."""

from __future__ import annotations

from inference_core import SamplingParams
from inference_core.settings import LaneSettings
from serving.pool import EnginePool
from ui.race_panels import RaceMemory
from ui.race_view import LaneTrace
from ui.roofline_view import EMPTY_NOTE, draw_roofline, roofline_figure


def test_a_finished_race_is_drawn_as_points_under_the_roofs(bundled):
    pool = EnginePool(bundled, max_seq_len=512)
    traces = []
    for name, kv_mode in (("A", "paged"), ("B", "contiguous")):
        settings = LaneSettings(kv_mode=kv_mode)
        engine = pool.get(name.lower(), settings)
        trace = LaneTrace(name, settings, engine, prompt_tokens=0)
        final = engine.complete("Name three rivers.", SamplingParams(max_new_tokens=12, ignore_eos=True))
        trace.stats = final.stats
        traces.append(trace)
    figure, note = draw_roofline(pool, RaceMemory(traces=traces))
    points = [trace for trace in figure.data if trace.mode == "markers"]
    assert sorted(trace.name.split(":")[0] + " " + trace.name.rsplit(" ", 1)[1] for trace in points) == [
        "A decode", "A prefill", "B decode", "B prefill"]
    assert "A decode" in note and "memory-bound side" in note
    decode = next(trace for trace in points if trace.name.endswith("decode"))
    prefill = next(trace for trace in points if trace.name.endswith("prefill"))
    assert decode.x[0] < prefill.x[0]  # decode reads the weights for one token; prefill for the whole prompt


def test_before_a_race_the_panel_says_what_will_appear(bundled):
    assert draw_roofline(EnginePool(bundled, max_seq_len=512), RaceMemory())[1] == EMPTY_NOTE


def test_the_roofs_meet_at_the_ridge():
    ceilings = {"bandwidth_bytes_per_s": 10e9, "peak_flops_per_s": 100e9, "device": "cpu", "dtype": "float32"}
    figure = roofline_figure(ceilings, {})
    roofs = figure.data[0]
    assert list(roofs.x)[1] == 10.0 and list(roofs.y)[1:] == [100.0, 100.0]

