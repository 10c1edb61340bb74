"""The Stack tab's ladder climbed on the bundled model for benchmark prompts, for docs/benchmarks.md:
`python scripts/stack_climb.py [--prompts grounded-1,chat-med-1] [--new-tokens 64] [--dtype auto] [--json PATH]`.

Each prompt's climb is the tab's own (`ui.stack.climb`: every rung's request through the engine pool, greedy, the
same prompt and length, compiled rungs compiled or loaded before their timed run); the script prints each rung's
row (decode tokens/s, TTFT, weights, quality delta, and how a compiled rung's forwards ran) as a markdown table, and
writes the rows with the host's features to `--json`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from inference_core import load_model  # noqa: E402
from inference_core.bench.prompts import load_prompts  # noqa: E402
from inference_core.bench.speed import machine_info  # noqa: E402
from serving.pool import EnginePool  # noqa: E402
from ui.stack import STACK_OUTPUTS, climb  # noqa: E402

COLUMNS = ("rung", "decode tokens/s", "TTFT (ms)", "weights (MiB)", "quality delta (%)", "forwards")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", default="grounded-1,chat-med-1", help="benchmark prompt ids, comma-separated")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="auto", help="as the app's --dtype (auto: what the app picks here)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    rows = {row["id"]: row for row in load_prompts()}
    unknown = [pid for pid in args.prompts.split(",") if pid not in rows]
    if unknown:
        parser.error(f"unknown prompt id {unknown[0]!r}; one of {', '.join(rows)}")
    loaded = load_model("bundled", device="cpu", dtype=args.dtype)
    pool = EnginePool(loaded, max_seq_len=2048)
    out = {"machine": machine_info(loaded.device), "dtype": loaded.dtype_name, "new_tokens": args.new_tokens,
           "prompts": {}}
    for pid in args.prompts.split(","):
        row, table = rows[pid], None
        for frame in climb(pool, None, row["prompt"], row.get("system", ""), args.new_tokens, True):
            values = dict(zip(STACK_OUTPUTS, frame))
            if isinstance(values["table"], pd.DataFrame):
                table = values["table"]
        print(f"\n{pid} ({loaded.dtype_name}, {args.new_tokens} tokens): {values['status']}\n")
        print("| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS))
        for record in table[list(COLUMNS)].to_dict("records"):
            print("| " + " | ".join(str(record[column]) for column in COLUMNS) + " |")
        out["prompts"][pid] = table.drop(columns=["command"]).to_dict("records")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
