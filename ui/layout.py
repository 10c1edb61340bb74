"""Layout of the playground: `build_demo` creates the Race and Chat tabs and wires every listener at the bottom;
`warm_up` readies the engines the page's first race will use before the app serves.

Element ids that tests and scripts rely on: race-setup, race-setup-about, race-prompt, race-run, race-stop,
lane-a-output, lane-b-output, race-chart, race-acceptance, race-summary (a table, a row per figure),
race-summary-notes (the speed-up line and notes under it), race-identical, kv-view, race-colour (the lanes' colour
mode), lens (the logit lens's accordion, with lens-lane, lens-token, lens-run, lens-summary, lens-chart and
lens-table), race-roofline-panel (race-roofline-draw, race-roofline-note, race-roofline), race-memory-panel
(race-memory-draw, race-memory-note, race-memory-table), chat-input, chat-send, chat-stop, chat-log (plus
race-status, chat-status, chat-stats (a table, a row per turn), chat-kv-view), chat-answers (answers per turn),
chat-colour (the colour mode of chat-tokens, the latest answer token by token, a tooltip per token) and
chat-other-answers (a turn's answers after the first).
Each settings group has ids with its prefix (lane-a, lane-b, chat): -kv, -block-size, -prefix-cache, -temperature,
-top-p, -seed, -spec (the draft source), -spec-k, -spec-layers, and -sampling (the folded sampling and constraint
settings). A setting that does not apply to the chosen mode is disabled (block size and prefix cache without the
paged cache, top-p and seed when greedy) or hidden (draft length without a draft source, the early-exit depth for
other sources). Every generation hands its requests to the pool's one engine loop
(`inference_core.engine.loop`), which owns the device: a second tab's requests are batched with the first's where
they share a configuration, and take turns with them step by step where they do not.

The app's API for programs is the `race` and `chat` endpoints of `ui.api`; every event of the page itself is private
(`api_visibility="private"`: not listed, not callable with `gradio_client`). Tables are DataFrames (sortable, with
a copy button).
"""

from __future__ import annotations

from functools import partial

import gradio as gr
import pandas as pd

from inference_core import SamplingParams
from inference_core.engine.compiled import compile_unavailable
from inference_core.settings import LaneSettings
from serving.cost import duration, new_tokens_that_fit
from serving.pool import EnginePool
from serving.zero_gpu import gpu_task, on_zero_gpu
from ui.api import add_api
from ui.batching import build_batching_tab
from ui.chat import (CHAT_OUTPUTS, STATS_LABEL, arm_chat, chat_job, clear_chat, run_remembered_chat, stats_frame,
                     stop_chat)
from ui.chat_answers import DEFAULT_MODE, MAX_ANSWERS, TOKENS_EMPTY, ChatMemory, recolour_chat
from ui.control import RunControl
from ui.figures import speed_figure
from ui.lane_widgets import settings_widgets
from ui.memory_view import build_memory_panel
from ui.profile_view import build_profile_panel, profile_race
from ui.race import (LANE_SETTING_FIELDS, RACE_OUTPUTS, arm_race, race_job, run_remembered_race, settings_from_values,
                     stop_race, warm_up_race)
from ui.race_inspect import build_lens_panel, lens_choices, recolour
from ui.race_panels import RaceMemory
from ui.race_table import SUMMARY_COLUMNS
from ui.roofline_view import build_roofline_panel
from ui.session_state import keep_replacement_ids
from ui.setups import DEFAULT_LANES, RACE_SETUPS, presets, setup_values
from ui.stack import build_stack_tab
from ui.token_view import COLOUR_MODES, TOKEN_CSS

MAX_PROMPT_CHARS = 20_000
DEFAULT_NEW_TOKENS = 128  # the race's and the chat's starting 'max new tokens'
# Races, chat turns and lab runs only hand requests to the one engine loop and stream what it sends back, so many may
# be in flight at once: requests on one configuration share its steps (batched), configurations take turns.
GENERATION = {"concurrency_limit": 8, "concurrency_id": "engine"}
PRIVATE = {"api_visibility": "private"}  # the page's own events: not part of the API (see ui.api)
QUICK = {"queue": False, "show_progress": "hidden", **PRIVATE}
TABLE = {"interactive": False, "wrap": True, "buttons": ["copy", "fullscreen"]}  # read-only; columns sort


def _stop_cancels(events: list) -> dict:
    """Stop's fallback under `spaces.GPU`: the handler runs in another process, where the visitor's RunControl is a
    copy that Stop cannot reach, so Stop cancels the event (ending it without a final update) instead."""
    return {"cancels": events} if on_zero_gpu() else {}


