"""The Stack tab: the optimization ladder climbed live on this device and model, one rung at a time.

Each rung is one configuration of the playground's own engine (`LaneSettings`, run through the pool's engine loop
like a race lane): no KV cache, a KV cache, paged with the prefix cache, then each further technique alone on top of
the paged cache (compiled decode, int8 weights, int4 weights, speculative decoding by prompt lookup), and everything
together. Every rung generates the same number of tokens for the same prompt (greedy, end of text ignored) and
reports what its request measured: decode tokens/s, TTFT, the weights' stored size, the KV memory it reserved, its
prefill and decode on the device's roofline (`ui.roofline_view`), and the quality delta, the perplexity of the first
QUALITY_TOKENS tokens of the shipped evaluation text with the rung's weights and KV dtype against the model as loaded
(`inference_core.bench.quality`, measured once per weight setting). Rungs the device cannot run (compiled decode or
quantized weights where unavailable) are left out and the tab says so. `climb` is a plain generator: the page streams
its bars and table after each rung; tests drive it without a browser.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, replace
from functools import partial

import gradio as gr
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from inference_core.config import ConfigError
from inference_core.engine.request import FinishEvent
from inference_core.bench.quality import eval_token_ids, perplexity
from inference_core.config import EngineConfig
from inference_core.engine.compiled import compile_unavailable, forwards_words
from inference_core.quant.linear import weight_bytes
from inference_core.settings import AUTO, LaneSettings, command_flags
from serving.admission import Job, Run
from serving.cost import duration
from serving.pool import EnginePool
from serving.zero_gpu import gpu_task
from ui.control import RunControl
from ui.roofline_view import roofline_figure
from ui.setups import presets
from ui.words import PAGE_WORDS, refusal

QUALITY_TOKENS = 1024  # tokens of the evaluation text each weight setting's perplexity is measured on
STACK_OUTPUTS = ("figure", "table", "status", "run_button", "roofline")
BAR_HEADROOM = 1.18  # a chart's height over its tallest bar: room for the value written above that bar
EMPTY_STACK_TEXT = "Each rung's bar<br>appears here as<br>the ladder is climbed."  # either chart before the climb
TABLE_COLUMNS = ("rung", "adds", "decode tokens/s", "vs no KV cache (x)", "TTFT (ms)", "weights (MiB)",
                 "KV reserved (MiB)", "perplexity", "quality delta (%)", "tokens", "forwards", "command")
# Column widths in pixels, one per TABLE_COLUMNS: sized by their text, the columns squeezed the numbers' headers letter
# by letter and pushed the command past the table's edge. The numbers fit 1440 px beside the rung and what it adds;
# the command (a long line) is reached by scrolling sideways, the rung column pinned, as on a phone.
TABLE_WIDTHS = ["150px", "200px", *["92px"] * 5, "112px", "92px", "92px", "200px", "560px"]
MAX_CELL_CHARS = 200  # a longer cell (a command with its prompt) shows its start; a click on it, or Copy, gives all


@dataclass(frozen=True)
class Rung:
    name: str
    adds: str  # what this rung changes, in a few words
    settings: LaneSettings


INT4_METHODS = {"int4": "round to nearest", "awq": "AWQ (calibrated)", "gptq": "GPTQ (calibrated)"}


def int4_choices(pool: EnginePool) -> list[str]:
    """The int4 methods the int4 rung can use here: round to nearest, and AWQ and GPTQ where calibrated."""
    return [scheme for scheme in INT4_METHODS if scheme in pool.weight_schemes()]


def ladder(pool: EnginePool, with_compiled: bool = True, int4: str = "int4") -> tuple[list[Rung], list[str]]:
    """The rungs this device can run (and why any were left out); `int4`: the int4 rung's method (int4, awq, gptq),
    which "everything together" uses too."""
    paged = LaneSettings(kv_mode="paged")
    spec = dict(spec_method="ngram", spec_k=AUTO)  # the draft length measured best for each rung's setup
    can_compile = with_compiled and compile_unavailable(pool.loaded.device) is None
    schemes = pool.weight_schemes()
    rungs = [Rung("no KV cache", "every step recomputes the whole text", LaneSettings(kv_mode="none")),
             Rung("KV cache", "keys and values kept: a step computes one token", LaneSettings(kv_mode="contiguous")),
             Rung("paged + prefix cache", "blocks on demand; shared prompt prefixes reused", paged)]
    left_out = []
    if can_compile:
        rungs.append(Rung("compiled", "decode step compiled (fused kernels, fixed shapes)", replace(paged, compile=True)))
    else:
        left_out.append("compiled decode (" + (compile_unavailable(pool.loaded.device) or "unticked") + ")")
    if int4 not in INT4_METHODS or (int4 != "int4" and int4 not in schemes):
        raise ConfigError(f"the int4 rung's method must be one of {', '.join(int4_choices(pool))}, got {int4!r}.")
    int4_name = "int4 weights" + (f" ({int4.upper()})" if int4 != "int4" else "")
    for scheme, name, words in (("int8", "int8 weights", "int8 weight-only quantization"),
                                (int4, int4_name, f"int4 weight-only quantization, {INT4_METHODS[int4]}")):
        if scheme in schemes:
            rungs.append(Rung(name, words, replace(paged, weights=scheme)))
        else:
            left_out.append(f"{scheme} weights (weight quantization runs on the CPU and on CUDA only)")
    rungs.append(Rung("speculative", "prompt lookup drafts", replace(paged, **spec)))
    best_weights = int4 if int4 in schemes else "none"
    rungs.append(Rung("everything together", "all of the above that runs here",
                      replace(paged, compile=can_compile, weights=best_weights, **spec)))
    return rungs, left_out


def command(settings: LaneSettings, prompt: str, system: str, new_tokens: int) -> str:
    """The CLI line that runs the same configuration on the same prompt (`generate`'s flags from the settings'
    table)."""
    # The settings first and the (long) prompt last: the table shows a command's first MAX_CELL_CHARS.
    words = ["python -m inference_core generate", *command_flags(settings, always=("kv_mode",)), "--max-new-tokens",
             str(new_tokens), "--ignore-eos"]
    if (system or "").strip():
        words += ["--system", shlex.quote(system.strip())]
    return " ".join(words + ["--prompt", shlex.quote(prompt)])


def quality_delta(pool: EnginePool, settings: LaneSettings) -> tuple[float, float]:
    """(perplexity, % change against the model as loaded) over the first QUALITY_TOKENS tokens of the eval text, for
    the rung's weights and KV dtype; measured once per setting and kept on the pool."""
    cache = pool.perplexities

    def measure(quant, kv_dtype: str) -> float:
        key = (quant, kv_dtype)
        if key not in cache:
            loaded = pool.weights(quant)
            tokens = eval_token_ids(loaded.tokenizer, max_tokens=QUALITY_TOKENS)
            config = EngineConfig(kv_mode="paged", kv_dtype=kv_dtype, max_seq_len=pool.max_seq_len)
            cache[key] = pool.loop.call(lambda: perplexity(loaded, config, tokens,
                                                           window=min(QUALITY_TOKENS, pool.max_seq_len)).perplexity)
        return cache[key]

    base = measure(LaneSettings().quant(), "auto")
    value = measure(settings.quant(), settings.kv_dtype)
    return value, 100 * (value - base) / base


