"""GuideLLM (the vLLM project's serving benchmark, 0.8.1) against the running app's OpenAI-compatible API, offline.

Start the app first (`python app.py`), then run `python scripts/guidellm_bench.py [--url http://127.0.0.1:7860]`.
The script
- checks `GET /health` and the served model (`GET /v1/models`);
- prepares GuideLLM's tokenizer ("processor") offline: tokenizer.json + tokenizer_config.json of the bundled model's
  converted directory (`inference_core.model.bundled.bundled_model_dir()`), copied to
  <cache root>/guidellm-processor. Without one, GuideLLM loads the served model's id from the Hub and fails offline.
  For another served model, pass `--processor DIR` (any directory `AutoTokenizer.from_pretrained` reads);
- sends one request shaped as GuideLLM sends them and prints the server's error if it refuses it, since GuideLLM only
  records "400 Bad Request" and exits 0 even when every request failed;
- runs GuideLLM twice on synthetic prompts (`--prompt-tokens`, `--output-tokens`), streamed: a synchronous profile
  (`--sync-requests`) and a concurrent one (`--concurrency` streams, `--concurrent-requests`), writing GuideLLM's
  JSON report and console log per profile into `--out` (docs/guidellm): synchronous.json/.log, concurrent.json/.log;
- prints a table read from those JSON files (requests, errors, TTFT p50, ITL p50, output tokens/s) and exits 1 if
  any request failed.

What GuideLLM 0.8.1 sends (`--endpoint`, default its own default /v1/chat/completions):
    POST /v1/chat/completions {"model": <id from /v1/models>, "stream": true,
        "stream_options": {"include_usage": true, "continuous_usage_stats": true},
        "max_completion_tokens": <output tokens>, "ignore_eos": true,
        "messages": [{"role": "user", "content": [{"type": "text", "text": <prompt>}]}]}
    POST /v1/completions {"model", "stream", "stream_options" as above, "max_tokens", "ignore_eos": true, "prompt"}
It counts output tokens from the last `usage` it sees in the stream (`completion_tokens`; without usage, the chunks
that carry text), TTFT at the first chunk with text, ITL as (last token - first token) / (output tokens - 1).
A server that refuses `ignore_eos` or `stream_options.continuous_usage_stats` fails every request (this app accepts
both, with vLLM's meaning: with `ignore_eos` every request decodes exactly `--output-tokens`).

With `--peer llama-server` the script starts the servers itself, one at a time, each with the whole machine: first
`python app.py` with no flags (what a newcomer runs; unless something already answers at `--url`, which is then
used as it is), measured once its serving engine's compiled steps are built (a first start builds them in a
background process and serves eager meanwhile: `GET /health`'s serving.build), then llama.cpp's `llama-server` (`inference_core.bench.llama_bench.llama_server_binary`: built once
from the same llama.cpp source and native flags as `bench --peer llama-bench`) on the same bundled Q4_1 GGUF, with as
many slots as the concurrent profile's streams and as many threads as the app's torch; both get the same profiles
with the same seed, and one table (and `--json PATH`: rows with `server`, `profile`, `requests`, `errors`,
`ttft_p50_ms`, `itl_p50_ms`, `output_tokens_per_s`) holds both.

Install GuideLLM in its own virtual environment, with a CPU build of torch first (GuideLLM requires torch, and plain
`torch` would pull a CUDA build of several GB; on this project's machines `pip install torch==2.13.0` takes a CPU
file from disk): about 1.5 GB and a minute:

    python -m venv /tmp/guidellm-venv
    /tmp/guidellm-venv/bin/pip install torch==2.13.0
    /tmp/guidellm-venv/bin/pip install guidellm==0.8.1
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BUNDLED_MODEL_IDS = ("SmolLM2-135M-Instruct", "bundled", "smollm2")
BUNDLED_CACHE_NAME = "SmolLM2-135M-Instruct.Q4_1"  # the converted directory's name under <cache root>/converted
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")  # all AutoTokenizer needs for this model
INSTALL = ("python -m venv /tmp/guidellm-venv && /tmp/guidellm-venv/bin/pip install torch==2.13.0 && "
           "/tmp/guidellm-venv/bin/pip install guidellm==0.8.1")


def get_json(url: str, timeout: float = 10) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


def served_model(url: str) -> str:
    try:
        health = get_json(f"{url}/health")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        sys.exit(f"the app does not answer GET {url}/health ({exc}); start it with `python app.py` first")
    models = [m["id"] for m in get_json(f"{url}/v1/models").get("data", [])]
    if not models:
        sys.exit(f"GET {url}/v1/models lists no model")
    print(f"server at {url}: {models[0]}" + (f" on {health['device']}" if "device" in health else ""))
    return models[0]


def bundled_dir() -> Path:
    """The bundled model's converted directory, from the project's own code; where that cannot be imported (a tree
    in the middle of an edit), the directory it would be under the cache root."""
    try:
        from inference_core.model.bundled import bundled_model_dir
        return bundled_model_dir()
    except Exception as exc:  # noqa: BLE001 - any failure falls back to the cache path
        root = os.environ.get("INFERENCE_CORE_CACHE")
        path = (Path(root) if root else Path.home() / ".cache" / "inference-playground") / "converted" \
            / BUNDLED_CACHE_NAME
        print(f"(inference_core.model.bundled unavailable: {exc.__class__.__name__}; using {path})")
        return path


def prepare_processor(model: str, given: str | None) -> Path:
    """A directory GuideLLM's `AutoTokenizer.from_pretrained` reads offline."""
    if given:
        return Path(given).resolve()
    if model not in BUNDLED_MODEL_IDS:
        sys.exit(f"the app serves {model}, not the bundled model: pass --processor DIR with its tokenizer files")
    source = bundled_dir()
    root = os.environ.get("INFERENCE_CORE_CACHE")
    target = (Path(root) if root else Path.home() / ".cache" / "inference-playground") / "guidellm-processor"
    target.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if not (source / name).is_file():
            sys.exit(f"{source / name} is missing; start the app once so that it converts the bundled model")
        if not (target / name).is_file() or (target / name).read_bytes() != (source / name).read_bytes():
            shutil.copyfile(source / name, target / name)
    return target


