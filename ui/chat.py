"""Multi-turn chat on one configuration, streaming, with each turn's measured numbers.

`chat_turn` is the streaming handler behind Send: it sends the whole conversation through the model's chat template
to the chat slot's engine, so a later turn's prompt starts with the earlier turns and (paged KV with the prefix
cache) reuses their KV blocks; the per-turn table (a DataFrame, sent with its column widths) shows how many prompt
tokens came from the cache. It yields, in `CHAT_OUTPUTS` order: the chat log, the conversation state, the per-turn
table, the KV view, the answer's tokens, the other answers, the input box and a status line. A turn can speculate
(the settings' draft source); the table then gives its acceptance numbers. Stop (`ui.control`) ends the turn after
the step in flight: the partial answer stays, with its row in the table (finish reason "stopped"), and the request
returns its blocks. A turn estimated to take
longer than the app's limit is refused before it starts, and one that runs over is stopped the same way.

A turn may sample several answers ("answers per turn (n)", `ui.chat_answers`): the conversation keeps the first, the
others are shown beside it, and the KV view shows the prompt's blocks shared by all of them. Once a turn has ended, its
answer is drawn token by token, each token with its probability and the top alternatives on hover or tap (the
visitor's `ChatMemory`, which the colour mode's radio redraws).
"""

from __future__ import annotations

import html
import logging
import time

import gradio as gr
import pandas as pd

from inference_core.config import ConfigError
from inference_core.engine.request import FinishEvent
from serving.admission import Job, Run
from serving.cost import duration
from serving.pool import EnginePool
from ui.control import RunControl, caller_of
from ui.chat_answers import (CHAT_SAMPLING, TOKENS_EMPTY, TOKENS_WAITING, ChatMemory, TurnAnswers, check_answers,
                             others_html, tokens_html)
from ui.race import PANEL_REFRESH_S, TEXT_REFRESH_S, WAIT_NOTE_S, settings_from_values
from ui.words import PAGE_WORDS, refusal, waiting_note

CHAT_OUTPUTS = ("chat_log", "history", "turn_stats", "stats_table", "kv_view", "tokens", "other_answers", "input",
                "status")
# The configuration last: it is long text, and a phone then shows a turn's first numbers before it.
STATS_COLUMNS = ("turn", "prompt tokens", "from prefix cache", "TTFT (ms)", "decode tokens/s", "tokens generated",
                 "finish reason", "configuration")
# Column widths in pixels: without them the table sizes its columns by their text, and the configuration's took so
# much that "turn" broke letter by letter at 1440 px. These fit 1440 px (920 px, or 1176 px with "drafts accepted");
# on a phone the table scrolls sideways with the turn column pinned.
STATS_WIDTHS = {"turn": 60, "configuration": 240, "drafts accepted": 300}
NUMBER_WIDTH = 96  # each number column: its header on two lines at most
# The table's label, also what the empty table says.
STATS_LABEL = "Each turn's numbers appear here: TTFT, decode tokens/s and prompt tokens reused from the prefix cache"
CHAT_WORDS = {**PAGE_WORDS, "longer_context": " (or press 'New chat')", "answers": "'answers per turn (n)'"}
log = logging.getLogger(__name__)


def _acceptance_cell(spec: dict | None) -> str:
    """A turn's speculation: drafts accepted, tokens per verification step, and draft / verify time."""
    if spec is None:
        return "-"
    if not spec["drafted"]:
        return "nothing drafted"
    return (f"{spec['acceptance_rate']:.0%} ({spec['accepted']} of {spec['drafted']}), "
            f"{spec['mean_accepted_length']:.2f} tokens/step, draft {spec['draft_ms']:.0f} ms / verify "
            f"{spec['verify_ms']:.0f} ms")


def stats_frame(turn_stats: list[dict]) -> pd.DataFrame:
    """The per-turn table: a row per turn, rounded as the status line rounds; with a "drafts accepted" column (before
    the configuration) when a turn speculated. No turns: the headers alone."""
    speculated = any(row.get("spec") for row in turn_stats)
    columns = STATS_COLUMNS[:-1] + (("drafts accepted",) if speculated else ()) + STATS_COLUMNS[-1:]
    rows = [[row["turn"], row["prompt_tokens"], row["cached_prompt_tokens"], round(row["ttft_ms"]),
             round(row["decode_tokens_per_s"], 1), row["generated_tokens"], row["finish_reason"]]
            + ([_acceptance_cell(row.get("spec"))] if speculated else []) + [row["config"]] for row in turn_stats]
    return pd.DataFrame(rows, columns=list(columns), dtype=object)