def stack_figure(rows: list[dict]) -> go.Figure:
    """Decode tokens/s and TTFT per rung, as bars, from the table's rows."""
    # Titles on two lines: on one they ran into each other at a phone's width.
    figure = make_subplots(rows=1, cols=2, subplot_titles=("decode tokens/s<br>(higher is better)",
                                                           "TTFT ms<br>(lower is better)"))
    names = [row["rung"] for row in rows]
    figure.add_trace(go.Bar(x=names, y=[row["decode tokens/s"] for row in rows], marker_color="#2563eb",
                            text=[f"{row['decode tokens/s']:.1f}" for row in rows], textposition="outside",
                            name="decode tok/s"), row=1, col=1)
    figure.add_trace(go.Bar(x=names, y=[row["TTFT (ms)"] for row in rows], marker_color="#ea580c",
                            text=[f"{row['TTFT (ms)']:.0f}" for row in rows], textposition="outside",
                            name="TTFT ms"), row=1, col=2)
    figure.update_layout(height=340, template="plotly_white", showlegend=False,
                         margin={"l": 50, "r": 20, "t": 60, "b": 110})
    figure.update_yaxes(rangemode="tozero")
    for col, key in ((1, "decode tokens/s"), (2, "TTFT (ms)")):  # headroom for the values over the tallest bar
        top = max((row[key] for row in rows), default=0)
        if top > 0:
            figure.update_yaxes(range=[0, top * BAR_HEADROOM], row=1, col=col)
    if not rows:
        # Nothing measured yet: no axes (empty ones have made-up ranges), and the empty state's text inside each
        # subplot's own area, in short lines that fit half a phone's width, so it never runs across the other's.
        figure.update_xaxes(visible=False)
        figure.update_yaxes(visible=False)
        for axis in ("", "2"):
            figure.add_annotation(text=EMPTY_STACK_TEXT, xref=f"x{axis} domain", yref=f"y{axis} domain", x=0.5,
                                  y=0.5, showarrow=False, font={"color": "#64748b", "size": 13})
    return figure