def warm_up(pool: EnginePool) -> None:
    """Before serving: check the draft model, if any; run the default race once on the engines the page's first race
    uses, with the first preset prompt (see `ui.race.warm_up_race`); ready the chat's engine. Not on a ZeroGPU Space,
    whose main process has no GPU and whose calls each start a fresh worker (`serving.zero_gpu`): there a draft
    model the engine refuses says so at its first use."""
    if on_zero_gpu():
        return
    pool.check_draft_model()
    first = next(iter(presets().values()))
    warm_up_race(pool, DEFAULT_LANES, first["prompt"], first.get("system"))
    pool.get("chat", pool.runnable(pool.serving)).complete("Hello", SamplingParams(max_new_tokens=4))


def available_setups(pool: EnginePool) -> list[str]:
    """The race setups this device can run: those with a compiled lane only where compilation is available, with
    quantized weights only where quantization runs, with trained draft heads only where this model has them."""
    can_compile = compile_unavailable(pool.loaded.device) is None
    schemes, methods = pool.weight_schemes(), pool.spec_methods()
    return [name for name, setup in RACE_SETUPS.items()
            if (can_compile or not any(lane.compile for lane in setup.lanes.values()))
            and all(lane.weights in schemes and lane.spec_method in methods for lane in setup.lanes.values())]


def _build_race_tab(pool: EnginePool) -> None:
    """The first screen (1440x900) holds the setup, the prompt with Run and Stop, each lane's settings folded into a
    one-line summary, both lanes' streaming text and the tokens/s chart; the numbers and the KV view follow below."""
    prompts = presets()
    first = next(iter(prompts.values()))
    default_setup = next(iter(RACE_SETUPS))
    control = gr.State(RunControl())
    memory = gr.State(RaceMemory())  # the visitor's last race: its colour mode and finished traces
    with gr.Row(equal_height=True):
        setup = gr.Dropdown(available_setups(pool), value=default_setup, label="Race setup (sets both lanes)",
                            elem_id="race-setup", scale=3)
        preset = gr.Dropdown(list(prompts), value=next(iter(prompts)), label="Preset prompt (chat, code, grounded, "
                             "long, shared-prefix)", scale=2)
        # Redraws finished lanes at once (the visitor's RaceMemory keeps their traces); a running race follows it.
        colour = gr.Radio([(label, mode) for mode, label in COLOUR_MODES.items()], value="draft", scale=2,
                          label="Colour the lanes' text by", elem_id="race-colour")
    about = gr.Markdown(RACE_SETUPS[default_setup].about, elem_id="race-setup-about")
    with gr.Row(equal_height=True):
        prompt = gr.Textbox(first["prompt"], lines=2, max_lines=8, label="Prompt", elem_id="race-prompt",
                            max_length=MAX_PROMPT_CHARS, scale=5)
        with gr.Column(scale=1, min_width=160):
            run = gr.Button("Run race", variant="primary", elem_id="race-run")
            stop = gr.Button("Stop", variant="stop", elem_id="race-stop")
    lane_widgets, lane_folds = {}, {}
    with gr.Row(equal_height=False):
        for name, defaults in DEFAULT_LANES.items():
            with gr.Column(), gr.Accordion(_lane_summary(name, defaults), open=False,
                                           elem_id=f"lane-{name.lower()}-settings") as fold:
                lane_widgets[name] = settings_widgets(pool, defaults, f"Lane {name}", f"lane-{name.lower()}")
            lane_folds[name] = fold
        start_tokens, start_note = _start_tokens(pool, first)
        with gr.Column(), gr.Accordion(f"System message and length: up to {start_tokens} new tokens per lane",
                                       open=False, elem_id="race-options") as options:
            system = gr.Textbox(first.get("system", ""), lines=1, label="System message (optional)")
            max_new_tokens = gr.Slider(8, 512, value=start_tokens, step=8, label="max new tokens (per lane)",
                                       elem_id="race-max-new-tokens")
    lanes = lane_widgets["A"] + lane_widgets["B"]
    status = gr.Markdown("Both lanes run the same prompt on one device, taking turns step by step so that each gets "
                         "an equal share of device time; each lane is timed by its own steps only. A race may use "
                         f"up to {duration(pool.max_run_s)} of device time.{start_note}", elem_id="race-status")
    with gr.Row(equal_height=False):
        # Side by side on a laptop; on a phone each takes the width (a row wraps children past their min_width).
        # A finished lane's tokens show their probabilities on hover or tap (CSS-only tooltips, `ui.token_view`).
        lane_a = gr.HTML("<b>Lane A</b>", elem_id="lane-a-output", min_width=320, css_template=TOKEN_CSS)
        lane_b = gr.HTML("<b>Lane B</b>", elem_id="lane-b-output", min_width=320, css_template=TOKEN_CSS)
        # Drawn at page load, so the browser has its plotting code ready before the first race starts.
        chart = gr.Plot(speed_figure({}), label="tokens/s over each lane's own device time", elem_id="race-chart",
                        min_width=320)
    lens_lane, lens_token = build_lens_panel(memory, TABLE, {**GENERATION, **PRIVATE})
    build_roofline_panel(pool, memory, {**GENERATION, **PRIVATE})
    build_profile_panel("Profile: where a step of each lane goes", "race", partial(profile_race, pool), [memory],
                        {**GENERATION, **PRIVATE})
    build_memory_panel(pool, memory, TABLE, {**GENERATION, **PRIVATE})
    summary = gr.DataFrame(pd.DataFrame(columns=SUMMARY_COLUMNS), label="Each lane's measured numbers",
                           elem_id="race-summary", column_widths=["36%", "32%", "32%"], max_height=1200, **TABLE)
    with gr.Row(equal_height=False):
        summary_notes = gr.HTML(elem_id="race-summary-notes")
        with gr.Column():
            identical = gr.HTML(elem_id="race-identical")
            acceptance = gr.Plot(label="speculative decoding: share of drafts accepted", elem_id="race-acceptance",
                                 visible=False)
    kv_view = gr.HTML(elem_id="kv-view")

    for name, widgets in lane_widgets.items():  # each folded lane says its settings in one line
        for widget in widgets:
            widget.change(partial(_lane_summary_update, name), widgets, lane_folds[name], **QUICK)
    max_new_tokens.change(lambda n: gr.update(label=f"System message and length: up to {int(n)} new tokens per "
                                                    "lane"), max_new_tokens, options, **QUICK)
    preset.change(lambda key: (prompts[key]["prompt"], prompts[key].get("system", "")), preset, [prompt, system],
                  **QUICK)
    setup.change(lambda name: setup_values(RACE_SETUPS[name], prompts, LANE_SETTING_FIELDS), setup,
                 [preset, prompt, system, about] + lanes, **QUICK)
    outputs = {"lane_a": lane_a, "lane_b": lane_b, "chart": chart, "acceptance": acceptance, "summary": summary,
               "summary_notes": summary_notes, "identical": identical, "kv_view": kv_view, "status": status,
               "run_button": run}
    race = run.click(arm_race, control, [status, run], **QUICK).then(
        gpu_task(pool, partial(run_remembered_race, pool), _race_job),
        [control, memory, prompt, system, max_new_tokens] + lanes,
        [outputs[name] for name in RACE_OUTPUTS], show_progress="hidden", **GENERATION, **PRIVATE)
    race.then(lens_choices, [memory, lens_lane], lens_token, **QUICK)
    colour.change(recolour, [memory, colour], [lane_a, lane_b], **QUICK)
    stop.click(stop_race, control, None, **QUICK, **_stop_cancels([race]))


