"""Layout of the playground: `build_demo` creates the Race and Chat tabs and wires every listener at the bottom.

Element ids that tests and scripts rely on: race-prompt, race-run, race-stop, lane-a-output, lane-b-output,
race-chart, race-summary, race-identical, kv-view, chat-input, chat-send, chat-stop, chat-log (plus race-status,
chat-status, chat-stats, chat-kv-view). Every generation runs through one queue slot (`concurrency_id="engine"`,
limit 1): the lanes share one device, and a second tab's request waits its turn instead of competing for it.
"""

from __future__ import annotations

from functools import partial

import gradio as gr

from inference_core.config import KV_MODES
from inference_core.prompts import load_prompts
from ui.chat import CHAT_OUTPUTS, chat_turn, clear_chat, stats_table_html, stop_chat
from ui.race import RACE_OUTPUTS, run_race, stop_race
from ui.settings import BLOCK_SIZES, KV_MODE_LABELS, EnginePool, LaneSettings

DEFAULT_LANES = {"A": LaneSettings(kv_mode="paged"), "B": LaneSettings(kv_mode="none")}
MAX_PROMPT_CHARS = 20_000
GENERATION = {"concurrency_limit": 1, "concurrency_id": "engine"}


def _gpu_task(handler):
    """On a ZeroGPU Space (the `spaces` package is present) GPU work must run inside `spaces.GPU`; elsewhere that
    decorator does nothing, and without the package the handler is used as it is."""
    try:
        import spaces
    except ImportError:
        return handler
    return spaces.GPU(duration=120)(handler)


def _presets() -> dict[str, dict]:
    return {f"{row['kind']}: {row['id']}": row for row in load_prompts() if row["kind"] != "completion"}


def _settings_widgets(defaults: LaneSettings, label: str) -> list[gr.components.Component]:
    """Widgets for one LaneSettings, in field order."""
    kv_mode = gr.Radio([(KV_MODE_LABELS[mode], mode) for mode in KV_MODES[::-1] if mode in KV_MODE_LABELS],
                       value=defaults.kv_mode, label=f"{label} KV cache")
    block_size = gr.Dropdown(list(BLOCK_SIZES), value=defaults.block_size, label="block size (paged)")
    prefix_cache = gr.Checkbox(value=defaults.prefix_cache, label="prefix cache (paged)")
    temperature = gr.Slider(0.0, 1.5, value=defaults.temperature, step=0.05, label="temperature (0 = greedy)")
    top_p = gr.Slider(0.05, 1.0, value=defaults.top_p, step=0.05, label="top-p")
    seed = gr.Number(value=defaults.seed, precision=0, label="seed (used when sampling)")
    return [kv_mode, block_size, prefix_cache, temperature, top_p, seed]