def stats_table(turn_stats: list[dict]) -> dict:
    """The per-turn table as the page's update: `stats_frame` with a width per column, the turn column pinned."""
    frame = stats_frame(turn_stats)
    widths = [f"{STATS_WIDTHS.get(column, NUMBER_WIDTH)}px" for column in frame.columns]
    return gr.update(value=frame, column_widths=widths, pinned_columns=1)


def frame(**values) -> tuple:
    """One update in CHAT_OUTPUTS order; outputs not named are left as they are."""
    return tuple(values.get(name, gr.skip()) for name in CHAT_OUTPUTS)


def _shared_note(stats, answers: int) -> str:
    """How many requests this turn's steps served on average, when it was not alone (its own other answers, when it
    sampled several, and other requests)."""
    if stats.batch_size_mean <= 1.0:
        return ""
    who = "other requests" if answers == 1 else f"this turn's other answer{'s' if answers > 2 else ''}" + (
        " and other requests" if stats.batch_size_mean > answers else "")
    return (f" Its steps were shared with {who} (mean batch {stats.batch_size_mean:.1f} sequences), so its times "
            "include theirs.")


def chat_turn(pool: EnginePool, control: RunControl | None, message: str, history: list[dict],
              turn_stats: list[dict], system: str, max_new_tokens, *setting_values, answers=1,
              memory: ChatMemory | None = None):
    """Streaming handler. `control`: the visitor's Stop switch (None: no Stop); `setting_values`: the chat's
    settings widgets' values, in `ui.race.LANE_SETTING_FIELDS` order; `answers`: answers per turn (n); `memory`:
    the visitor's latest turn (its colour mode, read when the turn ends, and where the answers are kept)."""
    control = control if control is not None else RunControl()
    memory = memory if memory is not None else ChatMemory()
    try:
        yield from _turn(pool, control, memory, message, history, turn_stats, system, max_new_tokens,
                         setting_values, answers)
    finally:
        control.end()


def run_remembered_chat(pool: EnginePool, control: RunControl | None, memory: ChatMemory, message: str,
                        history: list[dict], turn_stats: list[dict], system: str, max_new_tokens, answers,
                        *setting_values):
    """Send's handler: `chat_turn` with the visitor's `ChatMemory` (a gr.State) and the answers per turn as inputs."""
    yield from chat_turn(pool, control, message, history, turn_stats, system, max_new_tokens, *setting_values,
                         answers=answers, memory=memory)


def chat_job(control: RunControl, message: str, history: list[dict], system: str, max_new_tokens,
             setting_values, answers=1) -> Job:
    """The turn as the admission path takes it: the whole conversation on the chat's slot, `answers` copies."""
    settings = settings_from_values(setting_values)
    copies = check_answers(answers, settings)
    if not (message or "").strip():
        raise ConfigError("the message is empty; type something first.")
    conversation = ([{"role": "system", "content": system.strip()}] if (system or "").strip() else []) \
        + history + [{"role": "user", "content": message}]
    return Job("turn", {"chat": ("chat", settings)}, (conversation,), max_new_tokens=int(max_new_tokens),
               copies=copies, sampling=CHAT_SAMPLING, caller=control.caller, cache_salt=control.visitor,
               keep_final_kv_snapshot=True)  # the KV view's picture at the first answer's last token


def _turn(pool: EnginePool, control: RunControl, memory: ChatMemory, message: str, history: list[dict],
          turn_stats: list[dict], system: str, max_new_tokens, setting_values, answers):
    history, turn_stats = list(history or []), list(turn_stats or [])
    if control.stop_requested:  # Stop was pressed while the turn waited for the device
        yield frame(status="Stopped before the turn started: nothing ran.")
        return
    try:
        run = pool.submit(chat_job(control, message, history, system, max_new_tokens, setting_values, answers))
    except ConfigError as error:  # bad settings or message, or too much work: say what to change on the page
        yield frame(status=f"**Cannot send:** {refusal(error, CHAT_WORDS)}")
        return
    except (ValueError, TypeError) as error:
        yield frame(status=f"**Cannot send:** {error}")
        return
    try:
        for _ in run.to_compile():
            yield frame(status="Compiling the decode step, once for these settings (a minute or two on a CPU; a "
                               "second start loads it from the disk cache in seconds)...")
            run.compile("chat")
        history = history + [{"role": "user", "content": message}, {"role": "assistant", "content": ""}]
        memory.answers = None  # the colour mode's radio leaves the panels alone until this turn ends
        yield frame(chat_log=history, history=history, turn_stats=turn_stats, tokens=TOKENS_WAITING,
                    other_answers="", input="", status="Generating...")
        pool.settle_before_timed_work()
        # Through the shared engine loop: other visitors' turns on the same configuration share its steps. The same
        # Stop and time-limit handling as the race's lanes (stop after the step in flight).
        run.start()
        yield from _stream(pool, run, control, memory, history, turn_stats)
    except Exception as error:  # the page gets a message, the log gets the traceback
        log.exception("chat turn failed")
        yield frame(status=f"**The model failed:** {type(error).__name__}: {html.escape(str(error))}")
    finally:
        run.close()


