"""The soak's command line: its flags, the app's process around the run, and the report written to JSON and
docs/soak.md (see the package's docstring for what runs and what is checked)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

import server.soak
from inference_core.bench.speed import machine_info, write_report
from server.soak.report import build_report, markdown
from server.soak.run import soak, start_app
from server.soak.visitors import CHAT_MESSAGES, Clock


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(prog="python -m server.soak", description=server.soak.__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0, help="length of the soak phase")
    parser.add_argument("--url", help="a running app (default: start `python app.py` on loopback); its memory and "
                                      "log are then not checked")
    parser.add_argument("--racers", type=int, default=2)
    parser.add_argument("--chatters", type=int, default=1)
    parser.add_argument("--api-clients", type=int, default=3)
    parser.add_argument("--race-max-new-tokens", type=int, default=24)
    parser.add_argument("--chat-max-new-tokens", type=int, default=48)
    parser.add_argument("--chat-turns", type=int, default=3, help="turns per conversation before a new chat")
    parser.add_argument("--max-tokens", type=int, default=16, help="max_tokens of each API request")
    parser.add_argument("--disconnect-fraction", type=float, default=0.25)
    parser.add_argument("--bad-fraction", type=float, default=0.05)
    parser.add_argument("--dtype", default="float32", help="the app's --dtype")
    parser.add_argument("--rss-every", type=float, default=2.0, help="seconds between RSS samples")
    parser.add_argument("--rss-slope-limit", type=float, default=5.0, help="MiB per minute")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per API request")
    parser.add_argument("--settle", type=float, default=30.0, help="seconds to wait for the server to go idle")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_path", default="docs/soak.json")
    parser.add_argument("--markdown", default="docs/soak.md")
    args = parser.parse_args(argv)
    if min(args.racers, args.chatters, args.api_clients) < 0 or args.racers + args.chatters + args.api_clients < 1:
        parser.error("--racers, --chatters and --api-clients must be 0 or more, and at least one actor must run.")
    if args.chat_turns > len(CHAT_MESSAGES) or args.chat_turns < 1:
        parser.error(f"--chat-turns must be 1 to {len(CHAT_MESSAGES)}.")
    return args


def run_with_app(args, clock: Clock) -> tuple[dict, str | None]:
    """The soak against `--url`, or against `python app.py` started here (its log returned, its process ended)."""
    with tempfile.NamedTemporaryFile("w+", prefix="soak-app-", suffix=".log") as log:
        process, url = (None, args.url) if args.url else start_app(args, log)
        try:
            result = asyncio.run(soak(args, url, process.pid if process else None, clock))
        finally:
            if process is not None:
                process.terminate()
                process.wait(timeout=30)
        log.seek(0)
        return result, (log.read() if process is not None else None)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python -m server.soak " + " ".join(argv if argv is not None else sys.argv[1:])
    users = 2 * args.racers + args.chatters + args.api_clients  # requests in flight at most: a race has two lanes
    clock, started = Clock(), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    result, server_log = run_with_app(args, clock)
    try:
        report = build_report(result, args, users, server_log)
    except Exception:  # keep the run's raw actions: a soak takes minutes to repeat
        with tempfile.NamedTemporaryFile("w", prefix="soak-raw-", suffix=".json", delete=False) as raw:
            json.dump({**result, "actions": [asdict(a) for a in result["actions"]]}, raw, default=str)
        print(f"the report failed; the run's raw figures are in {raw.name}", file=sys.stderr)
        raise
    report.update(arguments=vars(args), started=started, machine={**machine_info(torch.device("cpu")),
                                                                  "cpu_count": os.cpu_count()})
    for row in report["kinds"]:
        print(row)
    print("RSS:", {k: v for k, v in report["rss"].items()})
    for problem in report["problems"]:
        print("problem:", problem)
    for name, passed in report["checks"].items():
        print(f"{'not run' if passed is None else 'PASS' if passed else 'FAIL'}  {name}")
    write_report(report, args.json_path)
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(markdown(report, command))
        print(f"wrote {args.markdown}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