def _frame(**values) -> tuple:
    return tuple(values.get(name, gr.skip()) for name in STACK_OUTPUTS)


def climb(pool: EnginePool, control: RunControl | None, prompt: str, system: str, new_tokens, with_compiled: bool,
          int4: str = "int4"):
    """Streaming handler: run every rung in turn, yielding (figure, table, status, run button) after each."""
    control = control if control is not None else RunControl()
    idle = gr.update(interactive=True)
    try:
        new_tokens = int(new_tokens)
        if not (prompt or "").strip():
            raise ConfigError("the prompt is empty; type some text.")
        rungs, left_out = ladder(pool, bool(with_compiled), int4 or "int4")
        rows: list[dict] = []
        points: dict[str, list[dict]] = {}  # rung -> its prefill and decode on the roofline
        yield _frame(figure=stack_figure(rows), table=pd.DataFrame(columns=TABLE_COLUMNS), run_button=gr.update(
            interactive=False), status=f"Climbing {len(rungs)} rungs, {new_tokens} tokens each...")
        for index, rung in enumerate(rungs):
            if control.stop_requested:
                break
            # Through the admission path like a race lane: the first rung (no KV cache), the slowest, must fit the
            # app's device-time limit before anything runs.
            run = pool.submit(Job("rung", {"rung": ("stack", rung.settings)}, (prompt,),
                                  system=(system or "").strip() or None, max_new_tokens=new_tokens, ignore_eos=True,
                                  caller=control.caller, cache_salt=control.visitor))
            for _ in run.to_compile():
                yield _frame(status=f"Rung {index + 1} ({rung.name}): compiling the decode step once for these "
                                    "settings (a minute or two on a CPU; later starts load it from disk)...")
                run.compile("rung")
            yield _frame(status=f"Rung {index + 1} of {len(rungs)}: {rung.name}...")
            decoder = run.engines["rung"].decoder
            before = pool.loop.call(decoder.stats.as_dict) if decoder is not None else None
            final = _run_one(run, control)
            if final is None or final.stats.finish_reason == "stopped":
                break
            forwards = forwards_words(pool.loop.call(decoder.stats.since, before)) if decoder is not None else "eager"
            rows.append(_row(pool, rung, run, final.stats, rows, command(rung.settings, prompt, system, new_tokens),
                             forwards))
            points[rung.name] = run.engines["rung"].roofline_points(final.stats)
            yield _frame(figure=stack_figure(rows), table=pd.DataFrame(rows, columns=TABLE_COLUMNS),
                         roofline=roofline_figure(vars(pool.ceilings()), points))
        stopped = " Stopped before the last rungs." if len(rows) < len(rungs) else ""
        missing = f" Left out here: {'; '.join(left_out)}." if left_out else ""
        yield _frame(status=f"Finished: {len(rows)} rungs measured on {pool.loaded.device} in "
                            f"{pool.loaded.dtype_name}.{stopped}{missing}", run_button=idle)
    except ConfigError as error:
        words = {**PAGE_WORDS, "max_new_tokens": "'new tokens per rung'"}
        yield _frame(status=f"**Cannot climb:** {refusal(error, words)}", run_button=idle)
    finally:
        control.end()


