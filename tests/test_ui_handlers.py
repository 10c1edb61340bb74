"""The playground's handlers and figures without a browser: streaming values, fairness of the interleaving, cancel,
bad input, chat prefix reuse, and the KV view and chart as pure functions of plain values."""

from __future__ import annotations

import re

import pytest

from inference_core import FinishEvent, GenerationStats, TokenEvent
from inference_core.race import interleave
from ui.chat import CHAT_OUTPUTS, chat_turn
from ui.figures import rolling_tokens_per_s, speed_figure
from ui.kv_view import render_pool
from ui.race import RACE_OUTPUTS, run_race
from ui.settings import EnginePool, LaneSettings

GREEDY = dict(block_size=16, prefix_cache=True, temperature=0.0, top_p=1.0, seed=None)


def lane(kv_mode: str, **overrides) -> list:
    values = {"kv_mode": kv_mode, **GREEDY, **overrides}
    return [values[name] for name in ("kv_mode", "block_size", "prefix_cache", "temperature", "top_p", "seed")]


@pytest.fixture(scope="module")
def pool(bundled):
    return EnginePool(bundled, max_seq_len=512)


def _outputs(values: tuple) -> dict:
    return dict(zip(RACE_OUTPUTS, values))


def _fake_lane(step_s: float, tokens: int):
    for index in range(tokens):
        yield TokenEvent(index, "x", index, (index + 1) * step_s, step_s * 1e3)
    stats = GenerationStats("paged", 1, 0, tokens, "length", step_s * 1e3, 1.0, 1 / step_s, tokens * step_s * 1e3,
                            0, 0)
    yield FinishEvent("x" * tokens, list(range(tokens)), stats)


def test_interleave_steps_the_lane_with_less_busy_time():
    # Lane fast takes 1 s a step, lane slow 3 s: after every slow step the fast lane catches up with three steps.
    order = [name for name, event in interleave({"fast": _fake_lane(1.0, 6), "slow": _fake_lane(3.0, 2)})
             if isinstance(event, TokenEvent)]
    assert order == ["fast", "slow", "fast", "fast", "fast", "slow", "fast", "fast"]


def test_closing_interleave_closes_every_lane():
    closed = []

    def lane_that_records(name):
        try:
            yield from _fake_lane(1.0, 5)
        finally:
            closed.append(name)

    race = interleave({"a": lane_that_records("a"), "b": lane_that_records("b")})
    next(race), next(race), next(race)
    race.close()
    assert sorted(closed) == ["a", "b"]


def test_race_streams_to_identical_greedy_lanes(pool):
    updates = [_outputs(values) for values in run_race(pool, "Why is the sky blue?", "", 24, *lane("paged"),
                                                        *lane("contiguous"))]
    first, last = updates[0], updates[-1]
    assert first["run_button"]["interactive"] is False and last["run_button"]["interactive"] is True
    assert len(updates) >= 3  # a start, streamed text, a final frame
    assert 'data-verdict="identical"' in last["identical"] and "same 24 token ids" in last["identical"]
    assert 'data-done="true"' in last["lane_a"] and 'data-done="true"' in last["lane_b"]
    assert re.search(r"decode A/B: <b>\d+\.\d\dx", last["summary"])
    assert last["summary"].count("24 (length)") == 2
    assert len(last["chart"].data) == 4  # a curve and a TTFT marker per lane
    assert last["kv_view"].count('class="kv-cell"') == 512 // 16  # lane A is paged, lane B contiguous
    assert last["status"].startswith("Finished.")
    assert pool.active_requests() == 0 and pool.blocks_in_use() == 0


def test_sampling_lane_skips_the_lossless_check(pool):
    last = _outputs(list(run_race(pool, "Hi", "", 8, *lane("paged"), *lane("paged", temperature=0.8, seed=1)))[-1])
    assert 'data-verdict="not-checked"' in last["identical"]


def test_cancelling_a_race_frees_both_lanes(pool):
    race = run_race(pool, "Write a poem about the sea.", "", 200, *lane("paged"), *lane("paged", block_size=4))
    for _ in range(4):
        next(race)
    assert pool.active_requests() == 2 and pool.blocks_in_use() > 0
    race.close()
    assert pool.active_requests() == 0 and pool.blocks_in_use() == 0