def _race_job(control, memory, prompt, system, max_new_tokens, *lane_values):
    """The Run button's inputs as the race's Job (what its GPU call's duration is estimated from on ZeroGPU)."""
    return race_job(control, prompt, system, max_new_tokens, lane_values)


def _chat_job(control, memory, message, history, turn_stats, system, max_new_tokens, answers, *setting_values):
    """Send's inputs as the turn's Job (as `_race_job`)."""
    return chat_job(control, message, history, system, max_new_tokens, setting_values, answers)


def _start_tokens(pool: EnginePool, prompt: dict) -> tuple[int, str]:
    """The default race's new tokens per lane: DEFAULT_NEW_TOKENS, or fewer where the default race (its lanes, the
    first preset prompt) is estimated over most of the run limit on this device; and the sentence that says so."""
    prompt_tokens = len(pool.loaded.tokenizer.prompt_ids(prompt["prompt"], prompt.get("system")))
    tokens = new_tokens_that_fit(pool, list(DEFAULT_LANES.values()), prompt_tokens, DEFAULT_NEW_TOKENS)
    if tokens == DEFAULT_NEW_TOKENS:
        return tokens, ""
    estimate = sum(pool.estimate_s(list(DEFAULT_LANES.values()), prompt_tokens, DEFAULT_NEW_TOKENS))
    return tokens, (f" On this device the default race with {DEFAULT_NEW_TOKENS} new tokens per lane is estimated at "
                    f"{duration(estimate)}, so the page starts at {tokens} new tokens per lane (under "
                    f"'System message and length').")


def _lane_summary(name: str, settings: LaneSettings) -> str:
    return f"Lane {name}: {settings.describe()}"


def _lane_summary_update(name: str, *values):
    try:
        return gr.update(label=_lane_summary(name, settings_from_values(values)))
    except (ValueError, TypeError):  # a half-typed value: keep the last summary
        return gr.skip()


