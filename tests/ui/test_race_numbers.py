"""The playground's numbers mean what they say, in every state, without a browser: the speed-up line names the lane
that wins each figure, cached and computed prompt tokens are shown apart, the lane header and the table agree, Stop
and the device-time limit end a race or a chat turn with every panel final, a race estimated to hold the device for
minutes is refused with a message in the page's words, a losing configuration is explained in a sentence, and the
lossless check compares same-seed sampling lanes."""

from __future__ import annotations

import re

import pandas as pd
import pytest

import ui
from inference_core import FinishEvent, GenerationStats, TokenEvent
from inference_core.spec.decoding import SpecStats
from ui.chat import CHAT_OUTPUTS, chat_turn
from ui.control import RunControl
from ui.kv_view import render_pool
from ui.race import LANE_SETTING_FIELDS, run_race
from ui.race_table import FIGURES, NUMBER_LABELS, SUMMARY_COLUMNS, lane_numbers, summary_frame, summary_notes_html
from ui.race_view import LaneTrace, lane_html, not_comparable
from serving.pool import EnginePool
from inference_core.settings import LaneSettings
from ui.setups import RACE_SETUPS, presets, setup_values

from conftest import by_lane, lane, race_outputs


def _text(html_text: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html_text))


def _finished(pool: EnginePool, name: str, settings: LaneSettings, *, prompt: int = 41, cached: int = 0,
              tokens: int = 10, ttft_ms: float = 100.0, decode: float = 20.0, step_ms: float = 50.0,
              spec_steps: list[tuple[int, int]] = (), reason: str = "length") -> LaneTrace:
    """A lane that streamed `tokens` tokens (the first at `ttft_ms`, then one every 1/`decode` s, each step
    `step_ms`; speculating lanes: the (drafted, accepted) verification steps) and finished with matching stats."""
    trace = LaneTrace(name, settings, pool.get(f"test-{name}", settings), prompt)
    times = [ttft_ms / 1e3 + index / decode for index in range(tokens)]
    spec = SpecStats(k=settings.spec_k) if settings.speculates else None
    kinds = []
    for drafted, accepted in spec_steps:
        spec.record(drafted, accepted)
        kinds += ["accepted"] * accepted + ["replaced" if accepted < drafted else "bonus"]
    kinds = [None] * (tokens - len(kinds)) + kinds
    for index, (time_s, kind) in enumerate(zip(times, kinds)):
        rejected = (7,) * (1 if kind == "replaced" else 0)
        trace.add(TokenEvent(index, "x", index, time_s, step_ms, kind, rejected, cached if index == 0 else None))
    stats = GenerationStats(settings.kv_mode, prompt, cached, tokens, reason, ttft_ms, 1.0,
                            (tokens - 1) / (times[-1] - times[0]), times[-1] * 1e3, 0, 0,
                            spec.as_dict() if spec else None)
    trace.add(FinishEvent("x" * tokens, list(range(tokens)), stats))
    return trace


def test_speed_up_line_names_the_winner_and_prompt_tokens_are_split(pool):
    # The case seen in the page: lane A took 32 of 41 prompt tokens from the prefix cache and reached its first token
    # sooner; its compute-only prefill rate (9 tokens / 87 ms) was lower than lane B's, and made A look slower.
    a = _finished(pool, "A", LaneSettings("paged"), cached=32, ttft_ms=87, decode=25.5)
    b = _finished(pool, "B", LaneSettings("none"), cached=0, ttft_ms=177, decode=4.1)
    summary = summary_frame([a, b])
    table = by_lane(summary)
    assert list(table["prompt tokens"]) == [41, 41]
    assert list(table["from prefix cache"]) == [32, 0] and list(table["computed in prefill"]) == [9, 41]
    assert list(table["prompt tokens/s"]) == [471, 232]  # all prompt tokens over TTFT: the faster lane's is higher
    assert list(table["TTFT (ms)"]) == [87, 177] and list(table["decode tokens/s"]) == [25.5, 4.1]
    notes = _text(summary_notes_html([a, b]))
    assert "first token 2.03x sooner (87 vs 177 ms)" in notes and "decode 6.22x faster (25.5 vs 4.1 tok/s)" in notes
    reverse = _text(summary_notes_html([b, a]))
    assert "first token 2.03x later (177 vs 87 ms)" in reverse and "decode 6.22x slower (4.1 vs 25.5 tok/s)" in reverse
    same = _finished(pool, "B", LaneSettings("contiguous"), ttft_ms=87.2, decode=25.5)
    assert "first token the same (87 vs 87 ms)" in _text(summary_notes_html([a, same]))
    # Every figure is a row of the table and says what it measures in the note under it.
    assert set(FIGURES) <= set(summary["figure"]) and "What each figure measures" in notes
    assert all(f"<b>{label}</b>: " in summary_notes_html([a, b]) for label in FIGURES)