def guidellm_body(endpoint: str, model: str, max_tokens: int, text: str) -> dict:
    """One streamed request exactly as GuideLLM 0.8.1 builds it."""
    body: dict = {"model": model, "stream": True,
                  "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if endpoint == "/v1/chat/completions":
        body["max_completion_tokens"] = max_tokens
        body["ignore_eos"] = True
        body["messages"] = [{"role": "user", "content": [{"type": "text", "text": text}]}]
    else:
        body["max_tokens"] = max_tokens
        body["ignore_eos"] = True
        body["prompt"] = text
    return body


def preflight(url: str, endpoint: str, model: str) -> None:
    """Send one GuideLLM-shaped request; on a refusal print the server's message (GuideLLM keeps only the status)."""
    body = guidellm_body(endpoint, model, 2, "Hello")
    request = urllib.request.Request(f"{url}{endpoint}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            response.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")
        print(f"the app refuses GuideLLM's request shape: {exc.code} {detail}\n  body: {json.dumps(body)}")
        sys.exit(2)


def run_profile(args, name: str, profile: str, requests: int, processor: Path, seed: int, out: Path) -> Path:
    backend = {"kind": "openai_http", "target": args.url, "request_format": args.endpoint}
    json_path = out / f"{name}.json"
    if args.server != "playground":  # the peer's reports beside the app's, not over them
        json_path = out / f"{args.server}-{name}.json"
    command = [args.guidellm, "run",
               "--backend", json.dumps(backend),
               "--profile", profile,
               "--constraint", f"kind=max_requests,count={requests}",
               "--tokenizer", f"kind=huggingface_auto,model={processor}",
               "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
               "--seed", f"kind=static,value={seed}",
               "--output", f"kind=json,path={json_path}",
               "--disable-progress"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "GUIDELLM__DEFAULT_RESULTS_DIR": str(out)}
    print(f"{name}: {profile}, {requests} requests ...", flush=True)
    started = time.monotonic()
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
    log = json_path.with_suffix(".log")
    log.write_text(result.stdout + result.stderr)
    if result.returncode != 0 or not json_path.is_file():
        tail = "\n".join((result.stdout + result.stderr).splitlines()[-30:])
        sys.exit(f"guidellm failed ({result.returncode}) for {name}; the end of {log}:\n{tail}")
    print(f"  done in {time.monotonic() - started:.0f} s -> {json_path}")
    return json_path


def summary_row(name: str, path: Path) -> dict:
    bench = json.loads(path.read_text())["benchmarks"][0]
    metrics = bench["metrics"]
    totals = metrics["request_totals"]

    def median(key: str) -> float | None:
        dist = metrics[key]["successful"]
        return dist["median"] if dist and dist.get("count") else None

    return {"profile": name, "strategy": bench["config"]["strategy"]["type_"], "requests": totals["total"],
            "errors": totals["errored"], "ttft_p50_ms": median("time_to_first_token_ms"),
            "itl_p50_ms": median("inter_token_latency_ms"),
            # GuideLLM's server throughput: output tokens of successful requests per second of the benchmark
            "output_tokens_per_s": metrics["output_tokens_per_second"]["successful"]["mean"],
            "output_tokens": metrics["output_token_count"]["successful"]["total_sum"]}


def print_table(rows: list[dict]) -> None:
    def fmt(value, digits=1):
        return "-" if value is None else f"{value:.{digits}f}"

    header = ("server", "profile", "requests", "errors", "TTFT p50 ms", "ITL p50 ms", "output tok/s")
    lines = [header] + [(r["server"], r["profile"], str(r["requests"]), str(r["errors"]), fmt(r["ttft_p50_ms"]),
                         fmt(r["itl_p50_ms"]), fmt(r["output_tokens_per_s"], 2)) for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for i, line in enumerate(lines):
        print("  ".join(cell.ljust(w) if j < 2 else cell.rjust(w) for j, (cell, w) in enumerate(zip(line, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:7860", help="the running app (default %(default)s)")
    parser.add_argument("--guidellm", default="/tmp/guidellm-venv/bin/guidellm", help="GuideLLM's executable")
    parser.add_argument("--out", default=str(ROOT / "docs" / "guidellm"), help="where the JSON reports go")
    parser.add_argument("--endpoint", default="/v1/chat/completions",
                        choices=("/v1/chat/completions", "/v1/completions"),
                        help="GuideLLM's request format (chat adds the chat template's tokens to each prompt)")
    parser.add_argument("--processor", help="tokenizer directory (default: prepared from the bundled model)")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--sync-requests", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=2, help="streams of the concurrent profile")
    parser.add_argument("--concurrent-requests", type=int, default=8)
    parser.add_argument("--seed", type=int, default=None,
                        help="synthetic prompts' seed (default: from the clock, so that a rerun does not hit the "
                             "app's prefix cache with the same prompts)")
    parser.add_argument("--no-preflight", action="store_true", help="skip the one-request check of the body shape")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per GuideLLM run")
    parser.add_argument("--peer", choices=("llama-server",),
                        help="also llama.cpp's llama-server on the same GGUF; the script then starts both servers "
                             "itself, one after the other")
    parser.add_argument("--json", dest="json_path", help="write the table's rows here")
    args = parser.parse_args(argv)
    args.url = args.url.rstrip("/").removesuffix("/v1")

    if not Path(args.guidellm).is_file():
        sys.exit(f"{args.guidellm} not found; install GuideLLM in its own venv: {INSTALL}")
    seed = args.seed if args.seed is not None else int(time.time()) % 1_000_000
    rows = []
    if args.peer is None:
        args.server = "playground"
        rows += run_server(args, seed)
    else:
        with started(app_command(args), args.url, "python app.py", keep_running=answers(args.url)):
            args.server = "playground"
            rows += run_server(args, seed)
        port = free_port()
        peer_url = f"http://127.0.0.1:{port}"
        with started(llama_server_command(args, port), peer_url, "llama-server"):
            args.url, args.server = peer_url, "llama-server"
            rows += run_server(args, seed)
    print()
    print_table(rows)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"seed": seed, "prompt_tokens": args.prompt_tokens,
                                                    "output_tokens": args.output_tokens, "rows": rows}, indent=2))
        print(f"wrote {args.json_path}")
    errors = sum(r["errors"] for r in rows)
    if errors:
        print(f"\n{errors} request(s) failed: GuideLLM records only the HTTP status; see the preflight above or "
              f"send one of its bodies by hand")
        return 1
    return 0


def run_server(args, seed: int) -> list[dict]:
    """Both profiles against the server at `args.url` (named `args.server` in the rows)."""
    model = served_model(args.url)
    processor = prepare_processor(model, args.processor)
    print(f"processor (tokenizer): {processor}")
    if not args.no_preflight:
        preflight(args.url, args.endpoint, model)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(f"{args.server}: seed {seed}, {args.endpoint}, prompt {args.prompt_tokens} tokens, output "
          f"{args.output_tokens} tokens")
    profiles = [("synchronous", "kind=synchronous", args.sync_requests),
                ("concurrent", f"kind=concurrent,streams={args.concurrency}", args.concurrent_requests)]
    rows = []
    for index, (name, profile, requests) in enumerate(profiles):
        path = run_profile(args, name, profile, requests, processor, seed + index, out)
        rows.append({"server": args.server,
                     **summary_row(name if name != "concurrent" else f"concurrent@{args.concurrency}", path)})
    return rows


def answers(url: str) -> bool:
    try:
        get_json(f"{url}/health", timeout=2)
        return True
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_for_serving_build(url: str, name: str, process: subprocess.Popen, timeout_s: float = 3600) -> None:
    """Until the app's serving engine has its compiled steps (`GET /health`'s serving.build no longer "building":
    on a first start `python app.py` builds them in a background process, minutes each on a CPU, serving eager
    meanwhile), so the profiles measure what the app serves once started, not its build."""
    started, last = time.monotonic(), 0.0
    while (get_json(f"{url}/health").get("serving") or {}).get("build") == "building":
        if process.poll() is not None or time.monotonic() - started > timeout_s:
            sys.exit(f"{name}'s compiled steps were not built within {timeout_s:.0f} s")
        if time.monotonic() - last > 60:
            print(f"{name}: waiting for its compiled steps to be built ({(time.monotonic() - started) / 60:.0f} "
                  "min so far)", flush=True)
            last = time.monotonic()
        time.sleep(5)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def app_command(args) -> list[str]:
    """`python app.py` with no flags (its port from the environment where --url names another)."""
    return [sys.executable, str(ROOT / "app.py")]


def llama_server_command(args, port: int) -> list[str]:
    """llama.cpp's server on the bundled GGUF: a slot per concurrent stream, each with the context a request needs,
    the app's thread count, the model named as the app names it (GuideLLM's processor is found by that name)."""
    from inference_core.bench.llama_bench import llama_server_binary
    from inference_core.model.bundled import bundled_gguf_path
    import torch

    threads = str(torch.get_num_threads())
    slot_context = 4 * (args.prompt_tokens + args.output_tokens) + 256  # the chat template's tokens, with room
    return [str(llama_server_binary()), "-m", str(bundled_gguf_path()), "--host", "127.0.0.1", "--port", str(port),
            "-t", threads, "-tb", threads, "--parallel", str(args.concurrency),
            "-c", str(slot_context * args.concurrency), "--alias", BUNDLED_MODEL_IDS[0]]


@contextlib.contextmanager
def started(command: list[str], url: str, name: str, keep_running: bool = False):
    """Run `command` (a server) until the block ends, once it answers GET /health; where `keep_running` (something
    already answers at `url`), use that one and start nothing."""
    if keep_running:
        print(f"{name}: using the server that already answers at {url}")
        yield
        return
    port = urllib.parse.urlparse(url).port or 80
    env = {**os.environ, "PLAYGROUND_PORT": str(port)}
    log = Path(tempfile.gettempdir()) / f"guidellm-bench-{name.split()[-1].replace('.', '-')}.log"
    print(f"{name}: starting ({' '.join(command)}; its output in {log})", flush=True)
    with open(log, "w") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 900
        while not answers(url):
            if process.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"{name} did not answer at {url}; the end of {log}:\n{log.read_text()[-2000:]}")
            time.sleep(1)
        wait_for_serving_build(url, name, process)
        yield
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()


if __name__ == "__main__":
    sys.exit(main())
