"""The playground's handlers and figures without a browser: streaming values, fairness of the interleaving, cancel,
bad input, chat prefix reuse, speculative lanes (highlighted tokens, acceptance counted live and checked against the
engine's count), and the KV view and charts as pure functions of plain values."""

from __future__ import annotations

import html
import re

import pandas as pd
import pytest

import ui
from inference_core import (ConfigError, Engine, EngineConfig, FinishEvent, GenerationStats, SamplingParams,
                            TokenEvent)
from inference_core.engine.interleave import interleave
from inference_core.spec.decoding import SpecConfig, SpecStats
from ui.chat import CHAT_OUTPUTS, chat_turn
from ui.control import RunControl
from ui.figures import PAGE_LABEL_PX, TTFT_LINE_PX, acceptance_figure, rolling_tokens_per_s, speed_figure
from ui.kv_view import render_pool
from ui.race import LANE_SETTING_FIELDS, run_race
from serving.pool import EnginePool
from inference_core.settings import LaneSettings
from ui.setups import RACE_SETUPS, presets, setup_values
from ui.speculation import AcceptanceCount
from ui.token_view import TokenTrail

from conftest import by_lane, lane, race_outputs


def _figure(output):
    """The plotly figure an output sends (a figure, or an update carrying one), else None."""
    return output.get("value") if isinstance(output, dict) else output


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
    updates = [race_outputs(values) for values in run_race(pool, None, "Why is the sky blue?", "", 24, *lane("paged"),
                                                        *lane("contiguous"))]
    first, last = updates[0], updates[-1]
    assert first["run_button"]["interactive"] is False and last["run_button"]["interactive"] is True
    assert len(updates) >= 3  # a start, streamed text, a final frame
    assert 'data-verdict="identical"' in last["identical"] and "same 24 token ids" in last["identical"]
    assert 'data-done="true"' in last["lane_a"] and 'data-done="true"' in last["lane_b"]
    assert re.search(r"decode <b>(\d+\.\d\dx (faster|slower)|the same)</b>", last["summary_notes"])
    assert list(last["summary"].columns) == ["figure", "Lane A", "Lane B"]  # a row per figure, a column per lane
    summary = by_lane(last["summary"])
    assert list(summary["tokens generated"]) == [24, 24] and list(summary["finish reason"]) == ["length", "length"]
    assert list(summary["prompt tokens"]) == list(summary["from prefix cache"] + summary["computed in prefill"])
    assert len(last["chart"].data) == 4  # a curve and a TTFT marker per lane
    assert last["kv_view"].count('class="kv-cell"') == 512 // 16  # lane A is paged, lane B contiguous
    assert last["status"].startswith("Finished.")
    assert pool.active_requests() == 0 and pool.blocks_in_use() == 0


def test_sampling_lane_skips_the_lossless_check(pool):
    last = race_outputs(list(run_race(pool, None, "Hi", "", 8, *lane("paged"),
                                  *lane("paged", temperature=0.8, seed=1)))[-1])
    assert 'data-verdict="not-checked"' in last["identical"]


def test_cancelling_a_race_frees_both_lanes(pool):
    race = run_race(pool, None, "Write a poem about the sea.", "", 200, *lane("paged"), *lane("paged", block_size=4))
    for _ in range(4):
        next(race)
    assert pool.active_requests() == 2 and pool.blocks_in_use() > 0
    race.close()
    assert pool.active_requests() == 0 and pool.blocks_in_use() == 0