def test_summary_has_a_row_per_figure_and_a_column_per_lane(pool):
    """The figures down the side with their units, a column per lane; each value rounded as the lane's header rounds
    it and equal to what the `race` API returns for the lane (lane_numbers); the speculation rows last, when a lane
    speculates."""
    a = _finished(pool, "A", LaneSettings("paged"), cached=32, ttft_ms=87.4, decode=25.46)
    b = _finished(pool, "B", LaneSettings("none"), ttft_ms=176.6, decode=4.1)
    summary = summary_frame([a, b])
    assert list(summary.columns) == list(SUMMARY_COLUMNS) == ["figure", "Lane A", "Lane B"]
    assert list(summary["figure"]) == ["settings", *NUMBER_LABELS.values()]
    rows = {row[0]: list(row[1:]) for row in summary.itertuples(index=False)}
    assert rows["settings"] == ["paged KV cache, block 16, prefix cache, greedy",
                                     "no KV cache (recompute), greedy"]
    assert rows["TTFT (ms)"] == [87, 177] and rows["decode tokens/s"] == [25.5, 4.1]
    assert rows["prompt tokens"] == [41, 41] and rows["from prefix cache"] == [32, 0]
    assert rows["computed in prefill"] == [9, 41] and rows["prompt tokens/s"] == [469, 232]
    assert rows["tokens generated"] == [10, 10] and rows["finish reason"] == ["length", "length"]
    assert rows["device time (s)"] == [0.44, 2.37] and rows["KV per token (KiB)"] == [45.0, None]
    assert rows["weights dtype"] == ["float32", "float32"] and rows["compiled decode"] == ["no (eager)"] * 2
    assert _header_numbers(lane_html(a, "A")).startswith("10 tokens, TTFT 87 ms, 25.5 tok/s")
    for column, trace in (("Lane A", a), ("Lane B", b)):
        assert list(summary[column][1:]) == list(lane_numbers(trace).values())
    # A speculating lane adds its rows at the bottom; the plain lane's cells say it does not speculate.
    ngram = _finished(pool, "A", LaneSettings("paged", spec_method="ngram", spec_k=5), tokens=14,
                      spec_steps=[(3, 2), (5, 5)])
    rows = {row[0]: list(row[1:]) for row in summary_frame([ngram, b]).tail(3).itertuples(index=False)}
    assert rows == {"drafts accepted": ["88% (7 of 8 drafts) = engine's count", "no speculation"],
                    "tokens per verification step": ["4.50 (2 steps)", "-"],
                    "draft / verify time": ["0 ms / 0 ms", "-"]}


def test_notes_explain_a_losing_configuration(pool):
    early_exit = LaneSettings("paged", spec_method="early-exit", spec_k=4)
    losing = _finished(pool, "A", early_exit, tokens=14, decode=5.0, spec_steps=[(1, 0)] * 12)
    lookup = _finished(pool, "B", LaneSettings("paged", spec_method="ngram", spec_k=5), decode=26.5)
    notes = dict(re.findall(r'data-note="([\w-]+)">(.*?)</li>', summary_notes_html([losing, lookup])))
    assert notes["low-acceptance"].startswith("Lane A loses because only 0% of its early exit drafts were accepted "
                                              "(0 of 12)")
    assert "not trained to predict its output" in notes["low-acceptance"]
    # No cache: its last step recomputed the whole text, 10x lane A's step.
    recompute = _finished(pool, "B", LaneSettings("none"), step_ms=555.0, decode=4.0)
    notes = dict(re.findall(r'data-note="([\w-]+)">(.*?)</li>',
                            summary_notes_html([_finished(pool, "A", LaneSettings("paged"), step_ms=56.0),
                                                recompute])))
    assert notes["recompute"].startswith("Lane B has no KV cache (recompute): every new token recomputes the whole "
                                         "text so far (50 tokens by its last step), so its last step took 555 ms "
                                         "against 56 ms for lane A")
    # Prefix cache on vs off with nothing cached yet says how to see it work; a hit says what it saved.
    cold = summary_notes_html([_finished(pool, "A", LaneSettings("paged")),
                         _finished(pool, "B", LaneSettings("paged", prefix_cache=False))])
    assert 'data-note="prefix-cache-empty"' in cold and "Run the race again" in cold
    warm = summary_notes_html([_finished(pool, "A", LaneSettings("paged"), cached=32),
                         _finished(pool, "B", LaneSettings("paged", prefix_cache=False))])
    assert "Lane A found 32 of its 41 prompt tokens in its prefix cache" in warm and "prefix-cache-empty" not in warm
    # Two configurations that tie get no notes.
    tie = summary_notes_html([_finished(pool, "A", LaneSettings("paged")),
                              _finished(pool, "B", LaneSettings("contiguous"))])
    assert "race-notes" not in tie


