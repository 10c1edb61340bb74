"""The soak's browser visitors: pages in one headless Chromium (Debian's, driven by Playwright) that race and chat
as a person would, each action timed from the click to the first text and to the final status, read in the page every
POLL_MS. A racer races with short answers in its own setup; a chatter holds conversations of a few turns, then starts
a new chat. Each finished action's panels are checked (`checks.race_problem`, `checks.turn_problem`) and its tokens
generated read from the page's table, so its bound can be scaled to the length of its reply.
"""

from __future__ import annotations

import itertools
import time

from server.soak.checks import Action, lane_figures, race_problem, race_tokens, turn_problem, turn_tokens

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-background-timer-throttling", "--disable-renderer-backgrounding",
                 "--disable-backgrounding-occluded-windows"]  # every visitor's page keeps its timers running
RACE_SETUPS = ("paged KV cache vs no KV cache", "prefix cache on vs off, shared system prompt")  # racer i: i % 2
CHAT_MESSAGES = ("Name three primary colours.", "Which of them is warmest?", "Write one sentence about it.",
                 "Now say it as a short poem.")
ACTION_TIMEOUT_MS = 300_000
POLL_MS = 100  # the page is polled this often for the moments the soak measures
FINAL_RACE = r"^(Finished|Stopped|Cannot start the race|The race failed)"
FINAL_CHAT = r"^(Turn \d+:|Stopped|Cannot send|The model failed)"
# JS: note whether an element changed since now (the status a run ends with can read as the last run's did).
WATCH = """sel => { window.__soak = {changed: false}; new MutationObserver(() => { window.__soak.changed = true; })
    .observe(document.querySelector(sel), {subtree: true, childList: true, characterData: true}); }"""
RACE_FIRST = """re => { const lanes = [...document.querySelectorAll('#lane-a-output .lane, #lane-b-output .lane')];
    const text = lanes.some(l => l.dataset.done === 'false' && l.querySelector('.lane-text').innerText.trim());
    const status = document.querySelector('#race-status').innerText.trim();
    if (text || (window.__soak.changed && new RegExp(re).test(status))) return Date.now(); }"""
RACE_END = """re => { const status = document.querySelector('#race-status').innerText.trim();
    if (window.__soak.changed && new RegExp(re).test(status) && !document.querySelector('#race-run').disabled)
        return Date.now(); }"""
CHAT_FIRST = """([bots, re]) => { const shown = document.querySelectorAll('#chat-log [data-testid=bot]');
    const status = document.querySelector('#chat-status').innerText.trim();
    if ((shown.length > bots && shown[shown.length - 1].innerText.trim())
        || (window.__soak.changed && new RegExp(re).test(status) && !status.startsWith('Turn'))) return Date.now(); }"""
CHAT_END = """re => { const status = document.querySelector('#chat-status').innerText.trim();
    if (window.__soak.changed && new RegExp(re).test(status)) return Date.now(); }"""
TABLE = """id => { const table = document.querySelector('#' + id);
    const headers = [...table.querySelectorAll('[role=columnheader]')].map(c => c.getAttribute('title') || c.innerText);
    const rows = [...table.querySelectorAll('[role=row]')].map(r => [...r.querySelectorAll('[role=gridcell]')]
        .map(c => c.innerText.trim())).filter(r => r.length && r.some(c => c));
    return {headers: headers.map(h => h.trim()), rows}; }"""
CHAT_SHOWN = """() => { const texts = s => [...document.querySelectorAll(s)].map(e => e.innerText.trim());
    return {users: texts('#chat-log [data-testid=user]'), bots: texts('#chat-log [data-testid=bot]'),
            status: document.querySelector('#chat-status').innerText.trim()}; }"""


class Clock:
    """Seconds since the run began, on the wall clock the page's Date.now() also reads."""

    def __init__(self):
        self.t0 = time.time()

    def since(self, wall_s: float) -> float:
        return round(wall_s - self.t0, 3)


async def open_visitor(browser, url: str, tab: str):
    context = await browser.new_context(viewport={"width": 1400, "height": 1000})
    page = await context.new_page()
    await page.goto(url)
    await page.wait_for_selector("#race-run", timeout=120_000)
    if tab == "Chat":
        await page.get_by_role("tab", name="Chat").click()
    return page


async def set_up_racer(page, setup: str, max_new_tokens: int) -> None:
    """Pick the setup (both lanes and, for some, the prompt), then the short answer length."""
    await page.click("#race-setup input")
    await page.get_by_role("option", name=setup, exact=True).click()
    await page.wait_for_timeout(500)  # the setup's quick update sets the lanes and the prompt
    await page.locator("#race-options > button").first.click()
    await page.fill("#race-max-new-tokens input[type=number]", str(max_new_tokens))
    await page.keyboard.press("Enter")


async def set_up_chatter(page, max_new_tokens: int) -> None:
    await page.get_by_text("Chat settings").click()
    await page.fill("input[aria-label='number input for max new tokens']:visible", str(max_new_tokens))
    await page.keyboard.press("Enter")