@pytest.mark.parametrize("prompt, max_new_tokens, lane_b, message", [
    ("", 16, lane("paged"), "the prompt is empty"),
    ("word " * 600, 16, lane("paged"), "but the context holds 512"),
    ("Hi", 600, lane("paged"), "600 new tokens do not fit"),
    ("Hi", 16, lane("paged", top_p=0.0), "top_p must be in (0, 1]"),
    ("Hi", 16, lane("paged", block_size=0), "block size must be a positive integer"),
    ("Hi", 16, lane("paged", spec_method="ngram", spec_k=0), "draft length k must be an integer from 1 to 16"),
    ("Hi", 16, lane("paged", spec_method="draft"), "'draft' needs a draft model"),
    ("Hi", 16, lane("paged", spec_method="early-exit", draft_layers=30), "must be below the model's 30 layers"),
])
def test_bad_race_input_gets_a_message(pool, prompt, max_new_tokens, lane_b, message):
    updates = [race_outputs(values) for values in run_race(pool, None, prompt, "", max_new_tokens, *lane("paged"), *lane_b)]
    assert len(updates) == 1
    assert updates[0]["status"].startswith("**Cannot start the race:**") and message in updates[0]["status"]
    assert pool.active_requests() == 0


def test_chat_second_turn_reuses_the_first_from_the_prefix_cache(pool):
    settings = lane("paged")
    history, turn_stats = [], []
    visitor = RunControl()  # one visitor's session: the prefix cache is salted per visitor
    for text in ("Name a fruit.", "What colour is it?"):
        for values in chat_turn(pool, visitor, text, history, turn_stats, "", 24, *settings):
            out = dict(zip(CHAT_OUTPUTS, values))
        history, turn_stats = out["history"], out["turn_stats"]
    assert [m["role"] for m in history] == ["user", "assistant", "user", "assistant"]
    assert history[1]["content"] and history[3]["content"]
    first, second = turn_stats
    assert first["turn"] == 1 and second["turn"] == 2
    # Turn 2's prompt is turn 1's prompt + answer + the new message: every full block of turn 1's prompt is reused.
    assert second["cached_prompt_tokens"] >= first["prompt_tokens"] // 16 * 16 > 0
    table = out["stats_table"]["value"]  # a row per turn, sent with a width per column and the turn column pinned
    assert list(table.columns) == ["turn", "prompt tokens", "from prefix cache", "TTFT (ms)", "decode tokens/s",
                                   "tokens generated", "finish reason", "configuration"]
    assert out["stats_table"]["column_widths"] == ["60px"] + ["96px"] * 6 + ["240px"]
    assert out["stats_table"]["pinned_columns"] == 1
    assert list(table["turn"]) == [1, 2] and list(table["from prefix cache"]) == [0, second["cached_prompt_tokens"]]
    assert list(table["TTFT (ms)"]) == [round(first["ttft_ms"]), round(second["ttft_ms"])]
    assert out["kv_view"].count('class="kv-cell"') == 32
    assert pool.active_requests() == 0


def test_prefix_cache_is_private_to_each_visitor(pool):
    """The same message from the same visitor hits the cache; from another visitor it does not (the block hashes are
    salted per visitor), so a cache hit's timing cannot reveal someone else's prompt."""
    message = "Describe the water cycle step by step for a ten-year-old."
    first, second = RunControl(), RunControl()
    cached = []
    for visitor in (first, first, second):
        for values in chat_turn(pool, visitor, message, [], [], "", 4, *lane("paged")):
            out = dict(zip(CHAT_OUTPUTS, values))
        cached.append(out["turn_stats"][0]["cached_prompt_tokens"])
    assert cached[0] == 0 and cached[1] > 0 and cached[2] == 0


def test_kv_view_shows_other_requests_anonymously():
    snapshot = {
        "block_size": 4, "num_blocks": 3, "bytes_per_token": 1024, "context_length": 64,
        "blocks": [
            {"id": 0, "ref_count": 1, "num_filled": 4, "owners": [7], "state": "used", "token_ids": [1, 2, 3, 4]},
            {"id": 1, "ref_count": 1, "num_filled": 3, "owners": [8], "state": "used", "token_ids": [5, 6, 7]},
            {"id": 2, "ref_count": 0, "num_filled": 0, "owners": [], "state": "free", "token_ids": []},
        ],
        "requests": [{"seq_id": 7, "prompt_tokens": 4, "stored_tokens": 4, "cached_prompt_tokens": 0,
                      "block_table": [0]},
                     {"seq_id": 8, "prompt_tokens": 3, "stored_tokens": 3, "cached_prompt_tokens": 0,
                      "block_table": [1]}],
    }
    page = render_pool(snapshot, lambda ids: "text" + "-".join(map(str, ids)), "pool", {7: "this turn"})
    assert "block 0: held by this turn" in page and "text1-2-3-4" in page
    assert "block 1: in use by another request" in page
    assert "5, 6, 7" not in page and "text5-6-7" not in page
    assert "another request (its text is not shown)" in page


