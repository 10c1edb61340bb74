"""The race's memory plan: for each lane's settings, what the planner (`inference_core.planner`) says the weights,
the KV cache and one step's activations take and how many sequences of the race's length fit in the device's free
memory, beside what the lane's engine allocated and what its request held. Drawn on request from the visitor's last
race (`RaceMemory`), as the roofline is.
"""

from __future__ import annotations

import gradio as gr
import pandas as pd

from serving.pool import EnginePool
from ui.race_panels import RaceMemory

MIB, KIB = 2**20, 2**10
EMPTY_NOTE = "Run a race, then plan it here: each lane's memory as planned from its settings, beside what it used."


def memory_frame(pool: EnginePool, memory: RaceMemory) -> pd.DataFrame:
    """A row per quantity, a 'plan' and a 'used' column per finished local lane of the visitor's last race."""
    columns: dict[str, list] = {}
    names: list[str] = []
    for trace in memory.traces or []:
        if trace.engine is None or trace.stats is None:
            continue
        stats = trace.stats
        length = stats.prompt_tokens + stats.generated_tokens - 1  # the last token's KV is never written
        figures = pool.plan(trace.settings, length, trace.engine)
        plan, used = figures["plan"], figures["engine"]
        names = [
            "weights (MiB)", "KV per token (KiB)", f"KV per sequence of {length} tokens (MiB)", "KV pool (MiB)",
            "one step's activations, estimated (MiB)", f"sequences of {length} tokens that fit in free memory"]
        columns[f"{trace.name} plan"] = [
            round(plan["weights_bytes"] / MIB, 2), round(plan["kv_bytes_per_token"] / KIB, 2),
            round(plan["kv_bytes_per_sequence"] / MIB, 3), round(plan["kv_pool_bytes"] / MIB, 2),
            round(plan["activation_bytes"] / MIB, 1), plan["sequences_that_fit"]]
        columns[f"{trace.name} used"] = [
            round(used["weights_bytes"] / MIB, 2), round(used["kv_bytes_per_token"] / KIB, 2),
            round(stats.kv_bytes_reserved / MIB, 3), round(used["kv_pool_bytes"] / MIB, 2), "-", "-"]
    if not columns:
        return pd.DataFrame(columns=["quantity"])
    return pd.DataFrame({"quantity": names, **columns})


def draw_memory(pool: EnginePool, memory: RaceMemory):
    frame = memory_frame(pool, memory)
    if len(frame.columns) == 1:
        return gr.skip(), EMPTY_NOTE
    return frame, ("Planned from each lane's settings before anything runs; 'used' is what its engine allocated and "
                   "what its request held at its last token (a paged lane holds whole blocks, a contiguous one its "
                   "whole slot). Activations are an estimate from the shapes, not a measurement.")


def build_memory_panel(pool: EnginePool, memory: gr.State, table_style: dict, listener: dict) -> None:
    """A closed accordion under the race: a button plans the last race's lanes and shows what they used."""
    with gr.Accordion("Memory: each lane's plan beside what it used", open=False, elem_id="race-memory-panel"):
        draw = gr.Button("Plan the last race's lanes", elem_id="race-memory-draw", size="sm")
        note = gr.Markdown(EMPTY_NOTE, elem_id="race-memory-note")
        table = gr.DataFrame(pd.DataFrame(columns=["quantity"]), elem_id="race-memory-table", **table_style)
    draw.click(lambda state: draw_memory(pool, state), memory, [table, note], **listener)