def _row(pool: EnginePool, rung: Rung, run: Run, stats, rows: list[dict], command_line: str, forwards: str) -> dict:
    """A rung's row of the table: what its request measured, its weights' size, its quality delta, and for a
    compiled rung how its forwards ran (the rung engine's counts over its run)."""
    ppl, delta = quality_delta(pool, rung.settings)
    decode = round(stats.decode_tokens_per_s, 1)  # the speed-up is the ratio of the speeds shown
    adds = rung.adds + (f" (prompt lookup k={stats.spec['k']})" if stats.spec else "")  # the k its setup measured
    return {"rung": rung.name, "adds": adds, "decode tokens/s": decode,
            "vs no KV cache (x)": round(decode / rows[0]["decode tokens/s"], 2) if rows else 1.0,
            "TTFT (ms)": round(stats.ttft_ms), "weights (MiB)": round(weight_bytes(run.engines["rung"].loaded.model)
                                                                       / 2 ** 20),
            "KV reserved (MiB)": round(stats.kv_bytes_reserved / 2 ** 20, 2), "perplexity": round(ppl, 3),
            "quality delta (%)": round(delta, 2), "tokens": stats.generated_tokens, "forwards": forwards,
            "command": command_line}


def _run_one(run: Run, control: RunControl) -> FinishEvent | None:
    """One rung's request through the engine loop; Stop ends it after the step in flight, and a closed page (the
    generator closed) cancels it, so its KV goes back to the pool either way."""
    final = None
    run.start()
    try:
        for _, event in run.events(should_stop=lambda: control.stop_requested):
            if isinstance(event, FinishEvent):
                final = event
    finally:
        run.close()
    return final


def build_stack_tab(pool: EnginePool) -> None:
    prompts = presets()
    grounded = next((key for key, row in prompts.items() if row["kind"] == "grounded"), next(iter(prompts)))
    control = gr.State(RunControl())
    gr.Markdown("The optimization ladder, measured here and now: each rung runs the same prompt for the same number "
                "of tokens on this device and model, and its bars and row appear as it ends. Quality delta is the "
                f"perplexity change over the first {QUALITY_TOKENS} tokens of the shipped evaluation text. Each row "
                f"ends with the command that reproduces it. A climb may take several minutes ({duration(pool.max_run_s)}"
                " or less of device time per rung, plus a one-time compile for the compiled rungs).")
    with gr.Row(equal_height=True):
        preset = gr.Dropdown(list(prompts), value=grounded, label="Prompt", scale=2)
        new_tokens = gr.Slider(16, 256, value=64, step=16, label="new tokens per rung", scale=1)
        with_compiled = gr.Checkbox(value=compile_unavailable(pool.loaded.device) is None, label="compiled rungs",
                                    interactive=compile_unavailable(pool.loaded.device) is None, scale=1,
                                    info="compiles once per configuration (1-2 min on a CPU), then loads from disk")
        methods = int4_choices(pool)
        int4 = gr.Dropdown([(INT4_METHODS[m], m) for m in methods], value="int4", label="int4 weights by", scale=1,
                           visible=len(methods) > 1, elem_id="stack-int4",
                           info="AWQ and GPTQ appear once calibrated (`python -m inference_core awq` or `gptq`)")
        run = gr.Button("Climb the ladder", variant="primary", elem_id="stack-run", scale=1)
        stop = gr.Button("Stop", variant="stop", elem_id="stack-stop", scale=1)
    status = gr.Markdown(elem_id="stack-status")
    figure = gr.Plot(stack_figure([]), elem_id="stack-chart", show_label=False)
    table = gr.DataFrame(pd.DataFrame(columns=TABLE_COLUMNS), elem_id="stack-table", wrap=True, interactive=False,
                         buttons=["copy", "fullscreen"], column_widths=TABLE_WIDTHS, pinned_columns=1,
                         max_chars=MAX_CELL_CHARS)
    roofline = gr.Plot(label="each rung's prefill (triangle) and decode (circle) under this device's roofs",
                       elem_id="stack-roofline")
    prompt = gr.State(prompts[grounded]["prompt"])
    system = gr.State(prompts[grounded].get("system", ""))
    quick = {"queue": False, "show_progress": "hidden", "api_visibility": "private"}  # the page's own events
    preset.change(lambda key: (prompts[key]["prompt"], prompts[key].get("system", "")), preset, [prompt, system],
                  **quick)
    outputs = {"figure": figure, "table": table, "status": status, "run_button": run, "roofline": roofline}
    run.click(RunControl.arm, control, None, **quick).then(
        gpu_task(pool, partial(climb, pool)), [control, prompt, system, new_tokens, with_compiled, int4],
        [outputs[name] for name in STACK_OUTPUTS], show_progress="hidden", concurrency_limit=1,
        concurrency_id="stack", api_visibility="private")
    stop.click(RunControl.request_stop, control, None, **quick)
