"""`python -m server.serve_check --model DIR [--device cuda] --json PATH`: the playground's own serving path on one
device, as a GPU Space runs it, without a browser or an HTTP client: a race of two lanes (paged eager against paged
compiled, or against contiguous with --eager), a chat turn, and one streamed API completion, all through one
`EnginePool` and its engine loop, the API's request through the same reading (`server.api_body`) and
server-sent-event replies (`server.api_replies`) that `server.openai_api` serves. Each run records every lane's TTFT
(from the start of the run to its first token, wall clock) and tokens/s (the engine's decode rate), and the number of
SSE chunks the completion streamed.

`python -m inference_core gpu-report` runs it in a process of its own; it needs no Gradio and no FastAPI, which a
bare GPU machine may not have.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from inference_core.engine.request import FinishEvent, TokenEvent
from inference_core.model.loader import load_model
from inference_core.settings import LaneSettings
from server.api_body import read_request, refuse_unsupported
from server.api_replies import Reply
from serving.admission import Job
from serving.pool import EnginePool

PROMPT = "Explain in a few sentences how a paged KV cache lets a server batch requests of different lengths."
API_SLOT = "chat"  # the slot the API shares with the page's chat, as server.openai_api has it


def measure(pool: EnginePool, job: Job, what: str, on_token=None) -> list[dict]:
    """Run `job` to its end; one row per lane: wall-clock TTFT from the start, the engine's tokens/s."""
    run = pool.submit(job)
    for name in run.to_compile():
        run.compile(name)
    started = time.perf_counter()
    run.start()
    first, finals = {}, {}
    try:
        for handle, event in run.events():
            if isinstance(event, TokenEvent):
                first.setdefault(handle.tag, time.perf_counter())
                if on_token is not None:
                    on_token(event)
            elif isinstance(event, FinishEvent):
                finals[handle.tag] = event
    finally:
        run.close()
    return [{"run": what, "lane": lane, "ttft_ms": round((first.get(lane, math.nan) - started) * 1e3, 1),
             "tokens_per_s": round(final.stats.decode_tokens_per_s, 1), "tokens": len(final.token_ids),
             "finish_reason": final.stats.finish_reason} for lane, final in sorted(finals.items())]


def api_completion(pool: EnginePool, new_tokens: int) -> tuple[list[dict], int]:
    """One streamed completion as the API reads and answers it; returns its row and the SSE chunks it sent."""
    body = {"model": "served", "prompt": PROMPT, "max_tokens": new_tokens, "stream": True, "ignore_eos": True}
    refuse_unsupported(body, "completions")
    asked = read_request(body, "completions", pool.policy, pool.serving)
    job = Job("request", {"api": (API_SLOT, asked.settings)}, tuple(asked.prompts), chat=False,
              max_new_tokens=asked.max_tokens, ignore_eos=True, sampling=asked.sampling)
    reply = Reply("completions", "served", asked, pool.loaded.tokenizer, [[]], frozenset())
    chunks = []
    rows = measure(pool, job, "API completion (streamed)",
                   on_token=lambda event: chunks.append(reply.sse(reply.chunk(0, event)))
                   if reply.wants_chunk(event) else None)
    return rows, len(chunks)


def serve_check(model: str, device: str, new_tokens: int, eager: bool = False) -> dict:
    loaded = load_model(model, device=device, dtype="bfloat16")
    pool = EnginePool(loaded, max_seq_len=1024)
    second = ("contiguous", LaneSettings(kv_mode="contiguous")) if eager else ("paged+compiled",
                                                                              LaneSettings(compile=True))
    race = Job("race", {"paged": ("a", LaneSettings()), second[0]: ("b", second[1])}, (PROMPT,),
               max_new_tokens=new_tokens, ignore_eos=True)
    turn = Job("turn", {"chat": ("chat", LaneSettings())}, ([{"role": "user", "content": PROMPT}],),
               max_new_tokens=new_tokens, ignore_eos=True)
    try:
        runs = measure(pool, race, "race") + measure(pool, turn, "chat turn")
        api_rows, chunks = api_completion(pool, new_tokens)
        held = pool.blocks_in_use()
    finally:
        # The loop thread joined before the interpreter exits: left running, it was once caught inside torch as the
        # process ended, and the process aborted ("terminate called without an active exception", exit -6).
        pool.loop.close()
    return {"how": "in-process: the engine pool and its loop, the API's request reading and streamed replies (no "
                   "HTTP server: Gradio and FastAPI are not needed)",
            "device": str(loaded.device), "new_tokens": new_tokens, "runs": runs + api_rows, "api_chunks": chunks,
            "kv_blocks_held_after": held}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--json", required=True)
    parser.add_argument("--eager", action="store_true", help="race paged against contiguous (no compile)")
    args = parser.parse_args()
    result = serve_check(args.model, args.device, args.new_tokens, args.eager)
    Path(args.json).write_text(json.dumps(result, indent=2))
    for row in result["runs"]:
        print(f"{row['run']} / {row['lane']}: TTFT {row['ttft_ms']:.0f} ms, {row['tokens_per_s']:.1f} tok/s, "
              f"{row['tokens']} tokens")
    print(f"API chunks streamed: {result['api_chunks']}; KV blocks held after: {result['kv_blocks_held_after']}")
    return 0 if result["kv_blocks_held_after"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
