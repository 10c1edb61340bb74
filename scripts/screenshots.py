"""Screenshots of the playground's four tabs at a laptop's size (1440x900) and a phone's (390x844): the pictures in
docs/screenshots, taken to check that every table and chart reads at both sizes.

Start the app first (`python app.py --port 7861`, about a minute to warm up), then run
`python scripts/screenshots.py [URL] [--out docs/screenshots]`. In one page at 1440x900 it runs a short race, a chat
turn, a batching-lab run (the first preset) and a Stack climb (16 tokens a rung, no compiled rungs), and after each
takes the tab from the top down to its last table or chart, then again with the viewport at 390x844, as
<tab>-<width>.png. Pictures over MAX_BYTES are saved with a 256-colour palette. Needs Playwright and Debian's chromium.
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

from PIL import Image
from playwright.sync_api import expect, sync_playwright

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from browser_setup import CHROMIUM_ARGS  # noqa: E402  (the tests' browser flags)

SIZES = ((1440, 900), (390, 844))
MAX_BYTES = 300_000
RUN_TIMEOUT_MS = 600_000


def save(page, path: Path, last_elem_id: str) -> None:
    """The page from its top to the bottom of `#last_elem_id`, as a PNG under MAX_BYTES where a palette allows."""
    page.wait_for_timeout(1500)  # charts and tables re-lay out after a resize
    box = page.locator(f"#{last_elem_id}").bounding_box()
    width = page.viewport_size["width"]
    scroll_y = page.evaluate("window.scrollY")
    shot = page.screenshot(full_page=True, clip={"x": 0, "y": 0, "width": width, "height": box["y"] + scroll_y
                                                  + box["height"] + 16})
    image = Image.open(io.BytesIO(shot))
    if len(shot) > MAX_BYTES:
        image = image.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    image.save(path, optimize=True)
    print(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}: {path.stat().st_size // 1000} KB")


def both_sizes(page, out: Path, name: str, last_elem_id: str) -> None:
    for width, height in SIZES:
        page.set_viewport_size({"width": width, "height": height})
        save(page, out / f"{name}-{width}.png", last_elem_id)
    page.set_viewport_size({"width": SIZES[0][0], "height": SIZES[0][1]})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url", nargs="?", default="http://127.0.0.1:7861/")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "screenshots")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": SIZES[0][0], "height": SIZES[0][1]})
        page.goto(args.url)
        page.wait_for_selector("#race-run")
        # Race: 32 tokens a lane (lane B has no KV cache), then the numbers under the chart.
        page.locator("#race-options > button").first.click()
        page.fill("#race-max-new-tokens input[type=number]", "32")
        page.keyboard.press("Enter")
        page.click("#race-run")
        expect(page.locator("#race-status")).to_contain_text("Finished.", timeout=RUN_TIMEOUT_MS)
        both_sizes(page, args.out, "race", "race-summary-notes")
        # Chat: one turn, its row in the stats table.
        page.get_by_role("tab", name="Chat").click()
        page.fill("#chat-input textarea", "Name three primary colours.")
        page.click("#chat-send")
        expect(page.locator("#chat-stats [role=row]")).to_have_count(2, timeout=RUN_TIMEOUT_MS)
        both_sizes(page, args.out, "chat", "chat-stats")
        # Batching: the first preset in its default mode, the results table and the activity chart.
        page.get_by_role("tab", name="Batching").click()
        page.click("#batching-run")
        expect(page.locator("#batching-status")).to_contain_text("Finished.", timeout=RUN_TIMEOUT_MS)
        both_sizes(page, args.out, "batching", "batching-chart")
        # Stack: every rung but the compiled ones (a compile takes minutes on a CPU), 16 tokens each.
        page.get_by_role("tab", name="Stack").click()
        compiled = page.get_by_role("checkbox", name="compiled rungs")
        if compiled.is_enabled() and compiled.is_checked():
            compiled.uncheck()
        page.get_by_label("number input for new tokens per rung").fill("16")
        page.keyboard.press("Enter")
        page.click("#stack-run")
        expect(page.locator("#stack-status")).to_contain_text("Finished:", timeout=RUN_TIMEOUT_MS)
        both_sizes(page, args.out, "stack", "stack-table")
        browser.close()


if __name__ == "__main__":
    main()