def _build_chat_tab(pool: EnginePool) -> None:
    history = gr.State([])
    turn_stats = gr.State([])
    control = gr.State(RunControl())
    memory = gr.State(ChatMemory())  # the visitor's latest turn: its colour mode and its answers' tokens
    with gr.Accordion("Chat settings", open=False):
        system = gr.Textbox("", label="System message (optional)")
        with gr.Row():
            max_new_tokens = gr.Slider(8, 512, value=DEFAULT_NEW_TOKENS, step=8, label="max new tokens")
            answers = gr.Slider(1, MAX_ANSWERS, value=1, step=1, label="answers per turn (n)", elem_id="chat-answers",
                                info="sampled answers to compare, sharing the prompt's KV blocks; above 1 needs a "
                                     "temperature above 0 (greedy answers are all the same)")
        with gr.Row():
            settings = settings_widgets(pool, pool.serving, "Chat", "chat")
    # No label and no toolbar buttons: they were drawn over the messages. The one icon Gradio always shows, the
    # trash can, does what "New chat" does.
    chat_log = gr.Chatbot(elem_id="chat-log", height=380, show_label=False, buttons=[])
    with gr.Row():
        message = gr.Textbox(placeholder="Type a message and press Enter", show_label=False, scale=5,
                             elem_id="chat-input", max_length=MAX_PROMPT_CHARS)
        send = gr.Button("Send", variant="primary", elem_id="chat-send", scale=1)
        stop = gr.Button("Stop", variant="stop", elem_id="chat-stop", scale=1)
        clear = gr.Button("New chat", scale=1)
    status = gr.Markdown("Later turns reuse the earlier turns' KV blocks through the prefix cache (paged KV mode).",
                         elem_id="chat-status")
    # The latest answer token by token, with CSS-only tooltips (a Chatbot cannot take them; `ui.chat_answers`).
    colour = gr.Radio([(label, mode) for mode, label in COLOUR_MODES.items()], value=DEFAULT_MODE,
                      label="Colour the answer's tokens by", elem_id="chat-colour")
    # One above the other: the kept answer takes the width when it is the only one (the other answers' panel is then
    # empty), and the other answers sit side by side inside their panel, wrapping on a phone.
    tokens = gr.HTML(TOKENS_EMPTY, elem_id="chat-tokens", css_template=TOKEN_CSS)
    other_answers = gr.HTML("", elem_id="chat-other-answers", css_template=TOKEN_CSS)
    stats_table = gr.DataFrame(stats_frame([]), label=STATS_LABEL, elem_id="chat-stats", **TABLE)
    kv_view = gr.HTML(elem_id="chat-kv-view")

    outputs = {"chat_log": chat_log, "history": history, "turn_stats": turn_stats, "stats_table": stats_table,
               "kv_view": kv_view, "tokens": tokens, "other_answers": other_answers, "input": message,
               "status": status}
    handler = gpu_task(pool, partial(run_remembered_chat, pool), _chat_job)
    inputs = [control, memory, message, history, turn_stats, system, max_new_tokens, answers] + settings
    chat_outputs = [outputs[name] for name in CHAT_OUTPUTS]
    events = [trigger(arm_chat, control, status, **QUICK).then(handler, inputs, chat_outputs, **GENERATION, **PRIVATE)
              for trigger in (send.click, message.submit)]
    stop.click(stop_chat, control, None, **QUICK, **_stop_cancels(events))
    colour.change(recolour_chat, [memory, colour], [tokens, other_answers], **QUICK)
    cleared = [chat_log, history, turn_stats, stats_table, kv_view, tokens, other_answers, status]
    for trigger in (clear.click, chat_log.clear):
        trigger(clear_chat, memory, cleared, cancels=events, **QUICK)


def build_demo(pool: EnginePool) -> gr.Blocks:
    keep_replacement_ids()  # or each session's state grows with every update (see ui.session_state)
    loaded = pool.loaded
    dtype = loaded.dtype_name
    with gr.Blocks(title="Inference Playground") as demo:
        gr.Markdown(f"## Inference Playground\nModel **{loaded.display_name}** on **{loaded.device}** in **{dtype}** "
                    f"({loaded.dtype_reason}), context {pool.max_seq_len} tokens. Every number on this page is "
                    "measured from the engine doing the work.")
        with gr.Tab("Race"):
            _build_race_tab(pool)
        with gr.Tab("Chat"):
            _build_chat_tab(pool)
        with gr.Tab("Batching"):
            build_batching_tab(pool)
        with gr.Tab("Stack"):
            build_stack_tab(pool)
        add_api(pool, partial(gpu_task, pool), **GENERATION)
    return demo
