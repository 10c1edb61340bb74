"""The bundled model's roofline with the measured points of each rung of the Stack tab's ladder, for
docs/benchmarks.md: `python scripts/roofline_ladder.py [--new-tokens 64] [--no-compiled] [--json PATH]`.

Climbs the ladder as the Stack tab does (`ui.stack.climb`: each rung's request through the engine pool, greedy, the
same prompt and length), then measures the device's ceilings afresh (the cached ones may come from a busy moment) and
prints each rung's prefill and decode point (arithmetic intensity, achieved GFLOP/s and GB/s, the share of the roof
above it) as a markdown table, with the host's features.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from inference_core import load_model  # noqa: E402
from inference_core.bench.speed import machine_info  # noqa: E402
from inference_core.roofline import measure_ceilings  # noqa: E402
from serving.pool import EnginePool  # noqa: E402
from ui.stack import STACK_OUTPUTS, climb  # noqa: E402
from ui.setups import presets  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--no-compiled", action="store_true")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--json", help="write the points here")
    args = parser.parse_args()
    loaded = load_model("bundled", device="cpu", dtype=args.dtype)
    pool = EnginePool(loaded, max_seq_len=1024)
    row = next(row for row in presets().values() if row["kind"] == "grounded")
    frames = [dict(zip(STACK_OUTPUTS, frame)) for frame in climb(pool, None, row["prompt"], row.get("system", ""),
                                                                  args.new_tokens, not args.no_compiled)]
    print(frames[-1]["status"])
    figure = [frame["roofline"] for frame in frames if hasattr(frame["roofline"], "data")][-1]
    ceilings = measure_ceilings(loaded.device, loaded.dtype, refresh=True)  # measured now, on the quiet host
    points = []
    for trace in figure.data[1:]:
        rung, phase = trace.name.rsplit(" ", 1)
        intensity, gflops = trace.x[0], trace.y[0]
        roof = min(ceilings.bandwidth_bytes_per_s * intensity, ceilings.peak_flops_per_s) / 1e9
        points.append({"rung": rung, "phase": phase, "intensity": round(intensity, 3),
                       "gflops_per_s": round(gflops, 3), "gb_per_s": round(gflops / intensity, 3),
                       "roof_pct": round(100 * gflops / roof, 1)})
    report = {"model": loaded.name, "dtype": args.dtype, "new_tokens": args.new_tokens,
              "ceilings": {"bandwidth_gb_s": round(ceilings.bandwidth_bytes_per_s / 1e9, 2),
                           "peak_gflops": round(ceilings.peak_flops_per_s / 1e9, 1),
                           "ridge_flop_per_byte": round(ceilings.ridge, 2)},
              "machine": machine_info(loaded.device), "points": points}
    print(f"ceilings: {report['ceilings']}")
    print("| rung | phase | FLOP/byte | GFLOP/s | GB/s | % of its roof |\n|---|---|---|---|---|---|")
    for point in points:
        print(f"| {point['rung']} | {point['phase']} | {point['intensity']:.2f} | {point['gflops_per_s']:.2f} | "
              f"{point['gb_per_s']:.2f} | {point['roof_pct']:.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
