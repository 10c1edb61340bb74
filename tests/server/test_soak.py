"""The soak test's pure checks (`server.soak.checks`): the race table read by lane, the tokens read
from the race's and the chat's tables, what makes a race's or a chat turn's panels inconsistent, the bounds from the
solo times scaled to each reply's tokens, the RSS slope after the warm-up and the log's tracebacks. The soak itself
runs outside the suite (`python -m server.soak`)."""

from __future__ import annotations

import pytest

from server.soak.checks import (Action, add_bounds, lane_figures, log_problems, over_bound, race_problem, race_tokens,
                                rss_summary, service_s, turn_problem, turn_tokens)

STATUS = "Finished. Lane A: 24 tokens at 10.3 tok/s. Lane B: 24 tokens at 2.8 tok/s."
BY_FIGURE = (["figure", "Lane A", "Lane B"],
             [["settings", "paged", "no KV cache"], ["TTFT (ms)", "120", "250"], ["tokens generated", "24", "24"],
              ["finish reason", "length", "length"]])


def test_the_race_table_reads_by_lane():
    figures = lane_figures(*BY_FIGURE)
    assert {lane: (values["TTFT (ms)"], values["tokens generated"], values["finish reason"])
            for lane, values in figures.items() if lane.startswith("Lane")} == {
        "Lane A": ("120", "24", "length"), "Lane B": ("250", "24", "length")}
    assert race_problem(STATUS, ["text a", "text b"], figures, 24) is None


def test_an_inconsistent_race_is_named():
    figures = lane_figures(*BY_FIGURE)
    assert race_problem("Waiting for the device...", ["a", "b"], figures, 24).startswith("status")
    assert race_problem(STATUS, ["a", " "], figures, 24) == "a lane's output panel is empty"
    assert race_problem(STATUS, ["a", "b"], figures, 16) == "Lane A: tokens generated '24'"
    assert race_problem(STATUS.replace("Lane B: 24", "Lane B: 23"), ["a", "b"], figures, 24).startswith(
        "the status does not say Lane B's 24 tokens")
    empty = lane_figures(BY_FIGURE[0], [row if row[0] != "tokens generated" else [row[0], "24", ""]
                                        for row in BY_FIGURE[1]])
    assert race_problem(STATUS, ["a", "b"], empty, 24) == "Lane B: tokens generated ''"


def test_a_chat_turn_needs_its_reply_and_its_row():
    shown = {"users": ["Hi", "More"], "bots": ["Hello", "Sure"], "status": "Turn 2: 30 of 40 prompt tokens ..."}
    assert turn_problem(2, "More", shown, [["1", "paged"], ["2", "paged"]]) is None
    assert turn_problem(2, "More", shown, [["1", "paged"]]) == "the stats table's turns are ['1']"
    assert turn_problem(2, "More", {**shown, "bots": ["Hello", ""]}, [["1"], ["2"]]) == "no reply in the log"
    assert turn_problem(2, "More", {**shown, "status": "Generating..."}, [["1"], ["2"]]).startswith("status")


def test_tokens_are_read_from_the_race_summary_and_the_chat_stats():
    assert race_tokens(lane_figures(*BY_FIGURE)) == 24
    assert race_tokens({"Lane A": {"tokens generated": "9"}, "Lane B": {"tokens generated": "17"}}) == 17
    assert race_tokens({"Lane A": {"tokens generated": "9"}, "Lane B": {"tokens generated": ""}}) is None
    headers = ["turn", "prompt tokens", "TTFT (ms)", "tokens\ngenerated", "finish reason"]  # drawn on two lines
    assert turn_tokens(headers, [["1", "30", "120", "48", "length"], ["2", "90", "140", "7", "stop"]]) == 7
    assert turn_tokens(headers, []) is None and turn_tokens(["turn"], [["1"]]) is None


