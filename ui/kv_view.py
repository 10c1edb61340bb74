"""The paged KV pool as HTML: one cell per physical block, coloured by the request that owns it, with the requests'
block tables and the memory they hold next to what a contiguous cache would reserve. A pure function of
`Engine.kv_snapshot()` (plain values) and a token decoder.

Cell kinds: a block a request holds (its colour; the filled part darker, so a partly written last block shows its
fill), a block reused from the prefix cache for that request (outlined) or shared by several requests (reference
count > 1, marked xN), a cached-but-free block (no owner, still holding a reusable prefix), and a free block. With an
int4 KV cache a block still written in the model dtype (a request's newest) has a dashed border, the others are int4;
with attention sinks the blocks holding a request's first tokens are marked S (they stay while the window moves on).
Hovering a cell tells which tokens it holds, for blocks the viewer's own requests hold (`request_labels`); blocks of
other requests appear as "in use by another request", and a cached-but-free block's tokens are not shown either,
since on a shared deployment they may be another visitor's text.
"""

from __future__ import annotations

import html
from typing import Callable

from inference_core.kv.block_manager import FREED

OWNER_COLOURS = ("#2563eb", "#ea580c", "#16a34a", "#9333ea", "#db2777", "#0891b2")
CACHED_COLOUR, FREE_COLOUR, BORDER = "#cbd5e1", "#ffffff", "#94a3b8"


def _mib(num_bytes: float) -> str:
    return f"{num_bytes / 2 ** 20:.2f} MiB"


def _legend_chip(style: str, label: str) -> str:
    return (f'<span style="display:inline-flex;align-items:center;gap:4px;margin-right:12px">'
            f'<span style="display:inline-block;width:14px;height:14px;border:1px solid {BORDER};{style}"></span>'
            f"{label}</span>")


def pool_counts(snapshot: dict) -> tuple[int, int, int]:
    """(held, cached but free, free) blocks of a pool snapshot."""
    states = [block["state"] for block in snapshot["blocks"]]
    return states.count("used"), states.count("cached"), states.count("free")


def _table_chip(index: int, block_id: int, colour: str) -> str:
    """One logical -> physical entry of a block table; a block released from the sliding window shows a cross."""
    if block_id == FREED:
        return (f'<span title="logical block {index}: out of the sliding window, its block went back to the pool" '
                f'style="display:inline-block;padding:0 4px;margin:1px;border:1px dashed {colour};border-radius:3px;'
                f'font-size:11px;color:#94a3b8">{index}&rarr;&#10005;</span>')
    return (f'<span title="logical block {index} -> physical block {block_id}" style="display:inline-block;'
            f'padding:0 4px;margin:1px;border:1px solid {colour};border-radius:3px;font-size:11px">'
            f"{index}&rarr;{block_id}</span>")