def test_chat_empty_message_and_cancel(pool):
    values = list(chat_turn(pool, None, "  ", [], [], "", 16, *lane("paged")))
    assert len(values) == 1 and "the message is empty" in dict(zip(CHAT_OUTPUTS, values[0]))["status"]
    turn = chat_turn(pool, None, "Tell me a story.", [], [], "", 200, *lane("paged"))
    for _ in range(3):
        next(turn)
    assert pool.active_requests() == 1
    turn.close()
    assert pool.active_requests() == 0 and pool.blocks_in_use() == 0


def test_rolling_tokens_per_s_is_exact():
    xs, ys = rolling_tokens_per_s([0.5, 0.6, 0.8, 1.0])
    assert xs == [0.6, 0.8, 1.0]
    assert ys == pytest.approx([10.0, 2 / 0.3, 3 / 0.5])


@pytest.mark.parametrize("ttft_a, ttft_b", [(0.500, 0.520), (0.502, 0.494), (0.5, 0.5)])
def test_ttft_labels_never_overlap_whichever_lane_comes_first(ttft_a, ttft_b):
    """The TTFT labels sit above the plot, a line each in order of arrival (a tie keeps the lanes' order): the first
    token's label on the top line, the other on the line under it, each starting at its own TTFT. A label's box is 17
    px tall (12 px text and its padding, measured in Chromium), so lines TTFT_LINE_PX apart never overlap however close
    the TTFTs, and the margin above the plot holds both lines under the label the page draws over the chart's corner."""
    figure = speed_figure({"A": {"label": "paged", "times_s": [ttft_a, 0.6, 0.8, 1.0]},
                           "B": {"label": "none", "times_s": [ttft_b, 0.9]}})
    labels = {note.text: note for note in figure.layout.annotations}
    first, second = ("A", "B") if ttft_a <= ttft_b else ("B", "A")
    a_text, b_text = f"A: TTFT {ttft_a * 1e3:.0f} ms", f"B: TTFT {ttft_b * 1e3:.0f} ms"
    assert set(labels) == {a_text, b_text}
    assert [(note.x, note.xanchor, note.y, note.yanchor) for note in (labels[a_text], labels[b_text])] == [
        (ttft_a, "left", 1.0, "bottom"), (ttft_b, "left", 1.0, "bottom")]
    shifts = {text[0]: note.yshift for text, note in labels.items()}
    assert (shifts[first], shifts[second]) == (TTFT_LINE_PX, 0) and TTFT_LINE_PX >= 17 + 2
    assert figure.layout.margin.t == PAGE_LABEL_PX + 2 * TTFT_LINE_PX  # both lines below the page's label


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


# --- speculative decoding in the playground ---

def _lane_text(lane_html: str) -> str:
    """The lane's text area only (the legend above it has a span of every kind too)."""
    return lane_html.split('class="lane-text"', 1)[1]


def _kinds(lane_html: str) -> set[str]:
    return set(re.findall(r'data-kind="(\w+)"', _lane_text(lane_html)))


def _shown_text(lane_html: str) -> str:
    """The generated text as the lane shows it: every span but the struck-through rejected drafts and the tooltips,
    unescaped."""
    text = re.sub(r"<s [^>]*>.*?</s>", "", _lane_text(lane_html).split(">", 1)[1], flags=re.S)
    text = re.sub(r'<span class="tok-tip">.*?</span>', "", text, flags=re.S)
    return html.unescape(re.sub(r"<[^>]+>", "", text))


