"""What a visitor does with a finished race besides reading it: redraw its lanes in another colour mode, and look
inside one token with the logit lens. Both read the visitor's `RaceMemory` (a gr.State that the Run handler fills,
`ui.race.run_remembered_race`), so neither runs the race again.

The logit lens shows, for a token picked in a lane, what each layer of that lane's model would have predicted at its
position had it been the last layer (the final norm and the LM head applied to the layer's output;
`inference_core.engine.lens.logit_lens`): the token's probability and rank per layer, and the layer's top tokens. It
runs one forward of the lane's prompt and output on the lane's own engine (its weights, quantized or not), through
the engine loop, which owns the device (`EngineLoop.call`). The depth an early-exit draft reads is marked: the lane's
own when it drafts with early exit, else the engine's default depth.
"""

from __future__ import annotations

import html
from collections.abc import Callable

import gradio as gr
import pandas as pd

from inference_core.engine.lens import logit_lens
from inference_core.spec.decoding import SpecConfig
from ui.figures import lens_figure
from ui.race import TOP_ALTERNATIVES
from ui.race_panels import RaceMemory, lanes_html
from ui.race_view import LaneTrace
from ui.token_view import COLOUR_MODES

LENS_COLUMNS = ("layer", "token p", "rank", "entropy (nats)", "top tokens")
LENS_WIDTHS = ["64px", "88px", "72px", "88px", "420px"]  # the headers stay whole; the top tokens' cell wraps
LENS_ABOUT = ("What each layer of the lane's model would predict at the picked token's position if it were the last "
              "layer: the final norm and the LM head applied to that layer's output. The line shows at which depth "
              "the answer forms; an early-exit draft reads the layer marked with a dotted line.")


def recolour(memory: RaceMemory, mode: str):
    """The colour mode's radio: keep the mode (a race in flight draws its next update in it) and redraw the finished
    lanes from their traces."""
    memory.mode = mode if mode in COLOUR_MODES else "draft"
    if memory.traces is None:
        return gr.skip(), gr.skip()
    lanes = lanes_html(memory.traces, memory.mode)
    return lanes["lane_a"], lanes["lane_b"]


def _trace(memory: RaceMemory, lane: str) -> LaneTrace | None:
    return next((trace for trace in memory.traces or [] if trace.name == lane), None)


def lens_choices(memory: RaceMemory, lane: str):
    """The token dropdown for `lane`: each generated token as "index: 'text'" (the first picked), or empty with a
    label that says why."""
    trace = _trace(memory, lane)
    if trace is None or trace.tokens is None or not trace.token_ids:
        why = "run a race first" if trace is None else ("an external lane has no lens" if trace.tokens is None
                                                        else "this lane produced no token")
        return gr.update(choices=[], value=None, label=f"token ({why})")
    choices = [(f"{index}: {trace.tokens.name(token_id)}", index) for index, token_id in enumerate(trace.token_ids)]
    return gr.update(choices=choices, value=0, label=f"token of lane {lane} ({len(choices)} generated)")


def lens_rows(trace: LaneTrace, index: int) -> list[dict]:
    """The logit lens of lane `trace`'s generated token `index`, on its engine through its engine loop, each row with
    the layer's top token's probability and text added ("top_prob", "top_name")."""
    request = trace.request
    token_ids = list(request.seq.token_ids)  # the prompt, then every generated token
    position = request.seq.num_prompt_tokens + index

    def lens() -> list[dict]:
        return logit_lens(trace.engine.runner, token_ids, position, TOP_ALTERNATIVES)

    rows = trace.loop.call(lens) if trace.loop is not None else lens()
    return [{**row, "top_prob": row["top"][0][1], "top_name": trace.tokens.name(row["top"][0][0])} for row in rows]


def early_exit_layer(trace: LaneTrace) -> tuple[int, bool]:
    """The depth an early-exit draft reads on this lane's engine, and whether the lane drafts there itself."""
    drafts = trace.settings.spec_method == "early-exit"
    spec = trace.settings.spec() if drafts else SpecConfig("early-exit")
    return trace.engine.resolve_spec(spec).draft_layers, drafts