def test_lossless_check_compares_same_seed_sampling_lanes(pool):
    sample = dict(temperature=0.8, top_p=0.9, seed=3)
    assert not_comparable(LaneSettings("paged", **sample), LaneSettings("contiguous", **sample)) is None
    assert not_comparable(LaneSettings("paged"), LaneSettings("none")) is None
    assert "different temperatures, top-p or seeds" in not_comparable(
        LaneSettings("paged", **sample), LaneSettings("paged", **{**sample, "seed": 4}))
    assert "without a seed" in not_comparable(LaneSettings("paged", **sample),
                                              LaneSettings("paged", **{**sample, "seed": None}))
    assert "one lane is greedy" in not_comparable(LaneSettings("paged"), LaneSettings("paged", **sample))
    assert "speculative sampling" in not_comparable(
        LaneSettings("paged", **sample), LaneSettings("paged", spec_method="ngram", **sample))
    last = race_outputs(list(run_race(pool, None, "Name a fruit.", "", 12, *lane("paged", **sample),
                                  *lane("contiguous", **sample)))[-1])
    assert 'data-verdict="identical"' in last["identical"] and "lanes sampling with seed 3" in last["identical"]


def _header_numbers(lane_html: str) -> str:
    return re.search(r'class="lane-numbers"[^>]*>([^<]*)<', lane_html)[1]


def _table_numbers(summary: pd.DataFrame, lane_name: str) -> tuple[int, int | None]:
    """A lane's (tokens generated, TTFT ms) in the summary table (a row per figure, a column per lane)."""
    rows = summary.set_index("figure")
    return rows.loc["tokens generated", f"Lane {lane_name}"], rows.loc["TTFT (ms)", f"Lane {lane_name}"]


def test_stop_ends_the_race_with_every_panel_final_and_the_numbers_agreeing(pool):
    control = RunControl()
    control.arm()
    updates, shown_summary, compared = [], None, 0
    for values in run_race(pool, control, "Write a poem about the sea.", "", 200, *lane("paged"), *lane("contiguous")):
        update = race_outputs(values)
        updates.append(update)
        if isinstance(update["summary"], pd.DataFrame):
            shown_summary = update["summary"]
        # Whenever a lane's header is sent, it shows the numbers of the table on the page.
        for lane_name, name in (("A", "lane_a"), ("B", "lane_b")):
            if isinstance(update[name], str) and shown_summary is not None and "TTFT" in _header_numbers(update[name]):
                tokens, ttft = _table_numbers(shown_summary, lane_name)
                assert _header_numbers(update[name]).startswith(f"{tokens} tokens, TTFT {ttft} ms")
                compared += 1
        if len(updates) == 4:
            control.request_stop()
    last = updates[-1]
    assert compared >= 4  # both headers of the first update and of the last, at least
    assert last["status"].startswith("Stopped. Lane A: ") and "returned their KV blocks" in last["status"]
    assert last["run_button"]["interactive"] is True and not control.armed
    for name in ("lane_a", "lane_b"):
        assert 'data-state="stopped"' in last[name]
    summary = by_lane(last["summary"])
    assert list(summary["finish reason"]) == ["stopped", "stopped"]
    assert all(value is not None for value in summary["KV in use (MiB)"]) and summary["KV reserved (MiB)"].all()
    assert "(at its last token)" in last["kv_view"] and "(live)" not in last["kv_view"]
    assert "the pool now has 0 blocks held" in last["kv_view"]
    assert 'data-verdict="identical-so-far"' in last["identical"]
    tokens_a = _table_numbers(last["summary"], "A")[0]
    assert 4 <= tokens_a < 200 and f"Lane A: {tokens_a} tokens" in last["status"]
    assert pool.active_requests() == 0 and pool.blocks_in_use() == 0