def test_speculative_race_highlights_tokens_and_counts_acceptance_like_the_engine(pool, bench_prompts):
    row = bench_prompts["grounded-4"]
    lane_a = lane("paged", spec_method="ngram", spec_k=5)
    updates = [race_outputs(values) for values in run_race(pool, None, row["prompt"], "", 128, *lane_a, *lane("paged"))]
    last = updates[-1]
    assert 'data-verdict="identical"' in last["identical"]  # greedy speculation is lossless
    assert {"accepted", "rejected", "replaced", "bonus"} <= _kinds(last["lane_a"])
    assert "tok-legend" in last["lane_a"] and "tok-legend" not in last["lane_b"]
    assert _kinds(last["lane_b"]) == set()  # a plain lane is plain text
    # The reference: the same request on a fresh engine, its final text and the engine's own acceptance count.
    reference = Engine(pool.loaded, EngineConfig(kv_mode="paged", max_seq_len=512)).complete(
        row["prompt"], SamplingParams(max_new_tokens=128), spec=SpecConfig("ngram", k=5))
    spec = reference.stats.spec
    assert _shown_text(last["lane_a"]) == reference.text
    bars, running = _figure(last["acceptance"]).data
    positions = [index + 1 for index, drafted in enumerate(spec["drafted_by_position"]) if drafted]
    assert list(bars.x) == positions == [1, 2, 3, 4, 5]
    assert [list(pair) for pair in bars.customdata] == [
        [spec["accepted_by_position"][p - 1], spec["drafted_by_position"][p - 1]] for p in positions]
    assert len(running.y) == spec["steps"] and running.y[-1] == pytest.approx(spec["acceptance_rate"])
    lane_a_row = by_lane(last["summary"]).loc["Lane A"]
    assert lane_a_row["drafts accepted"] == \
        f"{spec['acceptance_rate']:.0%} ({spec['accepted']} of {spec['drafted']} drafts) = engine's count"
    assert lane_a_row["tokens per verification step"] == f"{spec['mean_accepted_length']:.2f} ({spec['steps']} steps)"
    assert re.fullmatch(r"\d+ ms / \d+ ms \(\d+% drafting\)", lane_a_row["draft / verify time"])
    assert by_lane(last["summary"]).loc["Lane B", "drafts accepted"] == "no speculation"
    assert "of drafts accepted" in last["status"]
    # The chart is sent only when it changed: at the start, after a verification step was counted, when lane A's
    # count was checked against the engine's, and in the final frame; never once per token.
    sent = [_figure(update["acceptance"]) for update in updates if _figure(update["acceptance"]) is not None]
    assert 2 <= len(sent) <= spec["steps"] + 3 < spec["accepted"]
    assert pool.active_requests() == 0 and pool.blocks_in_use() == 0


def test_race_without_speculation_hides_the_acceptance_chart(pool):
    updates = [race_outputs(values) for values in run_race(pool, None, "Hi", "", 8, *lane("paged"), *lane("contiguous"))]
    # The first and the last update hide it; none draws it.
    assert updates[0]["acceptance"]["visible"] is False and updates[-1]["acceptance"]["visible"] is False
    assert all(_figure(update["acceptance"]) is None for update in updates)
    assert "drafts accepted" not in list(updates[-1]["summary"]["figure"])


def test_cancelling_a_speculative_race_frees_both_lanes(pool, bench_prompts):
    row = bench_prompts["grounded-1"]
    race = run_race(pool, None, row["prompt"], "", 200, *lane("paged", spec_method="ngram", spec_k=5),
                    *lane("paged", block_size=4, spec_method="early-exit", spec_k=3, draft_layers=8))
    for _ in range(4):
        next(race)
    assert pool.active_requests() == 2 and pool.blocks_in_use() > 0
    race.close()
    assert pool.active_requests() == 0 and pool.blocks_in_use() == 0


