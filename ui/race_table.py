"""The race's numbers as data: one row of plain values per lane (`lane_numbers`, what the `race` API endpoint
returns), the summary table the page shows (`summary_frame`, a DataFrame with a row per figure, its unit in its name,
and a column per lane), and the HTML under it: the speed-up line, the notes and what each figure measures
(`summary_notes_html`).

Every value comes from the lane's shown `LaneFigures` (see `ui.race_view`), rounded as the lane header rounds it, so
the header, the table and the API agree; a value not measured yet is None (an empty cell).
"""

from __future__ import annotations

import pandas as pd

from inference_core import Engine
from inference_core.quant.linear import weight_bytes
from ui.race_view import LaneFigures, LaneTrace, race_notes, speedup_html
from ui.speculation import speculation_summary_rows

# lane_numbers' keys and the summary table's row names (the figure with its unit).
NUMBER_LABELS = {
    "ttft_ms": "TTFT (ms)",
    "prompt_tokens": "prompt tokens",
    "cached_prompt_tokens": "from prefix cache",
    "computed_prompt_tokens": "computed in prefill",
    "prompt_tokens_per_s": "prompt tokens/s",
    "decode_tokens_per_s": "decode tokens/s",
    "generated_tokens": "tokens generated",
    "finish_reason": "finish reason",
    "device_s": "device time (s)",
    "kv_in_use_mib": "KV in use (MiB)",
    "kv_reserved_mib": "KV reserved (MiB)",
    "weights_mib": "weights (MiB)",
    "weights_dtype": "weights dtype",
    "kv_per_token_kib": "KV per token (KiB)",
    "compiled_decode": "compiled decode",
}
# The summary's headers: the figure, then a column per lane. Figures are rows, not columns: seventeen columns of
# numbers broke their headers letter by letter at 1440 px, while two lane columns keep every name and value readable
# down to a phone's width. The lane's settings are the table's first row ("settings", a name that fits a phone's
# first column unbroken), not the lane's header: a header stays "Lane A" as on the lane's own panel, short and the
# same in every race, and the long description wraps inside its lane's cell like any other value (a header holding
# it would be several lines tall and change with each setup).
SUMMARY_COLUMNS = ("figure", "Lane A", "Lane B")
# What each figure measures: the note under the table.
FIGURES = {
    "TTFT (ms)": "time to first token: the lane's own device time from the start of its request to its first token "
                 "(prompt processing and the first sampling); lower is better",
    "prompt tokens": "the prompt's tokens: those whose KV came from the lane's prefix cache (kept from earlier "
                     "requests, no compute; known from the first token on) and those computed in the prefill step",
    "prompt tokens/s": "all prompt tokens, cached or computed, divided by TTFT; higher is better",
    "decode tokens/s": "tokens after the first, divided by the lane's own device time from its first token to its "
                       "last; higher is better",
    "tokens generated": "tokens the lane produced; the finish reason says why it ended (or that it is still running)",
    "device time (s)": "the lane's own busy time for its whole request: only its own steps count, never the other "
                       "lane's",
    "KV in use (MiB)": "the KV cache holding this request's tokens when it ended (empty until then)",
    "KV reserved (MiB)": "KV memory set aside for this request: its blocks (paged) or a whole context (contiguous)",
    "weights (MiB)": "the model's weights as this lane's engine stores them (parameters and quantized buffers), "
                     "measured; the dtype says how",
    "KV per token (KiB)": "K and V of one token over all layers in the lane's KV dtype (int8: values plus a scale per "
                          "token and head); empty without a KV cache",
    "compiled decode": "whether decode steps ran through the compiled step (AOTInductor on a CPU, torch.compile with "
                       "CUDA graphs on CUDA); the one-time compile or load happened before the race (or in the step "
                       "that first used a new batch size) and is not in TTFT or decode tokens/s",
}
# The constrained lanes' row, shown (and explained) only when a lane is constrained.
CONSTRAINT_FIGURE = ("constraint mask", "a constrained lane: the time its grammar took to compute the allowed tokens and "
                     "follow the chosen ones (llguidance), per generated token and as a share of the lane's device "
                     "time; it is part of the decode time, so a race of a constrained lane against the same lane "
                     "unconstrained shows what the constraint costs")


def _round(value: float | None, digits: int) -> float | int | None:
    if value is None:
        return None
    return round(value) if digits == 0 else round(value, digits)


def _kv_mib(figures: LaneFigures, attribute: str) -> float | None:
    stats = figures.stats  # an external engine reports no KV memory
    return None if stats is None or stats.kv_mode == "external" else round(getattr(stats, attribute) / 2 ** 20, 2)