async def race_once(page, action: Action, clock: Clock, max_new_tokens: int) -> Action:
    """Run one race and time it: the wait to the first lane text, the end at the final status."""
    await page.evaluate(WATCH, "#race-status")
    start = time.time()
    action.started_s = clock.since(start)
    await page.click("#race-run")
    first = await page.wait_for_function(RACE_FIRST, arg=FINAL_RACE, polling=POLL_MS, timeout=ACTION_TIMEOUT_MS)
    end = await page.wait_for_function(RACE_END, arg=FINAL_RACE, polling=POLL_MS, timeout=ACTION_TIMEOUT_MS)
    first_ms, end_ms = await first.json_value(), await end.json_value()
    status = (await page.locator("#race-status").inner_text()).strip()
    action.e2e_s = round(end_ms / 1e3 - start, 3)
    if status.startswith("Cannot start the race"):
        action.outcome, action.note = "refused", status[:300]
        return action
    action.wait_s = round(first_ms / 1e3 - start, 3)
    texts = [await page.locator(f"#lane-{lane}-output .lane-text").inner_text() for lane in "ab"]
    table = await page.evaluate(TABLE, "race-summary")
    figures = lane_figures(table["headers"], table["rows"])
    action.tokens = race_tokens(figures)
    problem = race_problem(status, texts, figures, max_new_tokens)
    if problem:
        action.outcome, action.note = "problem", problem
    return action


async def turn_once(page, action: Action, clock: Clock, turn: int, message: str) -> Action:
    """Send one chat message and time it: the wait to the reply's first text, the end at the turn's status."""
    bots = await page.locator("#chat-log [data-testid=bot]").count()
    await page.evaluate(WATCH, "#chat-status")
    await page.fill("#chat-input textarea", message)
    start = time.time()
    action.started_s = clock.since(start)
    await page.click("#chat-send")
    first = await page.wait_for_function(CHAT_FIRST, arg=[bots, FINAL_CHAT], polling=POLL_MS,
                                         timeout=ACTION_TIMEOUT_MS)
    end = await page.wait_for_function(CHAT_END, arg=FINAL_CHAT, polling=POLL_MS, timeout=ACTION_TIMEOUT_MS)
    first_ms, end_ms = await first.json_value(), await end.json_value()
    action.e2e_s = round(end_ms / 1e3 - start, 3)
    await page.wait_for_timeout(POLL_MS)  # the turn's last update carries its row; let the table draw it
    shown = await page.evaluate(CHAT_SHOWN)
    if shown["status"].startswith("Cannot send"):
        action.outcome, action.note = "refused", shown["status"][:300]
        return action
    action.wait_s = round(first_ms / 1e3 - start, 3)
    table = await page.evaluate(TABLE, "chat-stats")
    action.tokens = turn_tokens(table["headers"], table["rows"])
    problem = turn_problem(turn, message, shown, table["rows"])
    if problem:
        action.outcome, action.note = "problem", problem
    return action


async def new_chat(page) -> None:
    await page.get_by_role("button", name="New chat").click()
    await page.wait_for_function("() => !document.querySelector('#chat-log [data-testid=user]')", polling=POLL_MS,
                                 timeout=30_000)


async def timed(coroutine, action: Action) -> Action:
    """An action that timed out or lost its page is a problem, recorded, not a crash."""
    try:
        return await coroutine
    except Exception as error:  # Playwright's timeouts and errors
        action.outcome, action.note = "problem", f"{type(error).__name__}: {str(error)[:300]}"
        return action


async def racer(page, name: str, clock: Clock, until: float, max_new_tokens: int, actions: list[Action],
                phase: str) -> None:
    """Race again and again until `until` (time.monotonic()); in the solo phase, once."""
    while True:
        action = Action(name, "race", phase, name, 0.0)
        actions.append(await timed(race_once(page, action, clock, max_new_tokens), action))
        if phase == "solo" or time.monotonic() >= until:
            return


async def chatter(page, name: str, clock: Clock, until: float, turns: int, actions: list[Action],
                  phase: str) -> None:
    """Conversations of `turns` turns (a new chat after each) until `until`; in the solo phase, one."""
    for count in itertools.count():
        turn = count % turns + 1
        action = Action(name, "turn", phase, f"{name} turn {turn}", 0.0)
        actions.append(await timed(turn_once(page, action, clock, turn, CHAT_MESSAGES[count % len(CHAT_MESSAGES)]),
                                   action))
        done = (phase == "solo" and turn == turns) or (phase == "soak" and time.monotonic() >= until)
        if turn == turns or action.outcome != "finished" or done:
            await timed(new_chat(page), action)  # a failed turn leaves the log as it was: start afresh
        if done:
            return


async def open_visitors(browser, url: str, args) -> tuple[list, list]:
    racers = [await open_visitor(browser, url, "Race") for _ in range(args.racers)]
    for index, page in enumerate(racers):
        await set_up_racer(page, RACE_SETUPS[index % len(RACE_SETUPS)], args.race_max_new_tokens)
    chatters = [await open_visitor(browser, url, "Chat") for _ in range(args.chatters)]
    for page in chatters:
        await set_up_chatter(page, args.chat_max_new_tokens)
    return racers, chatters