def test_draft_model_lane_and_its_choice_in_the_page(bundled):
    # The bundled model drafting for itself: every draft is accepted, each step ending with a bonus token.
    with_draft = EnginePool(bundled, max_seq_len=512, draft=bundled)
    last = race_outputs(list(run_race(with_draft, None, "Why is the sky blue?", "", 25,
                                  *lane("paged", spec_method="draft", spec_k=3), *lane("paged")))[-1])
    assert 'data-verdict="identical"' in last["identical"]
    assert _kinds(last["lane_a"]) == {"plain", "accepted", "bonus"}
    assert by_lane(last["summary"])["drafts accepted"].iloc[0] == "100% (18 of 18 drafts) = engine's count"
    assert with_draft.active_requests() == 0 and with_draft.blocks_in_use() == 0

    def draft_sources(pool: EnginePool) -> list[str]:
        radios = [block for block in ui.build_demo(pool).blocks.values() if block.elem_id == "lane-a-spec"]
        return [value for _, value in radios[0].choices]

    # The draft model only where the app has one; the trained heads where this model has them (shipped for it).
    assert draft_sources(with_draft) == ["none", "ngram", "early-exit", "draft", "medusa", "eagle"]
    assert draft_sources(EnginePool(bundled, max_seq_len=512)) == ["none", "ngram", "early-exit", "medusa", "eagle"]


def test_chat_turn_with_speculation_reports_acceptance(pool):
    message = "Repeat exactly: the cat sat on the mat, the cat sat on the mat."
    for values in chat_turn(pool, None, message, [], [], "", 32, *lane("paged", spec_method="ngram", spec_k=4)):
        out = dict(zip(CHAT_OUTPUTS, values))
    spec = out["turn_stats"][0]["spec"]
    assert spec is not None and spec["drafted"] > 0
    assert out["stats_table"]["value"]["drafts accepted"][0].startswith(
        f"{spec['acceptance_rate']:.0%} ({spec['accepted']} of {spec['drafted']}), ")
    assert pool.active_requests() == 0


def test_speculation_preset_sets_both_lanes_and_a_grounded_prompt():
    prompts = presets()
    name = next(name for name in RACE_SETUPS if name.startswith("speculation"))
    values = setup_values(RACE_SETUPS[name], prompts, LANE_SETTING_FIELDS)
    key, prompt, system, about = values[:4]
    assert key == "grounded: grounded-4" and prompt == prompts[key]["prompt"] and "prompt lookup" in about
    count = len(LANE_SETTING_FIELDS)
    lane_a, lane_b = LaneSettings(*values[4:4 + count]), LaneSettings(*values[4 + count:])
    assert lane_a.spec() == SpecConfig("ngram", k=5) and lane_b.spec() == SpecConfig("none")
    assert lane_a.kv_mode == lane_b.kv_mode == "paged"
    assert lane_a.describe().endswith("prompt lookup k=5")


def test_tree_lane_is_lossless_and_its_live_count_equals_the_engines(pool, bench_prompts):
    """A tree's step emits its path and then the target's token, which replaces the chain's drafts past the path: the
    page counts the same drafted and accepted tokens from those events as the engine does."""
    row = bench_prompts["chat-short-1"]
    last = race_outputs(list(run_race(pool, None, row["prompt"], "", 48,
                                      *lane("paged", spec_method="eagle", spec_k=2, spec_tree_width=3),
                                      *lane("paged")))[-1])
    assert 'data-verdict="identical"' in last["identical"]
    assert {"accepted", "replaced"} <= _kinds(last["lane_a"])
    assert by_lane(last["summary"])["drafts accepted"].iloc[0].endswith("drafts) = engine's count")
    assert pool.active_requests() == 0 and pool.blocks_in_use() == 0


def test_lane_settings_pass_the_tree_width_to_draft_sources_only():
    assert LaneSettings(spec_method="eagle", spec_k=2, spec_tree_width=3.0).spec() == \
        SpecConfig("eagle", k=2, tree_width=3)
    assert LaneSettings(spec_method="medusa", spec_k=2, spec_tree_width=4).describe().endswith(
        "Medusa heads (trained) k=2 tree 4 wide")
    assert LaneSettings(spec_tree_width=3).spec() == SpecConfig()  # no speculation: nothing to widen
    with pytest.raises(ConfigError, match="medusa or eagle"):  # a source with no ranked candidates says so
        LaneSettings(spec_method="ngram", spec_tree_width=3).spec()