def _compiled(stats: dict | None) -> str:
    if stats is None:
        return "no (eager)"
    graphs = f"{stats['graphs']} graph{'s' if stats['graphs'] != 1 else ''}"
    if stats.get("from_disk"):
        return (f"yes: loaded from the disk cache in {stats['warmup_s']:.1f} s once ({graphs}, compiled on an earlier "
                "start)")
    return f"yes: compiled in {stats['warmup_s']:.1f} s once ({graphs}, {stats['recompiles']} recompiles)"


def _weights(engine: Engine) -> tuple[int, str]:
    loaded = engine.loaded
    how = loaded.quant.name if loaded.quant is not None else loaded.dtype_name
    return round(weight_bytes(loaded.model) / 2 ** 20), how


def lane_numbers(trace: LaneTrace) -> dict:
    """The lane's numbers as the page shows them now, by NUMBER_LABELS key: ints, floats, short strings, None where
    not measured yet."""
    f = trace.shown or trace.refresh()
    cached = f.cached_prompt_tokens
    engine = trace.engine  # None: an external engine, whose memory and compilation this app cannot see
    weights_mib, weights_dtype = _weights(engine) if engine is not None else (None, "external")
    per_token = engine.kv_cache.bytes_per_token if engine is not None else None
    return {
        "ttft_ms": _round(f.ttft_ms, 0), "prompt_tokens": f.prompt_tokens, "cached_prompt_tokens": cached,
        "computed_prompt_tokens": None if cached is None else f.prompt_tokens - cached,
        "prompt_tokens_per_s": _round(f.prompt_tokens_per_s, 0),
        "decode_tokens_per_s": _round(f.decode_tokens_per_s, 1),
        "generated_tokens": f.tokens, "finish_reason": f.state, "device_s": _round(f.device_s, 2),
        "kv_in_use_mib": _kv_mib(f, "kv_bytes_in_use"), "kv_reserved_mib": _kv_mib(f, "kv_bytes_reserved"),
        "weights_mib": weights_mib, "weights_dtype": weights_dtype,
        "kv_per_token_kib": round(per_token / 1024, 1) if per_token else None,
        "compiled_decode": _compiled(engine.compile_stats()) if engine is not None else None}


def constraint_cost(trace: LaneTrace) -> str | None:
    """The grammar's cost on a constrained lane, once it has finished: ms per generated token and its share of the
    lane's device time."""
    stats = trace.stats
    if (trace.settings.constraint or "none") == "none":
        return "not constrained"
    if stats is None or not stats.generated_tokens:
        return None
    share = f" ({stats.grammar_ms / stats.total_ms:.1%} of device time)" if stats.total_ms else ""
    return f"{stats.grammar_ms / stats.generated_tokens:.3f} ms per token{share}"


def _constrained(traces: list[LaneTrace]) -> bool:
    return any((t.settings.constraint or "none") != "none" and t.engine is not None for t in traces)


def summary_frame(traces: list[LaneTrace]) -> pd.DataFrame:
    """The summary table: a row per figure (the lane's settings, then lane_numbers' figures, then the speculation rows
    when a lane speculates, and the constraint's cost when a lane is constrained) and a column per lane ("Lane A",
    "Lane B"). Object columns keep whole numbers whole and missing ones None."""
    speculation = speculation_summary_rows() if any(t.acceptance is not None for t in traces) else []
    if _constrained(traces):
        speculation = [*speculation, (CONSTRAINT_FIGURE[0], constraint_cost)]
    names = ["settings", *NUMBER_LABELS.values(), *(label for label, _ in speculation)]
    lanes = [[t.settings.describe(), *lane_numbers(t).values(), *(cell(t) for _, cell in speculation)]
             for t in traces]  # a column per lane, in `names` order
    return pd.DataFrame([[name, *cells] for name, *cells in zip(names, *lanes)],
                        columns=["figure", *(f"Lane {t.name}" for t in traces)], dtype=object)


def summary_notes_html(traces: list[LaneTrace]) -> str:
    """Under the table: the speed-up line, the notes on why a lane wins or loses, and what each figure measures."""
    figures = [trace.shown or trace.refresh() for trace in traces]
    notes = "".join(f'<li data-note="{kind}">{text}</li>' for kind, text in race_notes(traces, figures))
    figures_shown = {**FIGURES, **dict([CONSTRAINT_FIGURE])} if _constrained(traces) else FIGURES
    meaning = "; ".join(f"<b>{label}</b>: {note}" for label, note in figures_shown.items())
    return (speedup_html(figures) + (f'<ul class="race-notes">{notes}</ul>' if notes else "")
            + '<details style="font-size:12px;color:#475569"><summary>What each figure measures</summary>'
              f"{meaning}.</details>")
