"""Layout of the playground: `build_demo` creates the Race and Chat tabs and wires every listener at the bottom.

Element ids that tests and scripts rely on: race-setup, race-prompt, race-run, race-stop, lane-a-output,
lane-b-output, race-chart, race-acceptance, race-summary, race-identical, kv-view, chat-input, chat-send, chat-stop,
chat-log (plus race-status, chat-status, chat-stats, chat-kv-view, and lane-a-spec, lane-b-spec, chat-spec for the
draft source radios, each with its -k and -layers boxes). Every generation runs through one queue slot
(`concurrency_id="engine"`, limit 1): the lanes share one device, and a second tab's request waits its turn instead of
competing for it.
"""

from __future__ import annotations

from functools import partial

import gradio as gr

from inference_core.config import KV_MODES
from inference_core.prompts import load_prompts
from inference_core.speculative import MAX_K
from ui.chat import CHAT_OUTPUTS, chat_turn, clear_chat, stats_table_html, stop_chat
from ui.race import LANE_SETTING_FIELDS, RACE_OUTPUTS, run_race, stop_race
from ui.settings import BLOCK_SIZES, DEFAULT_LAYERS, KV_MODE_LABELS, SPEC_METHOD_LABELS, EnginePool, LaneSettings

DEFAULT_LANES = {"A": LaneSettings(kv_mode="paged"), "B": LaneSettings(kv_mode="none")}
# Race setups: lane settings and, optionally, the preset prompt that shows them off (a bench prompt id).
RACE_SETUPS = {
    "paged KV cache vs no KV cache": {"lanes": DEFAULT_LANES, "prompt_id": None},
    "speculation: prompt lookup (k=5) vs plain decoding, grounded prompt": {
        "lanes": {"A": LaneSettings(kv_mode="paged", spec_method="ngram", spec_k=5),
                  "B": LaneSettings(kv_mode="paged")},
        "prompt_id": "grounded-4"},
}
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


def _settings_widgets(pool: EnginePool, defaults: LaneSettings, label: str,
                      spec_id: str) -> list[gr.components.Component]:
    """Widgets for one LaneSettings, in field order. The draft model is offered only when the app loaded one; the
    draft length and the early-exit depth are shown only for the draft sources they apply to."""
    kv_mode = gr.Radio([(KV_MODE_LABELS[mode], mode) for mode in KV_MODES[::-1] if mode in KV_MODE_LABELS],
                       value=defaults.kv_mode, label=f"{label} KV cache")
    block_size = gr.Dropdown(list(BLOCK_SIZES), value=defaults.block_size, label="block size (paged)")
    prefix_cache = gr.Checkbox(value=defaults.prefix_cache, label="prefix cache (paged)")
    temperature = gr.Slider(0.0, 1.5, value=defaults.temperature, step=0.05, label="temperature (0 = greedy)")
    top_p = gr.Slider(0.05, 1.0, value=defaults.top_p, step=0.05, label="top-p")
    seed = gr.Number(value=defaults.seed, precision=0, label="seed (used when sampling)")
    methods = [method for method in SPEC_METHOD_LABELS if method != "draft" or pool.draft is not None]
    labels = {**SPEC_METHOD_LABELS, "draft": f"draft model ({pool.draft.name})" if pool.draft else ""}
    spec_method = gr.Radio([(labels[method], method) for method in methods], value=defaults.spec_method,
                           label="speculative decoding: draft source", elem_id=spec_id)
    with gr.Row():
        spec_k = gr.Slider(1, MAX_K, value=defaults.spec_k, step=1, label="draft length k",
                           visible=defaults.speculates, elem_id=f"{spec_id}-k")
        spec_adaptive = gr.Checkbox(value=defaults.spec_adaptive, label="adaptive k", visible=defaults.speculates)
        num_layers = pool.loaded.config.num_layers
        # A dropdown, not a number box: an empty gr.Number arrives as 0, and "engine default" needs its own value.
        draft_layers = gr.Dropdown([("engine default", DEFAULT_LAYERS)] + list(range(1, num_layers)),
                                   value=defaults.draft_layers, label="early-exit draft layers",
                                   visible=defaults.spec_method == "early-exit", elem_id=f"{spec_id}-layers")
    return [kv_mode, block_size, prefix_cache, temperature, top_p, seed, spec_method, spec_k, spec_adaptive,
            draft_layers]