def test_lane_settings_spec_passes_the_early_exit_depth_only_to_early_exit():
    assert LaneSettings(spec_method="early-exit", spec_k=3.0).spec() == SpecConfig("early-exit", k=3)
    assert LaneSettings(spec_method="early-exit", draft_layers=8).spec().draft_layers == 8
    assert LaneSettings(spec_method="ngram", draft_layers=8).spec().draft_layers is None
    assert LaneSettings(spec_method="early-exit", draft_layers=8, spec_adaptive=True).describe().endswith(
        "early exit (8 layers) k best measured adaptive")
    assert LaneSettings().spec() == SpecConfig() and LaneSettings().describe().endswith("greedy")


def _event(token_id: int, text: str, draft: str | None = None, rejected: tuple = ()) -> TokenEvent:
    return TokenEvent(token_id, text, 0, 0.0, 0.0, draft, rejected)


def test_acceptance_counted_from_events_equals_the_engine_count():
    events = [_event(1, "a"),  # the prefill's token
              _event(2, "b", "accepted"), _event(3, "c", "accepted"), _event(4, "d", "replaced", (8, 9, 7)),  # 2 of 5
              _event(5, "e", "replaced", (6,)),  # 0 of 1
              _event(6, "f"),  # nothing drafted: a plain step
              _event(7, "g", "accepted"), _event(8, "h", "accepted"), _event(9, "i", "bonus"),  # 2 of 2
              _event(2, "", "accepted")]  # an accepted end-of-sequence draft ends the request: 1 of 1
    engine = SpecStats(k=5)
    for drafted, accepted in ((5, 2), (1, 0), (2, 2), (1, 1)):
        engine.record(drafted, accepted)
    count = AcceptanceCount()
    for event in events:
        count.add(event)
    assert (count.steps, count.drafted, count.accepted) == (3, 8, 4)  # the open step is not counted yet
    assert count.running_rate == [2 / 5, 2 / 6, 4 / 8]
    count.finish(engine.as_dict())
    assert count.agrees is True and count.running_rate[-1] == 5 / 9
    assert count.as_dict()["accepted_by_position"] == engine.accepted_by_position == [3, 2, 0, 0, 0]
    assert count.as_dict()["drafted_by_position"] == engine.drafted_by_position == [4, 2, 1, 1, 1]
    # Where the counts disagree, the page shows the engine's.
    other = AcceptanceCount()
    other.add(_event(2, "b", "bonus"))
    other.finish(engine.as_dict())
    assert other.agrees is False and other.shown()["drafted"] == 9


def test_streaming_lane_text_places_rejected_drafts_before_their_replacement():
    text = TokenTrail(lambda ids: "".join(chr(ord("A") + i) for i in ids), speculates=True)
    for event in [_event(1, "x"), _event(2, "<y", "accepted"), _event(3, "", "accepted"),  # held-back text
                  _event(4, "z&", "replaced", (0, 1)), _event(5, " w", "bonus")]:
        text.add(event)
    # While the lane streams, neighbouring tokens of one kind are one span, and there are no tooltips.
    assert text.html("draft", tips=False) == (
        '<span class="tok tok-plain" data-kind="plain" style="background:transparent;color:#111827;'
        'border-radius:2px">x</span>'
        '<span class="tok tok-accepted" data-kind="accepted" style="background:#dcfce7;color:#166534;'
        'border-radius:2px">&lt;y</span>'
        '<s class="tok tok-rejected" data-kind="rejected" title="rejected draft tokens (proposed here)" '
        'style="background:#fee2e2;color:#b91c1c;border-radius:2px;text-decoration:line-through;opacity:.8">AB</s>'
        '<span class="tok tok-replaced" data-kind="replaced" style="background:#fef3c7;color:#92400e;'
        'border-radius:2px">z&amp;</span>'
        '<span class="tok tok-bonus" data-kind="bonus" style="background:#e0e7ff;color:#3730a3;'
        'border-radius:2px"> w</span>')
    text.finish("x<yz")  # a stop string cut the end: the shown text ends where the final text does
    assert [(m.kind, m.text) for m in text.marks] == [("plain", "x"), ("accepted", "<y"), ("accepted", ""),
                                                      ("replaced", "z")]
    text.finish("something else")  # never show text that is not the final text
    assert [(m.kind, m.text) for m in text.marks] == [("plain", "something else")]