def _stream(pool: EnginePool, run: Run, control: RunControl, memory: ChatMemory, history: list[dict],
            turn_stats: list[dict]):
    """The answers as they stream (the first in the chat log, the others beside it), the KV view twice a second,
    and once every answer has ended: the turn's row in the table and the answers token by token."""
    answers = TurnAnswers(run)
    last_text, last_kv = time.perf_counter(), 0.0
    for handle, event in run.events(should_stop=lambda: control.stop_requested, heartbeat_s=WAIT_NOTE_S):
        if handle is None:  # nothing for a while: say what the turn waits for
            if not any(answers.texts):
                yield frame(status=waiting_note(pool, run.engines.values()))
            continue
        answers.add(handle, event)
        now = time.perf_counter()
        if isinstance(event, FinishEvent) or now - last_text < TEXT_REFRESH_S:
            continue
        last_text = now
        history[-1] = {"role": "assistant", "content": answers.texts[0]}
        update = {}
        if now - last_kv >= PANEL_REFRESH_S:
            update["kv_view"], last_kv = answers.live_kv(pool), now
        if answers.count > 1:
            update["other_answers"] = others_html(answers.trails, answers.texts, memory.mode, ended=False)
        yield frame(chat_log=history, history=history, **update)
    final = answers.finished[0]
    if final is None:  # the kept answer never ended (an external engine's stream broke off): nothing to add
        return
    history[-1] = {"role": "assistant", "content": final.text}
    turn_stats = turn_stats + [_turn_row(len(turn_stats) + 1, run.job.lanes["chat"][1], final.stats)]
    memory.answers = answers.trails
    yield frame(chat_log=history, history=history, turn_stats=turn_stats, stats_table=stats_table(turn_stats),
                kv_view=answers.final_kv(pool), tokens=tokens_html(memory),
                other_answers=others_html(answers.trails, answers.texts, memory.mode, ended=True),
                status=_turn_status(pool, run, turn_stats, final.stats) + answers.note())


def _turn_row(turn: int, settings, stats) -> dict:
    return {"turn": turn, "config": settings.describe(), "prompt_tokens": stats.prompt_tokens,
            "cached_prompt_tokens": stats.cached_prompt_tokens, "ttft_ms": stats.ttft_ms,
            "decode_tokens_per_s": stats.decode_tokens_per_s, "generated_tokens": stats.generated_tokens,
            "finish_reason": stats.finish_reason, "spec": stats.spec}


def _turn_status(pool: EnginePool, run: Run, turn_stats: list[dict], stats) -> str:
    status = (f"Turn {len(turn_stats)}: {stats.cached_prompt_tokens} of {stats.prompt_tokens} prompt tokens from the "
              f"prefix cache, TTFT {stats.ttft_ms:.0f} ms, {stats.decode_tokens_per_s:.1f} tok/s.")
    if stats.finish_reason == "stopped":
        why = f" at this app's limit of {duration(pool.max_run_s)} per turn" if run.over_limit() else ""
        status = f"Stopped{why} after {stats.generated_tokens} tokens; its KV blocks were returned. " + status
    if stats.spec and stats.spec["drafted"]:
        status += f" {stats.spec['acceptance_rate']:.0%} of drafts accepted."
    if note := pool.serving_note(run.job.lanes["chat"][1]):  # the default settings, their compiled steps not built
        status += f" Compiled decode: {note}."
    return status + _shared_note(stats, len(run.requests.get("chat", ())) or 1)


def arm_chat(control: RunControl, request: gr.Request):
    """Send, before the turn is queued: arm the visitor's Stop (noting who the visitor is, for the deployment's
    per-caller limits)."""
    control.arm(caller_of(request))
    return "Waiting for the device..."


def stop_chat(control: RunControl) -> None:
    """Stop: the turn ends after the step in flight and sends its final update itself."""
    control.request_stop()


def clear_chat(memory: ChatMemory | None = None):
    """New chat: an empty conversation, table, KV view and answers' panels."""
    if memory is not None:
        memory.answers = None
    return [], [], [], stats_table([]), "", TOKENS_EMPTY, "", "New conversation."
