"""End-to-end: the playground driven by Playwright in Debian's Chromium.

Most tests use the app `app.py` builds (same builder, same queue limits) served in this process over the session's
bundled model, so a test can also look at the engines behind the page (for example that a closed tab's request let
go of its KV blocks); the first-race test starts `python app.py` afresh in its own process, as a visitor meets it.
Chromium comes from Debian's `chromium` package; set-up installs it when it is missing and the test runs as root, and
skips otherwise (fails under CI, where the browser tests must run). `UPDATE_DOCS_SCREENSHOT=1` writes the
screenshots the README shows: docs/race-tab.png, docs/speculative-race.png, docs/race-chart-ttft-labels.png and
docs/chat-tab.png.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import app
import ui
from ui.race_table import NUMBER_LABELS, SUMMARY_COLUMNS
from serving.pool import EnginePool
from ui.setups import RACE_SETUPS
from browser_setup import free_port

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
DOCS_SCREENSHOT = DOCS / "race-tab.png"
RACE_TIMEOUT_MS = 400_000  # the default race decodes 128 tokens with no KV cache in lane B: about 90 s on 2 cores
RACE_TOKENS = 48  # the default-settings race runs a short answer: what it checks does not need 128 tokens


@pytest.fixture(scope="module")
def served(bundled):
    pool = EnginePool(bundled, max_seq_len=2048)
    ui.warm_up(pool)
    demo = ui.build_demo(pool).queue(max_size=8, default_concurrency_limit=1)
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    yield pool, f"http://127.0.0.1:{port}/"
    demo.close()
    # After every race, turn and stop of this module's visitors, each session still holds one component per element
    # of the page: Gradio's per-session state does not grow with updates (ui.session_state).
    sessions = list(demo.state_holder.session_data.values())
    assert sessions and all(len(session.blocks_config.blocks) == len(demo.blocks) for session in sessions)


@pytest.fixture
def fresh_app(bundled, request):
    """`python app.py` started afresh in its own process, as a visitor meets it (the bundled model's cache is already
    converted by the `bundled` fixture), with `--dtype auto` unless a test asks for a dtype (indirect parameter).
    Its chat and API serve the reference engine (`--serving reference`): the model's own weights, so its API's text
    is the served pool's, and no build of the fastest engine's compiled steps runs beside the timed races (that
    default start is the busy-host test's)."""
    port = free_port()
    dtype = getattr(request, "param", "auto")
    process = subprocess.Popen([sys.executable, "app.py", "--device", "cpu", "--port", str(port), "--dtype", dtype,
                                "--serving", "reference"], cwd=ROOT, stdout=subprocess.DEVNULL,
                               stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    try:
        while time.monotonic() < deadline and process.poll() is None:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.5)
        assert process.poll() is None, "app.py exited during start-up"
        yield f"http://127.0.0.1:{port}/"
    finally:
        # A host's stop (SIGTERM) ends it within its grace period, even with a page still open (that page's stream
        # kept it up until the host killed it, before app.SHUTDOWN_GRACE_S).
        process.terminate()
        try:
            process.wait(timeout=app.SHUTDOWN_GRACE_S + 15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            pytest.fail(f"app.py was still up {app.SHUTDOWN_GRACE_S + 15} s after SIGTERM")


def _open(browser, url):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(url)
    page.wait_for_selector("#race-run")
    return page


def _unfold(page, elem_id: str) -> None:
    """Open a folded settings group (a lane's settings, the race options) by clicking its one-line summary."""
    page.locator(f"#{elem_id} > button").first.click()


def _hover_token(page, selector: str):
    """Hover a finished text's token: its tooltip, hidden before, shows. Returns the token, the tooltip, the tooltip's
    first line and its lines of alternatives."""
    from playwright.sync_api import expect

    token = page.locator(selector)
    tip = token.locator(".tok-tip")
    expect(tip).to_be_hidden()
    token.hover()
    expect(tip).to_be_visible()
    head, *alternatives = tip.inner_text().splitlines()
    return token, tip, head, alternatives


def _set_race_tokens(page, count: int) -> None:
    from playwright.sync_api import expect

    _unfold(page, "race-options")
    slider = page.locator("#race-max-new-tokens input[type=range]")
    for attempt in range(2):  # once, under the full suite, the slider still held the default after 5 s: type again
        page.fill("#race-max-new-tokens input[type=number]", str(count))
        page.keyboard.press("Enter")
        page.keyboard.press("Tab")  # the box hands its value to the slider when it loses focus too
        try:
            # Run reads the slider: wait until it holds the count (once, a race clicked at once ran the default
            # length).
            expect(slider).to_have_value(str(count), timeout=10_000)
            return
        except AssertionError:
            if attempt:
                raise


def _open_chat(browser, url):
    page = _open(browser, url)
    page.get_by_role("tab", name="Chat").click()
    return page


def _send(page, text: str) -> None:
    page.fill("#chat-input textarea", text)
    page.click("#chat-send")


def _choose(page, elem_id: str, option: str) -> None:
    """Pick an option of a Gradio dropdown."""
    page.click(f"#{elem_id} input")
    page.get_by_role("option", name=option, exact=True).click()


def _wait_for_requests(pool: EnginePool, count: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while pool.active_requests() < count and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.active_requests() == count and pool.blocks_in_use() > 0


def _wait_idle(pool: EnginePool, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while pool.active_requests() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pool.active_requests() == 0
    assert pool.blocks_in_use() == 0


def _table(page, elem_id: str) -> list[dict[str, str]]:
    """A table's rows as the page shows them, by column header (Gradio's DataFrame grid: ARIA roles); an empty cell
    is a value not measured yet."""
    table = page.locator(f"#{elem_id}")
    headers = [cell.get_attribute("title") for cell in table.locator("[role=columnheader]").all()]
    return [dict(zip(headers, (cell.inner_text().strip() for cell in row.locator("[role=gridcell]").all())))
            for row in table.locator("[role=row]").all() if row.locator("[role=gridcell]").count()]


def _summary(page) -> dict[str, dict[str, str]]:
    """The race summary as the page shows it (a row per figure, a column per lane), by lane then figure."""
    rows = _table(page, "race-summary")
    return {lane: {row["figure"]: row[lane] for row in rows} for lane in ("Lane A", "Lane B")}


def _shown_figures(page) -> dict[str, dict]:
    """Each lane's numbers as the page shows them: in its header and in its column of the summary table."""
    table = _summary(page)
    shown = {}
    for lane in "AB":
        header = page.locator(f"#lane-{lane.lower()}-output .lane-numbers").inner_text()
        tokens = int(re.match(r"(\d+) tokens", header)[1])
        ttft = re.search(r"TTFT (\d+) ms", header)
        speed = re.search(r"([\d.]+) tok/s", header)
        row = table[f"Lane {lane}"]
        shown[lane] = {
            "header": (tokens, int(ttft[1]) if ttft else None, float(speed[1]) if speed else None),
            "table": (int(row["tokens generated"]), int(row["TTFT (ms)"]) if row["TTFT (ms)"] else None,
                      float(row["decode tokens/s"]) if row["decode tokens/s"] else None),
            "prompt": tuple(int(row[name]) for name in ("prompt tokens", "from prefix cache", "computed in prefill")),
            "state": page.locator(f"#lane-{lane.lower()}-output .lane").get_attribute("data-state")}
    return shown


def _assert_numbers_agree(page) -> dict[str, dict]:
    """The header and the table show the same numbers, and each speed-up clause names the winner the per-lane
    numbers make: the first token ratio is B's TTFT over A's, the decode ratio A's tok/s over B's."""
    shown = _shown_figures(page)
    for lane in "AB":
        assert shown[lane]["header"] == shown[lane]["table"], shown
    (_, ttft_a, decode_a), (_, ttft_b, decode_b) = shown["A"]["table"], shown["B"]["table"]
    line = page.locator("#race-summary-notes .race-speedup")
    ttft_clause = line.locator('[data-figure="ttft"]')
    # The ratio comes from unrounded times, the shown TTFTs are whole ms: each is off by up to half a ms (on a fast
    # host, a 13 ms TTFT shown as 13 is up to 3.8% off), so the ratio of the shown ones by up to the sum of both.
    rounding = 0.5 / max(ttft_a, 1) + 0.5 / max(ttft_b, 1)
    assert float(ttft_clause.get_attribute("data-ratio")) == pytest.approx(ttft_b / ttft_a, rel=rounding + 0.01,
                                                                           abs=0.01)
    ttft_ratio = float(ttft_clause.get_attribute("data-ratio"))  # a ratio that rounds to 1.00x reads "the same"
    # The ratio comes from unrounded times, so two TTFTs shown as the same whole ms may still read 1.01x sooner.
    assert ("same" if round(ttft_ratio, 2) == 1.0 else "sooner" if ttft_ratio > 1 else "later") \
        in ttft_clause.inner_text()
    assert (ttft_a <= ttft_b) if ttft_ratio > 1 else (ttft_a >= ttft_b)
    assert f"({ttft_a} vs {ttft_b} ms)" in ttft_clause.inner_text()
    decode_clause = line.locator('[data-figure="decode"]')
    decode_ratio = float(decode_clause.get_attribute("data-ratio"))
    assert decode_ratio == pytest.approx(decode_a / decode_b, rel=0.05)
    assert ("same" if round(decode_ratio, 2) == 1.0 else "faster" if decode_ratio > 1 else "slower") \
        in decode_clause.inner_text()
    assert (decode_a >= decode_b) if decode_ratio > 1 else (decode_a <= decode_b)
    return shown


def test_race_with_default_settings_fills_every_panel(served, browser, tmp_path):
    from playwright.sync_api import expect

    pool, url = served
    page = _open(browser, url)
    # The first screen at a common laptop size holds the prompt, Run, both lanes' text and the tokens/s chart.
    page.set_viewport_size({"width": 1440, "height": 900})
    for elem_id in ("race-prompt", "race-run", "lane-a-output", "lane-b-output", "race-chart"):
        box = page.locator(f"#{elem_id}").bounding_box()
        assert box["y"] + box["height"] <= 900 + 40, (elem_id, box)  # the lanes grow by at most their text box
    _set_race_tokens(page, RACE_TOKENS)
    page.click("#race-run")
    expect(page.locator("#race-run")).to_be_disabled(timeout=10_000)  # no second race while this one streams
    expect(page.locator("#lane-a-output .lane-text")).not_to_be_empty(timeout=30_000)
    page.wait_for_selector('#race-identical [data-verdict="identical"], #race-identical [data-verdict="different"]',
                           timeout=RACE_TIMEOUT_MS)
    expect(page.locator("#race-run")).to_be_enabled()
    # Both lanes streamed text and finished; both greedy, so the lossless check must say identical.
    for lane in ("a", "b"):
        expect(page.locator(f"#lane-{lane}-output .lane")).to_have_attribute("data-done", "true")
        assert len(page.locator(f"#lane-{lane}-output .lane-text").inner_text()) > 100
    assert page.locator('#race-identical [data-verdict="identical"]').count() == 1
    # The chart has a curve per lane, the table a measured TTFT and tokens/s for both lanes and a speed-up.
    expect(page.locator("#race-chart .js-plotly-plot")).to_have_count(1)
    assert page.locator("#race-chart .js-plotly-plot .scatterlayer .trace").count() >= 2
    rows = _table(page, "race-summary")
    notes = page.locator("#race-summary-notes").inner_text()
    print(rows, notes)  # shown with -s: the in-app numbers the README compares with the bench
    # The table is data, a row per figure with its unit and a column per lane, and a copy button puts it on the
    # clipboard; all of its rows are on the page (no scrolling inside the table).
    assert list(rows[0]) == list(SUMMARY_COLUMNS)
    assert [row["figure"] for row in rows] == ["settings", *NUMBER_LABELS.values()]
    lanes = _summary(page)
    assert [(lanes[lane]["tokens generated"], lanes[lane]["finish reason"]) for lane in lanes] == [
        (str(RACE_TOKENS), "length")] * 2
    assert all(int(lane["TTFT (ms)"]) > 0 and float(lane["decode tokens/s"]) > 0 for lane in lanes.values())
    # Lane B keeps no KV cache: nothing reserved, no bytes per token (an empty cell).
    assert [(lane["KV reserved (MiB)"] != "0", lane["KV per token (KiB)"]) for lane in lanes.values()] == [
        (True, "45"), (False, "")]
    assert re.search(r"decode \d+\.\d+x (faster|slower)", notes)
    expect(page.locator("#race-summary button[aria-label='Copy table data']")).to_have_count(1)
    shown = _assert_numbers_agree(page)
    # The prefix cache is private to each visitor: the start-up warm-up's blocks of this prompt are not this
    # visitor's, so a first race computes the whole prompt in both lanes (prompt, from prefix cache, computed).
    assert shown["A"]["prompt"] == shown["B"]["prompt"] == (41, 0, 41)
    # Lane text scrolls in a box of its own instead of growing the page; no lane speculates: no acceptance chart.
    box = page.locator("#lane-b-output .lane-text")
    assert box.evaluate("e => [getComputedStyle(e).overflowY, getComputedStyle(e).maxHeight]") == ["auto", "240px"]
    expect(page.locator("#race-acceptance")).to_be_hidden()
    # The KV view shows lane A's pool: held blocks, a block table, and the memory numbers with a tooltip per cell.
    cells = page.locator("#kv-view .kv-cell")
    assert cells.count() == 2048 // 16
    assert page.locator('#kv-view .kv-cell[data-state="used"]').count() == -(-(41 + RACE_TOKENS - 1) // 16)
    assert "tokens" in page.locator('#kv-view .kv-cell[data-state="used"]').first.get_attribute("title")
    assert "a contiguous cache would reserve" in page.locator("#kv-view").inner_text()
    path = DOCS_SCREENSHOT if os.environ.get("UPDATE_DOCS_SCREENSHOT") else tmp_path / "race-tab.png"
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 50_000
    page.close()
    _wait_idle(pool)


FIRST_RACE_TOLERANCE = 2.0  # lane A's TTFT, first race over second race, within [1/2, 2]; the bug this guards was 4x


def test_first_race_after_a_fresh_start_measures_like_the_second(fresh_app, browser):
    """A visitor's first race after start-up must not charge its lanes for start-up costs: lane B's TTFT (no KV
    cache, so the same work in every race) is within FIRST_RACE_TOLERANCE of the fastest later race's (run-to-run
    spread on a 2-core machine shared with the browser is about +-40% on a ~100 ms TTFT; a third or fourth race runs
    where a busy moment slowed the ones before), lane A's later races reuse the
    visitor's own cached blocks, the first step alternates between the lanes, and the speed-up line agrees with the
    per-lane figures."""
    from playwright.sync_api import expect

    page = _open(browser, fresh_app)
    # `python app.py` takes `--dtype auto`: the header names the dtype it chose and why, from this host's measurement.
    header = re.compile(r"in (float32|bfloat16) \(this CPU (has|\(AVX)")
    expect(page.get_by_text(header).first).to_be_visible()
    _set_race_tokens(page, 32)  # TTFT is the point: keep the no-cache lane short
    status = page.locator("#race-status")
    ttft_b, first_lanes, prompts_a = [], [], []

    def comparable() -> bool:  # the first race's lane B TTFT within the tolerance of the later races' fastest
        return 1 / FIRST_RACE_TOLERANCE <= ttft_b[0] / min(ttft_b[1:]) <= FIRST_RACE_TOLERANCE

    # The first race, then later ones: up to three, while a busy moment of the shared host (the suite's other worker
    # compiling) has slowed every later race so far (once measured 103 against 208 ms).
    for race in range(4):
        page.wait_for_timeout(1000)  # as a person would: the page has drawn what it shows before Run is pressed
        page.click("#race-run")
        expect(status).to_contain_text("takes the first step", timeout=60_000)
        first_lanes.append(re.search(r"lane (\w) takes the first step", status.inner_text())[1])
        expect(status).to_contain_text("Finished.", timeout=RACE_TIMEOUT_MS)
        shown = _assert_numbers_agree(page)
        prompts_a.append(shown["A"]["prompt"])
        ttft_b.append(shown["B"]["table"][1])
        if race >= 1 and comparable():
            break
    print(f"lane B TTFT: first race {ttft_b[0]} ms, later {ttft_b[1:]} ms; first steps {first_lanes}")
    assert sorted(first_lanes[:2]) == ["A", "B"]
    # Lane B (no KV cache) does the same work in every race; lane A's later races reuse this visitor's own blocks.
    assert comparable(), ttft_b
    assert prompts_a == [(41, 0, 41)] + [(41, 32, 9)] * (len(prompts_a) - 1)  # prompt tokens, from prefix cache,
    # computed
    # The page stays open: `fresh_app` then checks that an open page does not keep app.py up after a stop.


def test_bad_input_gets_a_message_in_the_page(served, browser):
    from playwright.sync_api import expect

    pool, url = served
    page = _open(browser, url)
    page.fill("#race-prompt textarea", "   ")
    page.click("#race-run")
    expect(page.locator("#race-status")).to_contain_text("the prompt is empty", timeout=15_000)
    page.fill("#race-prompt textarea", "tell me more about it " * 600)
    page.click("#race-run")
    expect(page.locator("#race-status")).to_contain_text("but the context holds 2048", timeout=15_000)
    expect(page.locator("#race-run")).to_be_enabled()
    assert "Traceback" not in page.content()
    page.close()
    _wait_idle(pool)


def test_two_chat_turns_reuse_the_prefix_cache(served, browser):
    from playwright.sync_api import expect

    pool, url = served
    page = _open_chat(browser, url)
    for turn, text in enumerate(("Name three primary colours.", "Which of them is warmest?"), 1):
        _send(page, text)
        expect(page.locator("#chat-stats [role=row]")).to_have_count(turn + 1, timeout=120_000)  # and the headers
    first, second = _table(page, "chat-stats")
    assert (first["turn"], second["turn"]) == ("1", "2")
    second_prompt, second_cached = int(second["prompt tokens"]), int(second["from prefix cache"])
    # The start-up warm-up's chat turn left the chat template's first block cached, but not for this visitor.
    assert int(first["from prefix cache"]) == 0
    # The second turn's prompt starts with the whole first turn: at least the first prompt's full blocks are reused.
    assert second_cached >= (int(first["prompt tokens"]) // 16) * 16 > 0
    assert second_cached < second_prompt
    expect(page.locator("#chat-log")).to_contain_text("Which of them is warmest?")
    expect(page.locator("#chat-kv-view .kv-cell")).to_have_count(2048 // 16)
    # The answer under the chat log, token by token: a token's tooltip gives its probability and five alternatives.
    token, tip, head, alternatives = _hover_token(page, '#chat-tokens .tok[data-i="0"]')
    assert f"p {float(token.get_attribute('data-p')):.3f}" in head, head
    assert [line.split(".")[0] for line in alternatives] == ["1", "2", "3", "4", "5"], alternatives
    if os.environ.get("UPDATE_DOCS_SCREENSHOT"):
        page.screenshot(path=str(DOCS / "chat-tab.png"), full_page=True)
    page.close()
    _wait_idle(pool)


def test_two_visitors_chatting_at_once_are_batched_but_see_nothing_of_each_other(served, browser):
    """Two browser contexts (two visitors) send the same message at once: their turns share the chat engine's steps
    (batched), yet the second gets no prefix-cache hit on the first's prompt, and its KV view shows the first's
    blocks only as "in use by another request", with no tokens."""
    from playwright.sync_api import expect

    pool, url = served
    message = "Write a short story about a lighthouse keeper and a storm."
    contexts = [browser.new_context(viewport={"width": 1400, "height": 1000}) for _ in range(2)]
    pages = []
    for context in contexts:
        page = context.new_page()
        page.goto(url)
        page.wait_for_selector("#race-run")
        page.get_by_role("tab", name="Chat").click()
        pages.append(page)
    _send(pages[0], message)
    _wait_for_requests(pool, 1)
    _send(pages[1], message)
    _wait_for_requests(pool, 2)  # both turns in flight on the one engine loop
    second = pages[1]
    # While both run, the second visitor's live KV view shows the first's blocks, anonymously.
    others = second.locator('#chat-kv-view .kv-cell[title*="in use by another request"]')
    expect(others.first).to_be_attached(timeout=60_000)
    titles = others.evaluate_all("cells => cells.map(c => c.title)")
    assert titles and all("tokens" not in title for title in titles)
    for page in pages:
        expect(page.locator("#chat-stats [role=row]")).to_have_count(2, timeout=180_000)
    assert _table(second, "chat-stats")[0]["from prefix cache"] == "0"  # same prompt as the other visitor's, no hit
    assert "shared with other requests" in second.locator("#chat-status").inner_text()
    for context in contexts:
        context.close()
    _wait_idle(pool)


def test_closing_the_tab_cancels_its_request_and_frees_its_blocks(served, browser):
    pool, url = served
    page = _open_chat(browser, url)
    _send(page, "Write a long story about a lighthouse keeper.")
    _wait_for_requests(pool, 1)
    page.close()
    _wait_idle(pool, timeout_s=30)


def test_stop_leaves_every_panel_final_and_consistent(served, browser):
    from playwright.sync_api import expect

    pool, url = served
    page = _open(browser, url)
    page.click("#race-run")  # 128 tokens: long enough to be stopped in the middle
    expect(page.locator("#lane-b-output .lane-text")).not_to_be_empty(timeout=30_000)  # both lanes stream
    _wait_for_requests(pool, 2)
    page.click("#race-stop")
    expect(page.locator("#race-status")).to_contain_text("Stopped.", timeout=15_000)
    expect(page.locator("#race-run")).to_be_enabled()
    _wait_idle(pool)
    # Every panel shows the final state: the lanes say stopped, no cell waits for an end, the KV view is not live
    # and says the blocks went back, and the header, the table, the speed-up line and the status agree.
    for lane in "ab":
        expect(page.locator(f"#lane-{lane}-output .lane")).to_have_attribute("data-state", "stopped")
    lanes = _summary(page).values()
    assert [lane["finish reason"] for lane in lanes] == ["stopped", "stopped"]
    assert all(lane["KV in use (MiB)"] and lane["KV reserved (MiB)"] for lane in lanes)  # no cell waits for the end
    kv_view = page.locator("#kv-view").inner_text()
    assert "(live)" not in kv_view and "(at its last token)" in kv_view
    assert "returned its blocks: the pool now has 0 blocks held" in kv_view
    shown = _assert_numbers_agree(page)
    status = page.locator("#race-status").inner_text()
    for lane in "AB":
        tokens, _, speed = shown[lane]["table"]
        assert f"Lane {lane}: {tokens} tokens at {speed:.1f} tok/s." in status
    assert page.locator('#race-identical [data-verdict="identical-so-far"]').count() == 1
    page.close()


def test_settings_that_do_not_apply_are_disabled(served, browser):
    from playwright.sync_api import expect

    _, url = served
    page = _open(browser, url)
    _unfold(page, "lane-a-settings")
    _unfold(page, "lane-b-settings")

    def control(prefix: str, setting: str):
        return page.locator(f"#{prefix}-{setting} input").first

    # Lane B starts with no KV cache: block size and prefix cache are off for it, on for paged lane A; both lanes are
    # greedy, so top-p and seed are off for both.
    for setting in ("block-size", "prefix-cache"):
        expect(control("lane-a", setting)).to_be_enabled()
        expect(control("lane-b", setting)).to_be_disabled()
    for prefix in ("lane-a", "lane-b"):
        for setting in ("top-p", "seed"):
            expect(control(prefix, setting)).to_be_disabled()
    expect(control("lane-a", "seed")).to_have_value("0")  # the seed the engine gets, shown as it is
    page.locator("#lane-a-kv").get_by_text("contiguous KV cache").click()
    page.locator("#lane-b-kv").get_by_text("paged KV cache").click()
    for setting in ("block-size", "prefix-cache"):
        expect(control("lane-a", setting)).to_be_disabled()
        expect(control("lane-b", setting)).to_be_enabled()
    page.fill("#lane-a-temperature input[type=number]", "0.7")
    page.keyboard.press("Enter")
    for setting in ("top-p", "seed"):
        expect(control("lane-a", setting)).to_be_enabled()
        expect(control("lane-b", setting)).to_be_disabled()
    # A setup sets both lanes and the settings follow: prompt lookup vs plain, both paged and greedy.
    _choose(page, "race-setup", next(name for name in RACE_SETUPS if name.startswith("speculation: prompt")))
    expect(page.locator("#race-setup-about")).to_contain_text("prompt lookup")
    for prefix in ("lane-a", "lane-b"):
        expect(control(prefix, "block-size")).to_be_enabled()
        expect(control(prefix, "top-p")).to_be_disabled()
        expect(control(prefix, "seed")).to_have_value("0")
    page.close()


def test_speculative_race_highlights_every_kind_of_token(served, browser, tmp_path):
    from playwright.sync_api import expect

    pool, url = served
    page = _open(browser, url)
    _unfold(page, "lane-a-settings")
    _unfold(page, "lane-b-settings")
    _choose(page, "race-setup", next(name for name in RACE_SETUPS if name.startswith("speculation")))
    expect(page.locator("#race-prompt textarea")).to_have_value(re.compile("^Copy the passage below"))
    expect(page.locator("#lane-a-spec input[value=ngram]")).to_be_checked()
    expect(page.locator("#lane-b-spec input[value=none]")).to_be_checked()
    page.click("#race-run")
    page.wait_for_selector('#race-identical [data-verdict="identical"], #race-identical [data-verdict="different"]',
                           timeout=RACE_TIMEOUT_MS)
    assert page.locator('#race-identical [data-verdict="identical"]').count() == 1  # greedy speculation is lossless
    # Grounded-4 with prompt lookup k=5: accepted drafts, rejected ones (struck through) with the target's
    # replacement, and bonus tokens all occur in lane A's text; lane B decodes plainly.
    lane_a = page.locator("#lane-a-output .lane-text")
    for kind in ("accepted", "replaced", "bonus"):
        assert lane_a.locator(f'span.tok-{kind}[data-kind="{kind}"]').count() >= 1, kind
    assert lane_a.locator('s.tok-rejected[data-kind="rejected"]').count() >= 1
    assert page.locator("#lane-a-output .tok-legend").count() == 1
    assert page.locator("#lane-b-output .lane-text .tok[data-kind]").count() == 0  # no draft-kind colours
    # The acceptance chart: a bar per draft position (1..5) and the running acceptance rate's line.
    chart = page.locator("#race-acceptance .js-plotly-plot")
    expect(chart.locator(".barlayer .trace .point")).to_have_count(5)
    assert chart.locator(".scatterlayer .trace path.js-line").count() == 1
    lanes = _summary(page)
    print(lanes)  # shown with -s: the in-app numbers of the speculative preset
    assert lanes["Lane A"]["drafts accepted"].endswith("drafts) = engine's count")
    assert lanes["Lane B"]["drafts accepted"] == "no speculation"
    assert re.search(r"decode \d+\.\d+x (faster|slower)", page.locator("#race-summary-notes").inner_text())
    path = DOCS / "speculative-race.png" if os.environ.get("UPDATE_DOCS_SCREENSHOT") else tmp_path / "spec.png"
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 50_000
    if os.environ.get("UPDATE_DOCS_SCREENSHOT"):  # the two lanes' TTFTs are close here: their labels must not overlap
        page.locator("#race-chart").screenshot(path=str(DOCS / "race-chart-ttft-labels.png"))
    # The draft length shows for any draft source, the early-exit depth for early exit only.
    expect(page.locator("#lane-b-spec-k")).to_be_hidden()
    page.locator("#lane-b-spec").get_by_text("early exit").click()
    expect(page.locator("#lane-b-spec-k")).to_be_visible()
    expect(page.locator("#lane-b-spec-layers input")).to_have_value("engine default")
    # The tree width shows for the trained heads only (the sources that rank their candidates).
    expect(page.locator("#lane-b-spec-tree")).to_be_hidden()
    page.locator("#lane-b-spec").get_by_text("EAGLE layer (trained)").click()
    expect(page.locator("#lane-b-spec-tree")).to_be_visible()
    expect(page.locator("#lane-b-spec-tree input")).to_have_value("best measured")  # left to the measurement
    expect(page.locator("#lane-b-spec-layers")).to_be_hidden()
    page.locator("#lane-a-spec").get_by_text("none").click()
    expect(page.locator("#lane-a-spec-k")).to_be_hidden()
    expect(page.locator("#lane-a-spec-layers")).to_be_hidden()
    page.close()
    _wait_idle(pool)


@pytest.mark.parametrize("fresh_app", ["float32"], indirect=True)  # the served pool's dtype: same ids
def test_external_lane_races_this_apps_own_api_in_a_second_process(served, browser, fresh_app):
    """Lane B targets `python app.py` started as a second process, through its OpenAI-compatible API (as it would a
    vLLM or llama.cpp server): both lanes stream, the table names the external engine with its own TTFT and tokens/s,
    and the greedy texts of the same model agree."""
    from playwright.sync_api import expect

    pool, url = served
    page = _open(browser, url)
    _set_race_tokens(page, 16)
    _unfold(page, "lane-b-settings")
    # The lane's one-line summary (the accordion's label) follows the edit; now and then the update that sets it
    # re-renders the accordion and drops the typed URL (a suite run raced lane B on this app's engine), so the URL is
    # typed again until the box still holds it after the summary changed.
    for attempt in range(3):
        page.fill("#lane-b-endpoint textarea", fresh_app)
        page.keyboard.press("Tab")
        expect(page.locator("#lane-b-settings")).to_contain_text("external engine", timeout=10_000)
        page.wait_for_timeout(300)
        if page.locator("#lane-b-endpoint textarea").input_value() == fresh_app:
            break
    expect(page.locator("#lane-b-endpoint textarea")).to_have_value(fresh_app)
    page.click("#race-run")
    expect(page.locator("#race-status")).to_contain_text("Finished.", timeout=RACE_TIMEOUT_MS)
    assert page.locator('#race-identical [data-verdict="identical"]').count() == 1
    expect(page.locator("#lane-b-output .lane-text")).not_to_be_empty()
    lane_b = _summary(page)["Lane B"]
    assert "external engine" in lane_b["settings"]
    assert int(lane_b["TTFT (ms)"]) > 0 and float(lane_b["decode tokens/s"]) > 0  # its own measured numbers
    _wait_idle(pool)


def test_hovering_a_token_shows_its_alternatives_and_the_logit_lens_opens(served, browser):
    """A finished lane's token shows its probability and top alternatives on hover (and on focus, as a tap gives it),
    drawn whole over the lane's scrolling box; the colour mode redraws the lanes without a new race; the logit lens
    draws a token's probability after each layer; the roofline panel draws both lanes under the device's roofs; the
    profiler's breakdown of both lanes opens with their traces to download."""
    from playwright.sync_api import expect

    pool, url = served
    page = _open(browser, url)
    _set_race_tokens(page, 16)
    page.click("#race-run")
    expect(page.locator("#race-status")).to_contain_text("Finished.", timeout=RACE_TIMEOUT_MS)
    token, tip, head, alternatives = _hover_token(page, '#lane-a-output .lane-text .tok[data-i="1"]')
    probability = float(token.get_attribute("data-p"))
    assert re.fullmatch(rf"('.*') {{2}}p {probability:.3f} {{2}}entropy \d+\.\d\d nats", head), head
    ranks = [re.fullmatch(r"(\d)\. ('.*?')\s+(\S+)", line) for line in alternatives]
    assert [match[1] for match in ranks] == ["1", "2", "3", "4", "5"], alternatives
    # Both lanes are greedy: the token is the model's first choice, with the probability it shows.
    assert ranks[0][2] == re.match(r"('.*')  p", head)[1] and float(ranks[0][3]) == pytest.approx(probability, abs=1e-3)
    # Drawn whole and on top: its last line is what the page shows at that point (the tip lets the pointer through,
    # so that it never hides the token under it: let it take the pointer for this check).
    box = tip.bounding_box()
    bottom = (box["x"] + box["width"] / 2, box["y"] + box["height"] - 4)
    assert tip.evaluate("(tip, [x, y]) => { tip.style.pointerEvents = 'auto'; "
                        "return tip.contains(document.elementFromPoint(x, y)); }", bottom)
    page.locator('#lane-b-output .lane-text .tok[data-i="0"]').focus()  # a tap focuses it
    expect(page.locator('#lane-b-output .lane-text .tok[data-i="0"] .tok-tip')).to_be_visible()
    # The probability mode shades unlikely tokens red; the tooltips stay.
    page.locator("#race-colour").get_by_text("probability").click()
    expect(page.locator('#lane-a-output .lane-text .tok[style*="239,68,68"]').first).to_be_attached(timeout=10_000)
    expect(page.locator("#lane-a-output .tok-legend")).to_contain_text("unlikely")
    assert page.locator("#lane-a-output .lane-text .tok[data-i]").count() == 16
    # The logit lens: lane A's first token, a line over the model's 30 layers and a sentence on where it forms.
    _unfold(page, "lens")
    expect(page.locator("#lens-token input")).to_have_value(re.compile(r"^0: '"))
    page.click("#lens-run")
    expect(page.locator("#lens-summary")).to_contain_text("at layer 15 gives it probability", timeout=30_000)
    expect(page.locator("#lens-chart .js-plotly-plot .scatterlayer .trace")).to_have_count(2)
    rows = _table(page, "lens-table")
    assert rows[0]["layer"] == "1" and rows[0]["rank"].isdigit()
    # The roofline: both lanes' prefill and decode as points under the device's two roofs.
    _unfold(page, "race-roofline-panel")
    page.click("#race-roofline-draw")
    expect(page.locator("#race-roofline-note")).to_contain_text("B decode", timeout=60_000)
    expect(page.locator("#race-roofline-note")).to_contain_text("A decode")
    expect(page.locator("#race-roofline .js-plotly-plot .scatterlayer .trace")).to_have_count(5)
    # The profiler: a few steps of each lane, the mean step by category as stacked bars, and both lanes' traces.
    _unfold(page, "race-profile-panel")
    page.click("#race-profile-run")
    expect(page.locator("#race-profile-note")).to_contain_text("ms a step", timeout=60_000)
    note = page.locator("#race-profile-note").inner_text()
    assert note.count("ms a step") == 2 and "A:" in note and "B:" in note and "projections" in note, note
    expect(page.locator("#race-profile-chart .js-plotly-plot .barlayer .trace").first).to_be_attached()
    expect(page.locator("#race-profile-traces a[download]")).to_have_count(2)
    page.close()
    _wait_idle(pool)