def test_acceptance_figure_is_exact():
    figure = acceptance_figure({"A": {"label": "prompt lookup", "accepted_by_position": [3, 1, 0],
                                      "drafted_by_position": [4, 2, 0], "running_rate": [0.5, 0.6]}})
    bars, running = figure.data
    assert list(bars.x) == [1, 2] and list(bars.y) == [0.75, 0.5]
    assert [list(pair) for pair in bars.customdata] == [[3, 4], [1, 2]]
    assert list(running.x) == [1, 2] and list(running.y) == [0.5, 0.6]


def test_memory_presets_race_int8_lanes_and_show_their_memory(pool):
    """The two memory presets run as set: the int8-weights lane stores about a third of the fp32 weight bytes, the
    int8-KV lane 68 bytes per token and head against 256; greedy lanes of different arithmetic get an agreement
    count instead of the lossless check; both lanes' blocks go back to the pool."""
    for name, lane_a_overrides in (("int8 weights vs full precision", dict(weights="int8")),
                                   ("int8 KV cache vs full precision", dict(kv_dtype="int8"))):
        assert all(getattr(RACE_SETUPS[name].lanes["A"], key) == value for key, value in lane_a_overrides.items())
        last = race_outputs(list(run_race(pool, None, "Why is the sky blue?", "", 12,
                                          *lane("paged", **lane_a_overrides), *lane("paged")))[-1])
        assert last["status"].startswith("Finished."), last["status"]
        assert 'data-verdict="agreement"' in last["identical"]
        assert re.search(r"agree on the first <b>\d+</b> of 12 tokens", last["identical"])
        summary = by_lane(last["summary"])
        if "weights" in lane_a_overrides:
            assert list(summary["weights dtype"]) == ["int8", "float32"]
            a_mib, b_mib = summary["weights (MiB)"]
            assert b_mib > 2.5 * a_mib  # int8 projections; embeddings and norms stay fp32
        else:
            # 2 x 30 layers x 3 KV heads x (64 + 4) bytes, against x 64 x 4 bytes in fp32
            assert list(summary["KV per token (KiB)"]) == [12.0, 45.0]
    assert pool.active_requests() == 0 and pool.blocks_in_use() == 0


def test_stack_chart_empty_state_stays_inside_each_subplot():
    """Before a climb: no axes, and the empty state's text centred in each subplot's own area (not across both)."""
    from ui.stack import EMPTY_STACK_TEXT, stack_figure

    figure = stack_figure([])
    notes = [note for note in figure.layout.annotations if note.text == EMPTY_STACK_TEXT]
    assert [(note.xref, note.yref, note.x, note.y) for note in notes] == [("x domain", "y domain", 0.5, 0.5),
                                                                          ("x2 domain", "y2 domain", 0.5, 0.5)]
    axes = [figure.layout.xaxis, figure.layout.xaxis2, figure.layout.yaxis, figure.layout.yaxis2]
    assert [axis.visible for axis in axes] == [False] * 4
    assert max(len(line) for line in EMPTY_STACK_TEXT.split("<br>")) <= 22  # fits half a phone's width at 13 px
    drawn = stack_figure([{"rung": "KV cache", "decode tokens/s": 20.0, "TTFT (ms)": 90}])
    assert not drawn.layout.annotations[2:] and drawn.layout.xaxis.visible is None  # the two subplot titles only