def _build_race_tab(pool: EnginePool) -> None:
    presets = _presets()
    first = next(iter(presets.values()))
    preset = gr.Dropdown(list(presets), value=next(iter(presets)), label="Preset prompt (chat, code, grounded, "
                         "long, shared-prefix)")
    prompt = gr.Textbox(first["prompt"], lines=3, max_lines=12, label="Prompt", elem_id="race-prompt",
                        max_length=MAX_PROMPT_CHARS)
    system = gr.Textbox(first.get("system", ""), lines=1, label="System message (optional)")
    max_new_tokens = gr.Slider(8, 512, value=128, step=8, label="max new tokens (per lane)")
    lanes = []
    with gr.Row():
        for name, defaults in DEFAULT_LANES.items():
            with gr.Column(), gr.Accordion(f"Lane {name} settings", open=True):
                lanes += _settings_widgets(defaults, f"Lane {name}")
    with gr.Row():
        run = gr.Button("Run race", variant="primary", elem_id="race-run")
        stop = gr.Button("Stop", variant="stop", elem_id="race-stop")
    status = gr.Markdown("Both lanes run the same prompt on one device, taking turns step by step so that each gets "
                         "an equal share of device time; each lane is timed by its own steps only.",
                         elem_id="race-status")
    with gr.Row(equal_height=False):
        lane_a = gr.HTML("<b>Lane A</b>", elem_id="lane-a-output")
        lane_b = gr.HTML("<b>Lane B</b>", elem_id="lane-b-output")
    chart = gr.Plot(label="tokens/s over each lane's own device time", elem_id="race-chart")
    with gr.Row(equal_height=False):
        summary = gr.HTML(elem_id="race-summary")
        identical = gr.HTML(elem_id="race-identical")
    kv_view = gr.HTML(elem_id="kv-view")

    preset.change(lambda key: (presets[key]["prompt"], presets[key].get("system", "")), preset, [prompt, system],
                  queue=False)
    outputs = {"lane_a": lane_a, "lane_b": lane_b, "chart": chart, "summary": summary, "identical": identical,
               "kv_view": kv_view, "status": status, "run_button": run}
    race_event = run.click(_gpu_task(partial(run_race, pool)), [prompt, system, max_new_tokens] + lanes,
                           [outputs[name] for name in RACE_OUTPUTS], trigger_mode="once", show_progress="hidden",
                           **GENERATION)
    stop.click(stop_race, None, [status, run], cancels=[race_event], queue=False)


def _build_chat_tab(pool: EnginePool) -> None:
    history = gr.State([])
    turn_stats = gr.State([])
    with gr.Accordion("Chat settings", open=False):
        system = gr.Textbox("", label="System message (optional)")
        max_new_tokens = gr.Slider(8, 512, value=128, step=8, label="max new tokens")
        with gr.Row():
            settings = _settings_widgets(LaneSettings(kv_mode="paged"), "Chat")
    chat_log = gr.Chatbot(elem_id="chat-log", height=380, label="Conversation")
    with gr.Row():
        message = gr.Textbox(placeholder="Type a message and press Enter", show_label=False, scale=5,
                             elem_id="chat-input", max_length=MAX_PROMPT_CHARS)
        send = gr.Button("Send", variant="primary", elem_id="chat-send", scale=1)
        stop = gr.Button("Stop", variant="stop", elem_id="chat-stop", scale=1)
        clear = gr.Button("New chat", scale=1)
    status = gr.Markdown("Later turns reuse the earlier turns' KV blocks through the prefix cache (paged KV mode).",
                         elem_id="chat-status")
    stats_table = gr.HTML(stats_table_html([]), elem_id="chat-stats")
    kv_view = gr.HTML(elem_id="chat-kv-view")

    outputs = {"chat_log": chat_log, "history": history, "turn_stats": turn_stats, "stats_table": stats_table,
               "kv_view": kv_view, "input": message, "status": status}
    handler = _gpu_task(partial(chat_turn, pool))
    inputs = [message, history, turn_stats, system, max_new_tokens] + settings
    chat_outputs = [outputs[name] for name in CHAT_OUTPUTS]
    events = [trigger(handler, inputs, chat_outputs, trigger_mode="once", **GENERATION)
              for trigger in (send.click, message.submit)]
    stop.click(stop_chat, None, status, cancels=events, queue=False)
    clear.click(clear_chat, None, [chat_log, history, turn_stats, stats_table, kv_view, status], cancels=events,
                queue=False)


def build_demo(pool: EnginePool) -> gr.Blocks:
    loaded = pool.loaded
    dtype = str(loaded.dtype).removeprefix("torch.")
    with gr.Blocks(title="Inference Playground") as demo:
        gr.Markdown(f"## Inference Playground\nModel **{loaded.name}** on **{loaded.device}** in **{dtype}**, "
                    f"context {pool.max_seq_len} tokens. Every number on this page is measured from the engine "
                    "doing the work.")
        with gr.Tab("Race"):
            _build_race_tab(pool)
        with gr.Tab("Chat"):
            _build_chat_tab(pool)
    return demo