def lens_sentence(rows: list[dict], token: str, marked_layer: int, drafts_there: bool) -> str:
    """What the lens says in one sentence: where the token becomes (and stays) the top choice, and what an
    early-exit draft at `marked_layer` gives it."""
    layers = len(rows)
    top = [row["layer"] for row in rows if row["token_rank"] == 0]
    last = rows[-1]
    if last["token_rank"] != 0:
        formed = (f"{token} is not the model's top choice even after the last layer (probability "
                  f"{last['token_prob']:.3f}, rank {last['token_rank'] + 1}): the lane sampled it")
    else:
        stays = layers  # the first layer of the last run of layers where it is the top choice
        while stays > 1 and rows[stays - 2]["token_rank"] == 0:
            stays -= 1
        formed = f"{token} becomes the top choice at layer {top[0]} of {layers}"
        if stays != top[0]:
            formed += f" and stays there from layer {stays}"
    marked = rows[marked_layer - 1]
    whose = "this lane's early-exit draft" if drafts_there else "an early-exit draft (the engine's default depth)"
    return (f"{formed}; {whose} at layer {marked_layer} gives it probability {marked['token_prob']:.3f} (rank "
            f"{marked['token_rank'] + 1}{', its top choice' if marked['token_rank'] == 0 else ''}).")


def lens_table(rows: list[dict], name: Callable[[int], str]) -> pd.DataFrame:
    """A row per layer: the token's probability (4 significant digits) and rank (1: the layer's top choice), the
    entropy, the top tokens with their probabilities."""
    return pd.DataFrame([[row["layer"], float(f"{row['token_prob']:.4g}"), row["token_rank"] + 1,
                          round(row["entropy"], 2),
                          ", ".join(f"{name(token_id)} {p:.3f}" for token_id, p in row["top"])]
                         for row in rows], columns=list(LENS_COLUMNS), dtype=object)


def run_lens(memory: RaceMemory, lane: str, index):
    """The lens button: (the sentence, the chart, the table) for the picked token, or a sentence saying what to do."""
    trace = _trace(memory, lane)
    if trace is None:
        return "Run a race first: the lens reads a token of a finished lane.", gr.skip(), gr.skip()
    if trace.tokens is None or trace.request is None:
        return f"Lane {lane} runs on an external engine: the lens needs this app's own model.", gr.skip(), gr.skip()
    if index is None or not 0 <= int(index) < len(trace.token_ids):
        return f"Pick one of lane {lane}'s {len(trace.token_ids)} tokens.", gr.skip(), gr.skip()
    index = int(index)
    rows = lens_rows(trace, index)
    token = trace.tokens.name(trace.token_ids[index])
    marked, drafts_there = early_exit_layer(trace)
    sentence = lens_sentence(rows, f"<b>{html.escape(token)}</b> (lane {lane}, token {index})", marked, drafts_there)
    note = f"early exit at layer {marked}" + ("" if drafts_there else " (default)")
    return (f'<p class="lens-sentence">{sentence}</p>', lens_figure(rows, token, marked, note),
            lens_table(rows, trace.tokens.name))


def build_lens_panel(memory: gr.State, table: dict, listener: dict) -> tuple[gr.Radio, gr.Dropdown]:
    """The logit lens's accordion (closed): a lane, a token of it, a button; the sentence, the chart and the table.
    `table`: the page's table options; `listener`: the settings of the page's events that use the device. Returns
    the lane and token controls, for the race to fill the tokens when it ends (`lens_choices`)."""
    with gr.Accordion("Logit lens: what each layer predicts for a token", open=False, elem_id="lens"):
        gr.Markdown(LENS_ABOUT)
        with gr.Row(equal_height=True):
            lane = gr.Radio([("Lane A", "A"), ("Lane B", "B")], value="A", label="lane", elem_id="lens-lane", scale=1)
            token = gr.Dropdown([], label="token (run a race first)", elem_id="lens-token", scale=3)
            button = gr.Button("Show the lens", elem_id="lens-run", scale=1)
        sentence = gr.HTML(elem_id="lens-summary")
        with gr.Row(equal_height=False):
            chart = gr.Plot(label="the token's probability after each layer", elem_id="lens-chart", min_width=320)
            lens = gr.DataFrame(pd.DataFrame(columns=LENS_COLUMNS), label="per layer", elem_id="lens-table",
                                column_widths=LENS_WIDTHS, max_height=420, min_width=320, **table)
    quick = {"queue": False, "show_progress": "hidden", "api_visibility": "private"}
    lane.change(lens_choices, [memory, lane], token, **quick)
    button.click(run_lens, [memory, lane, token], [sentence, chart, lens], show_progress="minimal", **listener)
    return lane, token