def test_stop_pressed_while_the_race_waits_runs_nothing(pool):
    control = RunControl()
    control.arm()
    control.request_stop()
    updates = [race_outputs(values) for values in run_race(pool, control, "Hi", "", 8, *lane("paged"), *lane("none"))]
    assert len(updates) == 1 and updates[0]["status"].startswith("Stopped before the race started")
    assert not control.armed and not control.stop_requested  # the next Run starts afresh
    assert RunControl().request_stop() is False  # Stop with nothing running does nothing


def test_the_first_step_alternates_between_races(bundled):
    alternating = EnginePool(bundled, max_seq_len=512)
    statuses = [race_outputs(run_race(alternating, None, "Hi", "", 8, *lane("paged"), *lane("contiguous")).__next__())
                ["status"] for _ in range(2)]
    assert "lane A takes the first step" in statuses[0] and "lane B takes the first step" in statuses[1]
    assert alternating.first_lane() == "A"


def test_a_race_over_the_device_time_limit_is_refused_in_the_page_words(bundled):
    limited = EnginePool(bundled, max_seq_len=512, max_run_s=5.0)
    prompt = "Summarize this: " + "the tide comes in and the tide goes out; " * 15
    last = race_outputs(list(run_race(limited, None, prompt, "", 160, *lane("paged"), *lane("none")))[-1])
    status = last["status"]
    assert status.startswith("**Cannot start the race:** this race would hold the shared device for")
    assert "over this app's limit of 5 s per race" in status and "give lane B a KV cache" in status
    assert "--" not in status
    fits = int(re.search(r"lower 'max new tokens' to (\d+) or less", status)[1])
    prompt_tokens = len(limited.get("lane-A", LaneSettings("paged")).prompt_ids(prompt))
    settings = [LaneSettings("paged"), LaneSettings("none")]
    assert sum(limited.estimate_s(settings, prompt_tokens, fits)) <= 5.0
    assert sum(limited.estimate_s(settings, prompt_tokens, fits + 1)) > 5.0
    assert limited.active_requests() == 0


def test_a_race_that_runs_over_the_limit_is_stopped_at_it(bundled, monkeypatch):
    limited = EnginePool(bundled, max_seq_len=512, max_run_s=0.6)
    monkeypatch.setattr(limited, "estimate_s", lambda settings, prompt, new: [0.0, 0.0])  # an estimate gone wrong
    last = race_outputs(list(run_race(limited, None, "Write a poem about the sea.", "", 200, *lane("paged"),
                                  *lane("contiguous")))[-1])
    assert last["status"].startswith("Stopped at this app's limit of 0.6 s of device time per race.")
    device_s = list(by_lane(last["summary"])["device time (s)"])
    assert 0.6 < sum(device_s) < 0.6 + 1.0  # stopped within a step or so of the limit
    assert limited.active_requests() == 0 and limited.blocks_in_use() == 0


@pytest.mark.parametrize("prompt, max_new_tokens, message", [
    ("word " * 600, 16, "shorten the prompt by at least"),
    ("Hi", 600, "set 'max new tokens' to"),
])
def test_messages_name_what_to_change_on_the_page(pool, prompt, max_new_tokens, message):
    status = race_outputs(list(run_race(pool, None, prompt, "", max_new_tokens, *lane("paged"), *lane("paged")))[-1])[
        "status"]
    assert message in status and "--" not in status


def test_stopped_chat_turn_keeps_its_answer_and_its_row(pool):
    control = RunControl()
    control.arm()
    outputs = []
    for values in chat_turn(pool, control, "Tell me a long story.", [], [], "", 200, *lane("paged")):
        outputs.append(dict(zip(CHAT_OUTPUTS, values)))
        if len(outputs) == 3:
            control.request_stop()
    last = outputs[-1]
    row = last["turn_stats"][0]
    assert row["finish_reason"] == "stopped" and 0 < row["generated_tokens"] < 200
    table = last["stats_table"]["value"]
    assert (table["tokens generated"][0], table["finish reason"][0]) == (
        row["generated_tokens"], "stopped")
    assert last["history"][-1]["role"] == "assistant" and last["history"][-1]["content"]
    assert last["status"].startswith(f"Stopped after {row['generated_tokens']} tokens")
    assert pool.active_requests() == 0 and pool.blocks_in_use() == 0