def test_service_time_scales_the_decode_part_to_the_reply():
    solo = {"wait_s": 1.0, "e2e_s": 2.0, "tokens": 5}  # 0.25 s per token after the first
    assert service_s(solo, 41) == pytest.approx(11.0)
    assert service_s(solo, 5) == pytest.approx(2.0) and service_s(solo, 1) == pytest.approx(1.0)
    assert service_s(solo, None) == 2.0 and service_s({**solo, "tokens": None}, 41) == 2.0
    assert service_s({**solo, "wait_s": None}, 10) == pytest.approx(4.0)  # no text seen alone: all of it scales


def test_bounds_come_from_the_last_solo_action_scaled_to_the_tokens():
    actions = [Action("racer-1", "race", "solo", "racer-1", 0, 3.0, 20.0, tokens=24),  # cold: the warm one counts
               Action("racer-1", "race", "solo", "racer-1", 20, 1.0, 10.0, tokens=24),
               Action("chatter-1", "turn", "solo", "chatter-1 turn 3", 30, 1.0, 2.0, tokens=5),
               Action("api-solo", "api", "solo", "api chat p", 32, 0.5, 1.0, tokens=11),
               Action("racer-1", "race", "soak", "racer-1", 40, 2.0, 121.5, tokens=24),
               Action("chatter-1", "turn", "soak", "chatter-1 turn 3", 40, 2.6, 34.2, tokens=41),
               Action("api-1", "api", "soak", "api chat p", 40, 6.1, 8.0, tokens=3)]
    solo = add_bounds(actions, users=6, slack=2.0, grace_s=1.0)
    assert solo["racer-1"] == {"wait_s": 1.0, "e2e_s": 10.0, "tokens": 24}
    race, turn, api = actions[4:]
    assert (race.bound_wait_s, race.bound_e2e_s) == (13.0, 121.0)
    assert (turn.bound_wait_s, turn.bound_e2e_s) == (13.0, 133.0)  # unscaled, 2 x 6 x 2.0 + 1 = 25 s: over
    assert (api.bound_wait_s, api.bound_e2e_s) == (7.0, 8.2)  # 3 tokens: 0.5 + 2 x 0.05 s of service
    assert over_bound(race) and not over_bound(turn) and not over_bound(api)
    silent = [Action("api-solo", "api", "solo", "api chat q", 50, None, 1.0, tokens=4),  # no text chunk alone
              Action("api-1", "api", "soak", "api chat q", 60, 30.0, 12.0, tokens=4)]
    add_bounds(silent, users=6, slack=2.0, grace_s=1.0)
    assert (silent[1].bound_wait_s, silent[1].bound_e2e_s, over_bound(silent[1])) == (None, 13.0, False)


def test_rss_is_flat_unless_it_climbs_in_most_quarters():
    leak = [(t, 1000.0 + t / 6) for t in range(0, 242, 2)]  # 10 MiB a minute throughout
    rss = rss_summary(leak, 0, 240, limit_mib_per_min=5.0)
    assert rss["quarter_slopes_mib_per_min"] == pytest.approx([10.0] * 4) and rss["flat"] is False
    assert (rss["start_mib"], rss["peak_mib"], rss["end_mib"]) == (1000.0, 1040.0, 1040.0)
    step = [(t, 1000.0 if t < 150 else 1030.0) for t in range(0, 242, 2)]  # one 30 MiB step in the third quarter
    rss = rss_summary(step, 0, 240, limit_mib_per_min=5.0)
    assert rss["quarter_slopes_mib_per_min"][:2] == [0.0, 0.0] and rss["quarter_slopes_mib_per_min"][3] == 0.0
    assert rss["slope_after_warmup_mib_per_min"] > 5.0 and rss["median_quarter_slope_mib_per_min"] == 0.0
    assert rss["flat"] is True and rss["warmup_s"] == 120.0
    late_leak = [(t, 1000.0 + max(0, t - 60) / 6) for t in range(0, 242, 2)]  # climbing from the second quarter on
    assert rss_summary(late_leak, 0, 240, 5.0)["flat"] is False


def test_tracebacks_in_the_log_are_found():
    log = "Serving...\nTraceback (most recent call last):\n  File \"x.py\", line 1\nValueError: bad\nok\n"
    assert log_problems(log) == ["line 2: Traceback (most recent call last): ... ValueError: bad"]
    assert log_problems("Serving...\nWARNING: slow\n") == []
