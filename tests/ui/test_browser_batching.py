"""End-to-end: the Batching tab driven by Playwright in Debian's Chromium, served in this process over the session's
bundled model. The page is the tab alone under the playground's header (its place in `ui.build_demo` is one line in
`ui/layout.py`); Chromium is launched, and installed when missing, as `tests/ui/test_browser.py` does."""

from __future__ import annotations

import re

import gradio as gr
import pytest

from browser_setup import free_port
from ui.batching import build_batching_tab
from serving.pool import EnginePool

RUN_TIMEOUT_MS = 120_000


@pytest.fixture(scope="module")
def served(bundled, one_torch_thread):
    pool = EnginePool(bundled, max_seq_len=2048)
    with gr.Blocks(title="Batching") as demo:
        gr.Markdown("## Inference Playground\nThe header, as the playground has one above its tabs.")
        with gr.Tab("Race"):
            gr.Markdown("(the race)")
        with gr.Tab("Batching"):
            build_batching_tab(pool)
    demo.queue(max_size=8, default_concurrency_limit=1)
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    yield pool, f"http://127.0.0.1:{port}/"
    demo.close()


def _open(browser, url):
    page = browser.new_page(viewport={"width": 1440, "height": 900})
    page.goto(url)
    page.get_by_role("tab", name="Batching").click()
    page.wait_for_selector("#batching-run")
    return page


def _choose(page, elem_id: str, option: str) -> None:
    page.click(f"#{elem_id} input")
    page.get_by_role("option", name=option, exact=True).click()


def _set_number(page, elem_id: str, value: int) -> None:
    page.fill(f"#{elem_id} input[type=number]", str(value))
    page.keyboard.press("Enter")


def _until_shown(page, edit, summary: str, attempts: int = 3) -> None:
    """Make the edits until the settings' summary shows them. Right after the accordion unfolds, a number typed into
    a slider's box is now and then dropped (the page showed the default 8 requests after 3 was typed), so the edits
    are made again, up to `attempts` times, before the summary must show them."""
    from playwright.sync_api import expect

    for _ in range(attempts - 1):
        edit()
        try:
            expect(page.locator("#batching-settings")).to_contain_text(summary, timeout=3_000)
            return
        except AssertionError:
            continue
    edit()
    expect(page.locator("#batching-settings")).to_contain_text(summary)


def _results(page) -> list[dict[str, str]]:
    """The results table's rows as the page shows them, by column header (Gradio's grid: ARIA roles)."""
    table = page.locator("#batching-results")
    headers = [cell.get_attribute("title") for cell in table.locator("[role=columnheader]").all()]
    return [dict(zip(headers, (cell.inner_text().strip() for cell in row.locator("[role=gridcell]").all())))
            for row in table.locator("[role=row]").all() if row.locator("[role=gridcell]").count()]


def _legend(plot) -> list[str]:
    """A plotly figure's legend entries (SVG text: textContent, not innerText)."""
    return plot.locator(".legendtext").evaluate_all("texts => texts.map(t => t.textContent)")


def _run_until_finished(page) -> str:
    from playwright.sync_api import expect

    page.click("#batching-run")
    expect(page.locator("#batching-run")).to_be_disabled(timeout=10_000)
    expect(page.locator("#batching-status")).to_contain_text("Finished.", timeout=RUN_TIMEOUT_MS)
    expect(page.locator("#batching-run")).to_be_enabled()
    return page.locator("#batching-status").inner_text()


def test_small_continuous_run_shows_timeline_chart_and_results(served, browser):
    from playwright.sync_api import expect

    _, url = served
    page = _open(browser, url)
    # The first screen at 1440x900 holds the run controls and the timeline.
    for elem_id in ("batching-preset", "batching-mode", "batching-run", "batching-stop", "batching-settings",
                    "batching-timeline"):
        box = page.locator(f"#{elem_id}").bounding_box()
        assert box["y"] + box["height"] <= 900, (elem_id, box)
    _choose(page, "batching-mode", "continuous")
    page.locator("#batching-settings > button").first.click()  # unfold the settings

    def settings():
        _set_number(page, "batching-num-requests", 3)
        _set_number(page, "batching-max-new-tokens", 8)
        page.locator("#batching-lengths").get_by_text("max new tokens for every request").click()
        page.locator("#batching-arrival").get_by_text("all at once (burst)").click()

    _until_shown(page, settings, "Settings: 3 requests x 8 new tokens, all at once")
    status = _run_until_finished(page)
    assert "continuous batching: 3 requests, 24 output tokens" in status
    # The timeline: a row per request, with queued / prefill / decode segments and a finished mark each.
    timeline = page.locator("#batching-timeline .js-plotly-plot")
    expect(timeline).to_have_count(1)
    assert timeline.locator(".barlayer .trace").count() >= 2
    assert timeline.locator(".scatterlayer .trace .point").count() == 3  # three finished marks
    legend = _legend(timeline)
    assert "decode" in legend and "finished" in legend and "preempted (KV taken back)" not in legend
    assert page.locator("#batching-chart .js-plotly-plot .scatterlayer .trace").count() >= 4
    rows = _results(page)
    assert len(rows) == 1, rows
    assert (rows[0]["mode"], rows[0]["requests"], rows[0]["output tokens"], rows[0]["preemptions"]) == (
        "continuous", "3", "24", "0")
    assert float(rows[0]["throughput (tok/s)"]) > 0
    # The pool at its fullest, and every block back afterwards.
    assert page.locator("#batching-pool .kv-cell").count() > 0
    expect(page.locator("#batching-pool")).to_contain_text("0 blocks held (every request returned its blocks)")
    page.close()


def test_small_pool_preset_shows_preemption(served, browser):
    from playwright.sync_api import expect

    _, url = served
    page = _open(browser, url)
    _choose(page, "batching-preset", next(name for name in _presets() if name.startswith("small KV pool")))
    expect(page.locator("#batching-settings")).to_contain_text("8 requests x 16 new tokens, all at once")
    expect(page.locator("#batching-settings")).to_contain_text("KV pool 480 tokens")
    page.locator("#batching-settings > button").first.click()  # unfold: the preset set the widgets too
    expect(page.locator("#batching-arrival input[value='all at once (burst)']")).to_be_checked()
    expect(page.locator("#batching-kv-pool input")).to_have_value("480")
    _choose(page, "batching-mode", "continuous")
    status = _run_until_finished(page)
    rows = _results(page)
    assert len(rows) == 1 and rows[0]["requests"] == "8" and int(rows[0]["preemptions"]) > 0, rows
    assert re.search(r"continuous: \d+ preemptions?: the pool's 30 blocks ran out", status)
    legend = _legend(page.locator("#batching-timeline"))
    assert "preempted (KV taken back)" in legend
    assert page.locator("#batching-chart .js-plotly-plot .scatterlayer .trace .point").count() > 0  # the x marks
    expect(page.locator("#batching-pool .kv-cell")).to_have_count(30)
    page.close()


def _presets():
    from ui.batching import LAB_PRESETS

    return LAB_PRESETS