def test_chat_turn_over_the_limit_is_refused_or_stopped(bundled, monkeypatch):
    limited = EnginePool(bundled, max_seq_len=512, max_run_s=1.0)
    status = dict(zip(CHAT_OUTPUTS, list(chat_turn(limited, None, "Tell me a story.", [], [], "", 400,
                                                   *lane("none")))[-1]))["status"]
    assert status.startswith("**Cannot send:** this turn would hold the shared device for")
    assert "give it a KV cache" in status and "--" not in status
    monkeypatch.setattr(limited, "estimate_s", lambda settings, prompt, new: [0.0])  # an estimate gone wrong
    last = dict(zip(CHAT_OUTPUTS, list(chat_turn(limited, None, "Tell me a story.", [], [], "", 400,
                                                 *lane("paged")))[-1]))
    assert last["status"].startswith("Stopped at this app's limit of 1 s per turn after")
    assert last["turn_stats"][0]["finish_reason"] == "stopped" and limited.active_requests() == 0


def test_setups_are_valid_and_say_what_they_show(pool):
    prompts = presets()
    ids = {row["id"] for row in prompts.values()}
    for name, setup in RACE_SETUPS.items():
        assert setup.prompt_id is None or setup.prompt_id in ids, name
        assert len(setup.about) > 80, name
        for settings in setup.lanes.values():
            settings.spec(), settings.engine_config(512), settings.sampling(1)  # valid: raises ConfigError otherwise
        values = setup_values(setup, prompts, LANE_SETTING_FIELDS)
        assert values[3] == setup.about and len(values) == 4 + 2 * len(LANE_SETTING_FIELDS)
    assert {"paged vs contiguous KV cache, long prompt", "prefix cache on vs off, shared system prompt",
            "speculation: early exit vs prompt lookup, grounded prompt"} <= set(RACE_SETUPS)


def test_header_names_the_model_and_cached_blocks_keep_their_text_private(pool):
    header = next(block.value for block in ui.build_demo(pool).blocks.values()
                  if getattr(block, "value", None) and str(block.value).startswith("## Inference Playground"))
    assert "Model **SmolLM2-135M-Instruct (the bundled Q4_1 GGUF)** on **cpu**" in header
    snapshot = {
        "block_size": 4, "num_blocks": 2, "bytes_per_token": 1024, "context_length": 64, "requests": [],
        "blocks": [{"id": 0, "ref_count": 0, "num_filled": 4, "owners": [], "state": "cached",
                    "token_ids": [9, 8, 7, 6]},
                   {"id": 1, "ref_count": 0, "num_filled": 0, "owners": [], "state": "free", "token_ids": []}]}
    page = render_pool(snapshot, lambda ids: "secret", "pool")
    assert "secret" not in page and "9, 8, 7, 6" not in page and "may be another visitor" in page


def test_a_note_says_when_the_engine_stopped_drafting_and_why(pool):
    """A lane whose engine took steps without drafting (`spec.pays`: plain steps measured faster at its batch size)
    says how many and the engine's reason."""
    settings = LaneSettings("paged", spec_method="eagle", spec_k=3)
    lane = _finished(pool, "A", settings, tokens=30, spec_steps=[(3, 1)] * 4)
    lane.stats.spec.update(plain_steps=22, plain_reason="at batch 1 plain steps produce 80.0 tokens/s, "
                           "speculative ones 60.0 (their last 8 steps each)")
    plain = _finished(pool, "B", LaneSettings("paged"))
    notes = dict(re.findall(r'data-note="([\w-]+)">(.*?)</li>', summary_notes_html([lane, plain])))
    assert notes["speculation-off"].startswith("Lane A drafted in 4 of its steps and took 22 without drafting, "
                                               "because at batch 1 plain steps produce 80.0 tokens/s")
    assert 'data-note="speculation-off"' not in summary_notes_html([plain, plain])