def render_pool(snapshot: dict | None, decode: Callable[[list[int]], str], title: str,
                request_labels: dict[int, str] | None = None) -> str:
    """HTML for one paged pool. `request_labels` names the viewer's own requests by seq id; the pool's other
    requests are drawn anonymously, without their text. None: every request is the viewer's, as 'request N'."""
    if snapshot is None:
        return f"<p><b>{html.escape(title)}</b>: this configuration has no paged KV pool.</p>"
    block_size = snapshot["block_size"]
    requests = snapshot["requests"]
    labels = request_labels if request_labels is not None else {r["seq_id"]: f"request {r['seq_id']}" for r in requests}
    colour_of = {request["seq_id"]: OWNER_COLOURS[index % len(OWNER_COLOURS)] for index, request in enumerate(requests)}
    # Blocks a request got from the prefix cache: the first cached_prompt_tokens / block_size of its table.
    reused = {block_id for request in requests
              for block_id in request["block_table"][:request["cached_prompt_tokens"] // block_size]}
    sink_blocks = -(-(snapshot.get("attention_sinks") or 0) // block_size) if snapshot.get("sliding_window") else 0
    sinks = {block_id for request in requests for block_id in request["block_table"][:sink_blocks]
             if block_id != FREED}
    cells = []
    for block in snapshot["blocks"]:
        mine = any(owner in labels for owner in block["owners"])
        tokens = block["token_ids"] if block["state"] == "used" and mine else []
        fill_pct = 100 * block["num_filled"] // block_size
        text = decode(tokens) if tokens else ""
        if block["state"] == "used":
            owner = block["owners"][0]
            colour = colour_of.get(owner, OWNER_COLOURS[-1])
            style = f"background:linear-gradient(to top,{colour} {fill_pct}%,{colour}33 {fill_pct}%);"
            names = [labels[o] for o in block["owners"] if o in labels]
            others = len(block["owners"]) - len(names)
            someone_else = "another request" if others == 1 else f"{others} other requests"
            if names:
                state = "held by " + ", ".join(names) + (f" and {someone_else}" if others else "")
            else:
                state = f"in use by {someone_else}"
            if block["ref_count"] > 1:
                state += f"; shared by {block['ref_count']} requests through the prefix cache"
            elif block["id"] in reused:
                state += "; reused from the prefix cache"
            if block["id"] in sinks:
                state += "; holds the attention sinks, kept beside the window"
        elif block["state"] == "cached":
            style, state = (f"background:{CACHED_COLOUR};", "free, still caching a prefix (reusable until evicted; "
                            "its text is not shown, as it may be another visitor's)")
        else:
            style, state = f"background:{FREE_COLOUR};", "free"
        outline = "outline:2px solid #111827;outline-offset:-2px;" if block["id"] in reused or block["ref_count"] > 1 \
            else ""
        mark = f"x{block['ref_count']}" if block["ref_count"] > 1 else ("&#8635;" if block["id"] in reused else
                                                                         "S" if block["id"] in sinks else "")
        tip = f"block {block['id']}: {state}; {block['num_filled']}/{block_size} slots filled"
        border = f"1px solid {BORDER}"
        if block.get("storage") == "tail" and block["state"] == "used":
            border, tip = "1px dashed #111827", tip + "; in the model dtype until it fills, then quantized to int4"
        elif block.get("storage") == "int4" and block["state"] != "free":
            tip += "; int4 (keys per channel over the block, values per token in groups)"
        if tokens:
            tip += f"\ntokens {tokens}\n{text!r}"
        storage = f' data-storage="{block["storage"]}"' if "storage" in block else ""
        cells.append(f'<div class="kv-cell" data-state="{block["state"]}" data-block="{block["id"]}"{storage} '
                     f'title="{html.escape(tip)}" style="width:22px;height:22px;border:{border};'
                     f'font-size:9px;line-height:22px;text-align:center;color:#111827;{style}{outline}">{mark}</div>')
    grid = f'<div style="display:flex;flex-wrap:wrap;gap:2px;margin:6px 0">{"".join(cells)}</div>'

    tables = []
    for request in requests:
        colour = colour_of[request["seq_id"]]
        chips = "".join(_table_chip(index, block_id, colour) for index, block_id in enumerate(request["block_table"]))
        name = html.escape(labels.get(request["seq_id"], "another request (its text is not shown)"))
        tables.append(f'<div style="margin:4px 0"><b style="color:{colour}">{name}</b> block table '
                      f"(logical&rarr;physical): {chips}</div>")
    if not requests:
        tables.append("<div>No request holds blocks right now; finished requests' full blocks stay cached "
                      "(grey) for reuse.</div>")

    bytes_per_token = snapshot["bytes_per_token"]
    pool_bytes = snapshot["num_blocks"] * block_size * bytes_per_token
    stored = sum(request["stored_tokens"] for request in requests)
    reserved = sum(len(request["block_table"]) - request["block_table"].count(FREED) for request in requests) * block_size
    contiguous = len(requests) * snapshot["context_length"]
    used_blocks, cached_blocks, free_blocks = pool_counts(snapshot)
    numbers = (
        '<table class="kv-numbers" style="font-size:13px;margin-top:6px">'
        '<tr><th></th><th>tokens</th><th>KV memory</th>'
        f"</tr><tr><td>stored (KV written)</td><td>{stored}</td><td>{_mib(stored * bytes_per_token)}</td></tr>"
        f"<tr><td>reserved by this paged pool ({used_blocks} blocks x {block_size})</td><td>{reserved}</td>"
        f"<td>{_mib(reserved * bytes_per_token)}</td></tr>"
        f"<tr><td>a contiguous cache would reserve (full context per request)</td><td>{contiguous}</td>"
        f"<td>{_mib(contiguous * bytes_per_token)}</td></tr></table>")
    legend = "".join([
        _legend_chip(f"background:{OWNER_COLOURS[0]}", "held by a request (darker part: filled slots)"),
        _legend_chip(f"background:{OWNER_COLOURS[0]}33;outline:2px solid #111827;outline-offset:-2px",
                     "&#8635; reused from the prefix cache / xN shared"),
        _legend_chip(f"background:{CACHED_COLOUR}", "free, prefix still cached"),
        _legend_chip(f"background:{FREE_COLOUR}", "free")])
    stored_as = {"int8": "int8 with a scale per token and head",
                 "int4": "int4 (keys per channel over a block, values per token in groups; each request's newest "
                         "block in the model dtype until it fills, dashed)"}.get(snapshot.get("kv_dtype"))
    storage = (f" KV stored in {stored_as}: {bytes_per_token / 1024:.1f} KiB per token, so the pool holds "
               f"{snapshot['num_blocks'] * block_size} tokens in {_mib(pool_bytes)}." if stored_as else "")
    window = (f" Sliding window of {snapshot['sliding_window']} tokens: blocks wholly before it go back to the pool "
              "(&#10005; in a block table)." if snapshot.get("sliding_window") else "")
    if window and sink_blocks:
        window += (f" The first {snapshot['attention_sinks']} tokens stay in view as attention sinks, and so do "
                   "their blocks (S).")
    header = (f"<b>{html.escape(title)}</b>: {snapshot['num_blocks']} blocks of {block_size} tokens; "
              f"{used_blocks} held, {cached_blocks} cached, {free_blocks} free.{storage}{window} Hover a block to see "
              "its tokens.")
    return f'<div class="kv-pool">{header}<div style="font-size:12px;margin-top:4px">{legend}</div>{grid}' \
           f'{"".join(tables)}{numbers}</div>'