@pytest.mark.parametrize("prompt, max_new_tokens, lane_b, message", [
    ("", 16, lane("paged"), "the prompt is empty"),
    ("word " * 600, 16, lane("paged"), "but the context holds 512"),
    ("Hi", 600, lane("paged"), "max_new_tokens=600 does not fit"),
    ("Hi", 16, lane("paged", top_p=0.0), "top_p must be in (0, 1]"),
    ("Hi", 16, lane("paged", block_size=0), "block size must be a positive integer"),
])
def test_bad_race_input_gets_a_message(pool, prompt, max_new_tokens, lane_b, message):
    updates = [_outputs(values) for values in run_race(pool, prompt, "", max_new_tokens, *lane("paged"), *lane_b)]
    assert len(updates) == 1
    assert updates[0]["status"].startswith("**Cannot start the race:**") and message in updates[0]["status"]
    assert pool.active_requests() == 0


def test_chat_second_turn_reuses_the_first_from_the_prefix_cache(pool):
    settings = lane("paged")
    history, turn_stats = [], []
    for text in ("Name a fruit.", "What colour is it?"):
        for values in chat_turn(pool, text, history, turn_stats, "", 24, *settings):
            out = dict(zip(CHAT_OUTPUTS, values))
        history, turn_stats = out["history"], out["turn_stats"]
    assert [m["role"] for m in history] == ["user", "assistant", "user", "assistant"]
    assert history[1]["content"] and history[3]["content"]
    first, second = turn_stats
    assert first["turn"] == 1 and second["turn"] == 2
    # Turn 2's prompt is turn 1's prompt + answer + the new message: every full block of turn 1's prompt is reused.
    assert second["cached_prompt_tokens"] >= first["prompt_tokens"] // 16 * 16 > 0
    assert "from prefix cache" in out["stats_table"] and out["kv_view"].count('class="kv-cell"') == 32
    assert pool.active_requests() == 0


def test_chat_empty_message_and_cancel(pool):
    values = list(chat_turn(pool, "  ", [], [], "", 16, *lane("paged")))
    assert len(values) == 1 and "the message is empty" in dict(zip(CHAT_OUTPUTS, values[0]))["status"]
    turn = chat_turn(pool, "Tell me a story.", [], [], "", 200, *lane("paged"))
    for _ in range(3):
        next(turn)
    assert pool.active_requests() == 1
    turn.close()
    assert pool.active_requests() == 0 and pool.blocks_in_use() == 0


def test_rolling_tokens_per_s_is_exact():
    xs, ys = rolling_tokens_per_s([0.5, 0.6, 0.8, 1.0])
    assert xs == [0.6, 0.8, 1.0]
    assert ys == pytest.approx([10.0, 2 / 0.3, 3 / 0.5])
    figure = speed_figure({"A": {"label": "paged", "times_s": [0.5, 0.6, 0.8, 1.0]}})
    assert figure.data[1].text == ("TTFT 500 ms",)


def test_kv_view_cells_tell_state_owner_and_tokens():
    snapshot = {
        "block_size": 4, "num_blocks": 4, "bytes_per_token": 1024, "context_length": 64,
        "blocks": [
            {"id": 0, "ref_count": 1, "num_filled": 4, "owners": [7], "state": "used", "token_ids": [1, 2, 3, 4]},
            {"id": 1, "ref_count": 1, "num_filled": 2, "owners": [7], "state": "used", "token_ids": [5, 6]},
            {"id": 2, "ref_count": 0, "num_filled": 4, "owners": [], "state": "cached", "token_ids": [9, 9, 9, 9]},
            {"id": 3, "ref_count": 0, "num_filled": 0, "owners": [], "state": "free", "token_ids": []},
        ],
        "requests": [{"seq_id": 7, "prompt_tokens": 5, "stored_tokens": 6, "cached_prompt_tokens": 4,
                      "block_table": [0, 1]}],
    }
    page = render_pool(snapshot, lambda ids: "-".join(map(str, ids)), "pool", {7: "lane A"})
    states = re.findall(r'data-state="(\w+)"', page)
    assert states == ["used", "used", "cached", "free"]
    assert "block 0: held by lane A; reused from the prefix cache; 4/4 slots filled" in page
    assert "tokens [5, 6]" in page and "&#x27;5-6&#x27;" in page
    assert "0&rarr;0" in page and "1&rarr;1" in page
    assert "<td>6</td><td>0.01 MiB</td>" in page  # stored
    assert "<td>8</td>" in page and "<td>64</td><td>0.06 MiB</td>" in page  # reserved; contiguous would reserve