def _show_spec_widgets(widgets: list[gr.components.Component]) -> None:
    """Show the draft length and adaptive switch for any draft source, the early-exit depth for early exit only."""
    spec_method, spec_k, spec_adaptive, draft_layers = widgets[-4:]
    spec_method.change(lambda method: (gr.update(visible=method != "none"), gr.update(visible=method != "none"),
                                       gr.update(visible=method == "early-exit")),
                       spec_method, [spec_k, spec_adaptive, draft_layers], queue=False, show_progress="hidden")


def _setup_values(setup: dict, presets: dict[str, dict]) -> list:
    """A race setup's widget values: the preset key, prompt and system (left as they are without a prompt), then lane
    A's and lane B's settings in field order."""
    prompt_id = setup["prompt_id"]
    key = next((key for key, row in presets.items() if row["id"] == prompt_id), None)
    head = [key, presets[key]["prompt"], presets[key].get("system", "")] if key else [gr.skip()] * 3
    return head + [getattr(setup["lanes"][name], field) for name in "AB" for field in LANE_SETTING_FIELDS]


def _build_race_tab(pool: EnginePool) -> None:
    presets = _presets()
    first = next(iter(presets.values()))
    setup = gr.Dropdown(list(RACE_SETUPS), value=next(iter(RACE_SETUPS)), label="Race setup (sets both lanes)",
                        elem_id="race-setup")
    preset = gr.Dropdown(list(presets), value=next(iter(presets)), label="Preset prompt (chat, code, grounded, "
                         "long, shared-prefix)")
    prompt = gr.Textbox(first["prompt"], lines=3, max_lines=12, label="Prompt", elem_id="race-prompt",
                        max_length=MAX_PROMPT_CHARS)
    system = gr.Textbox(first.get("system", ""), lines=1, label="System message (optional)")
    max_new_tokens = gr.Slider(8, 512, value=128, step=8, label="max new tokens (per lane)")
    lane_widgets = {}
    with gr.Row():
        for name, defaults in DEFAULT_LANES.items():
            with gr.Column(), gr.Accordion(f"Lane {name} settings", open=True):
                lane_widgets[name] = _settings_widgets(pool, defaults, f"Lane {name}", f"lane-{name.lower()}-spec")
    lanes = lane_widgets["A"] + lane_widgets["B"]
    with gr.Row():
        run = gr.Button("Run race", variant="primary", elem_id="race-run")
        stop = gr.Button("Stop", variant="stop", elem_id="race-stop")
    status = gr.Markdown("Both lanes run the same prompt on one device, taking turns step by step so that each gets "
                         "an equal share of device time; each lane is timed by its own steps only.",
                         elem_id="race-status")
    with gr.Row(equal_height=False):
        lane_a = gr.HTML("<b>Lane A</b>", elem_id="lane-a-output")
        lane_b = gr.HTML("<b>Lane B</b>", elem_id="lane-b-output")
    with gr.Row(equal_height=False):
        chart = gr.Plot(label="tokens/s over each lane's own device time", elem_id="race-chart")
        acceptance = gr.Plot(label="speculative decoding: share of drafts accepted", elem_id="race-acceptance")
    with gr.Row(equal_height=False):
        summary = gr.HTML(elem_id="race-summary")
        identical = gr.HTML(elem_id="race-identical")
    kv_view = gr.HTML(elem_id="kv-view")

    preset.change(lambda key: (presets[key]["prompt"], presets[key].get("system", "")), preset, [prompt, system],
                  queue=False)
    for widgets in lane_widgets.values():
        _show_spec_widgets(widgets)
    setup.change(lambda name: _setup_values(RACE_SETUPS[name], presets), setup, [preset, prompt, system] + lanes,
                 queue=False)
    outputs = {"lane_a": lane_a, "lane_b": lane_b, "chart": chart, "acceptance": acceptance, "summary": summary,
               "identical": identical, "kv_view": kv_view, "status": status, "run_button": run}
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
            settings = _settings_widgets(pool, LaneSettings(kv_mode="paged"), "Chat", "chat-spec")
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
    _show_spec_widgets(settings)
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