def test_a_compiled_rungs_forwards_in_words():
    """What the compiled rungs' "forwards" column says, from the rung engine's counts over the rung's run."""
    from inference_core.engine.compiled import CompileStats
    from ui.stack import forwards_words

    stats = CompileStats(mode="aoti", steps_by_bucket={"flat": 1, "1x1": 5}, fallbacks={"a static batch's padding": 1})
    before = stats.as_dict()
    stats.steps_by_bucket.update({"flat": 2, "1x1": 21, "1x6 query": 10})
    assert forwards_words(stats.since(before)) == "all 27 compiled (1 flat, 16 decode, 10 query)"
    stats.fallbacks["more than 8 sequences"] = 2
    assert forwards_words(stats.since(before)) == ("27 of 29 compiled (1 flat, 16 decode, 10 query), eager: 2: more "
                                                   "than 8 sequences")
    del stats.fallbacks["more than 8 sequences"]
    stats.draft_steps.update({"1-token": 7, "2-token": 5})  # EAGLE's draft layer through its packages
    assert forwards_words(stats.since(before)) == ("all 27 compiled (1 flat, 16 decode, 10 query); 12 EAGLE draft "
                                                   "steps compiled")


def test_the_stacks_int4_rung_takes_a_calibrated_method_only_where_its_file_exists(pool, monkeypatch):
    from ui.stack import int4_choices, ladder

    monkeypatch.setattr(pool, "weight_schemes", lambda: ["none", "int8", "int4", "gptq"])
    assert int4_choices(pool) == ["int4", "gptq"]
    rungs, _ = ladder(pool, False, "gptq")
    named = {rung.name: rung.settings.weights for rung in rungs}
    assert named["int4 weights (GPTQ)"] == "gptq" and named["everything together"] == "gptq"
    with pytest.raises(ConfigError, match="must be one of int4, gptq, got 'awq'"):
        ladder(pool, False, "awq")


def test_stack_climbs_every_rung_and_reports_measured_rows(pool):
    """Without compiled rungs: seven rungs, each generating the asked-for tokens, with a command that names its
    settings; the quantized rungs store fewer weight bytes and change perplexity, the others measure the model as
    loaded (a delta of exactly 0); a second climb reuses the measured perplexities; nothing stays in the pool."""
    from ui.stack import STACK_OUTPUTS, TABLE_COLUMNS, climb

    frames = [dict(zip(STACK_OUTPUTS, frame)) for frame in climb(pool, None, "Name three colours.", "", 8, False)]
    table = [frame["table"] for frame in frames if isinstance(frame["table"], pd.DataFrame)][-1]
    assert list(table.columns) == list(TABLE_COLUMNS)
    assert list(table["rung"]) == ["no KV cache", "KV cache", "paged + prefix cache", "int8 weights", "int4 weights",
                                   "speculative", "everything together"]
    assert (table["tokens"] == 8).all() and (table["decode tokens/s"] > 0).all()
    assert (table["forwards"] == "eager").all()
    assert list(table["vs no KV cache (x)"]) == [round(speed / table["decode tokens/s"][0], 2)
                                                 for speed in table["decode tokens/s"]]
    rows = table.set_index("rung")
    assert rows.loc["int4 weights", "weights (MiB)"] < rows.loc["int8 weights", "weights (MiB)"] \
        < rows.loc["KV cache", "weights (MiB)"] / 2.5
    unchanged = ["no KV cache", "KV cache", "paged + prefix cache", "speculative"]
    assert (rows.loc[unchanged, "quality delta (%)"] == 0).all()
    assert rows.loc["int4 weights", "quality delta (%)"] != 0
    assert "--spec ngram --quant int4 --quant-group 32" in rows.loc["everything together", "command"]
    # k left to the engine: each speculating rung says the k its setup measured best (`spec.defaults`)
    assert re.fullmatch(r"prompt lookup drafts \(prompt lookup k=\d+\)", rows.loc["speculative", "adds"])
    assert frames[-1]["status"].startswith("Finished: 7 rungs") and "compiled decode (unticked)" in frames[-1]["status"]
    assert len(pool.perplexities) == 3
    assert pool.active_requests() == 0 and pool.blocks_in_use() == 0
    roofline = [frame["roofline"] for frame in frames if hasattr(frame["roofline"], "data")][-1]
    decode = {trace.name.rsplit(" ", 1)[0]: trace.x[0] for trace in roofline.data if trace.name.endswith(" decode")}
    assert set(decode) == set(table["rung"])  # every rung a point
    assert decode["int4 weights"] > decode["KV cache"]  # fewer bytes per FLOP moved: the point moves right
