"""The child side of a process peer of `bench` (`inference_core.bench.process_peers`): an engine that runs in its own
virtual environment, in its own process, answering timed greedy runs over stdin and stdout.

Each worker script beside this file opens its engine and hands `serve` one function, `generate(prompt_ids,
max_new_tokens, on_token)`, which feeds the engine those token ids (never text), decodes greedily exactly
`max_new_tokens` tokens (end-of-sequence ignored), and calls `on_token(token_id)` as each token comes out. `serve`
owns the clock, so every peer is timed by the same definitions as our rows: TTFT from the call to the first token
(the prompt's prefill and the first token), decode tokens/s as the tokens after the first over the time from the first
to the last.

The protocol, one JSON object a line: the worker first writes `{"ready": true, "version": ..., "load_s": ...}` (or
`{"error": ...}` and exits); then for every request line `{"prompt_ids": [...], "max_new_tokens": N}` it writes
`{"ttft_ms", "prefill_tokens_per_s", "decode_tokens_per_s", "token_ids"}` or `{"error": ...}`, and it exits at the end
of its input. It imports nothing of ours beyond this folder: the peer's environment has only the peer's packages.
"""

from __future__ import annotations

import json
import sys
import time
import traceback


def _reply(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def timed_run(generate, prompt_ids: list[int], max_new_tokens: int) -> dict:
    """One greedy run through `generate`, timed as our rows are."""
    token_ids: list[int] = []
    token_times: list[float] = []

    def on_token(token_id: int) -> None:
        token_times.append(time.perf_counter())
        token_ids.append(int(token_id))

    start = time.perf_counter()
    generate(prompt_ids, max_new_tokens, on_token)
    if len(token_ids) != max_new_tokens:
        raise RuntimeError(f"the engine gave {len(token_ids)} tokens where {max_new_tokens} were asked for")
    first, last = token_times[0], token_times[-1]
    return {"ttft_ms": (first - start) * 1e3, "prefill_tokens_per_s": len(prompt_ids) / (first - start),
            "decode_tokens_per_s": (len(token_times) - 1) / (last - first) if last > first else None,
            "token_ids": token_ids}


def serve(open_engine, version: str) -> None:
    """Open the engine (`open_engine()` -> generate), say so, then answer requests until stdin ends."""
    started = time.perf_counter()
    try:
        generate = open_engine()
    except Exception as error:  # the bench reports it as the peer's absent row
        _reply({"error": f"could not open the engine: {type(error).__name__}: {error}"})
        return
    _reply({"ready": True, "version": version, "load_s": round(time.perf_counter() - started, 3)})
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            request = json.loads(line)
            _reply(timed_run(generate, list(request["prompt_ids"]), int(request["max_new_tokens"])))
        except Exception as error:
            _reply({"error": f"{type(error).__name__}: {error}", "trace": traceback.format_exc()[-2000:]})
