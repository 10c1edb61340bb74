"""`scripts/guidellm_bench.py --peer llama-server`: the script starts the app and then llama.cpp's server, one at a
time, runs the same GuideLLM profiles against each with the same seed, and writes both servers' rows in one table and
JSON. Driven here with a fake GuideLLM (it writes a report in GuideLLM's shape) and a fake server (it answers the
health, model and preflight requests), so what is tested is the script's own work: which server runs when, that each
is stopped before the next starts, and the rows."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

FAKE_SERVER = """
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

class Handler(BaseHTTPRequestHandler):
    def _send(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send({"status": "ok"} if self.path == "/health" else {"data": [{"id": "SmolLM2-135M-Instruct"}]})

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self._send({"choices": []})

    def log_message(self, *args):
        pass

HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""

FAKE_GUIDELLM = """
import json, sys, urllib.request
args = dict(zip(sys.argv[2::2], sys.argv[3::2]))
target = json.loads(args["--backend"])["target"]
urllib.request.urlopen(target + "/health").read()  # the server under test answers while it is measured
path = args["--output"].split("path=", 1)[1]
streams = 2 if "streams=2" in args["--profile"] else 1
count = int(args["--constraint"].rsplit("=", 1)[1])
def dist(median):
    return {"successful": {"median": median, "count": count, "mean": median, "total_sum": median * count}}
report = {"benchmarks": [{"config": {"strategy": {"type_": args["--profile"].split(",")[0].split("=")[1]}},
          "metrics": {"request_totals": {"total": count, "errored": 0},
                      "time_to_first_token_ms": dist(100.0 * streams), "inter_token_latency_ms": dist(20.0),
                      "output_tokens_per_second": dist(50.0 * streams), "output_token_count": dist(32)}}]}
open(path, "w").write(json.dumps(report))
"""


def load_script():
    spec = importlib.util.spec_from_file_location("guidellm_bench", ROOT / "scripts" / "guidellm_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def script(monkeypatch, tmp_path):
    module = load_script()
    server = tmp_path / "server.py"
    server.write_text(FAKE_SERVER)
    started = []

    def fake(name):
        def command(args, port=None):
            started.append(name)
            port = port or int(args.url.rsplit(":", 1)[1])
            return [sys.executable, str(server), str(port)]
        return command

    monkeypatch.setattr(module, "app_command", fake("app"))
    monkeypatch.setattr(module, "llama_server_command", fake("llama-server"))
    monkeypatch.setattr(module, "prepare_processor", lambda model, given: tmp_path)
    module.started_servers = started
    return module


def test_both_servers_run_the_same_profiles_one_after_the_other(script, tmp_path):
    guidellm = tmp_path / "guidellm"
    guidellm.write_text(f"#!{sys.executable}\n{FAKE_GUIDELLM}")
    guidellm.chmod(0o755)
    out, path = tmp_path / "out", tmp_path / "rows.json"
    url = f"http://127.0.0.1:{script.free_port()}"
    assert script.main(["--peer", "llama-server", "--url", url, "--guidellm", str(guidellm), "--out", str(out),
                        "--seed", "7", "--json", str(path)]) == 0
    assert script.started_servers == ["app", "llama-server"]
    assert not script.answers(url)  # the app was stopped once its profiles ran
    report = json.loads(path.read_text())
    assert report["seed"] == 7
    assert [(row["server"], row["profile"]) for row in report["rows"]] == [
        ("playground", "synchronous"), ("playground", "concurrent@2"),
        ("llama-server", "synchronous"), ("llama-server", "concurrent@2")]
    concurrent = report["rows"][3]
    assert concurrent["requests"] == 8 and concurrent["errors"] == 0 and concurrent["output_tokens_per_s"] == 100.0
    assert concurrent["ttft_p50_ms"] == 200.0 and concurrent["itl_p50_ms"] == 20.0
    # The peer's reports lie beside the app's, not over them.
    assert sorted(file.name for file in out.glob("*.json")) == [
        "concurrent.json", "llama-server-concurrent.json", "llama-server-synchronous.json", "synchronous.json"]


def test_the_server_command_gives_each_stream_a_slot(monkeypatch, tmp_path):
    import inference_core.bench.llama_bench as llama_bench

    monkeypatch.setattr(llama_bench, "llama_server_binary", lambda build=True: tmp_path / "llama-server")
    script = load_script()
    args = script.argparse.Namespace(prompt_tokens=64, output_tokens=32, concurrency=4)
    command = script.llama_server_command(args, 9001)
    assert command[0] == str(tmp_path / "llama-server") and command[command.index("--parallel") + 1] == "4"
    assert command[command.index("--port") + 1] == "9001" and command[command.index("--alias") + 1] == \
        "SmolLM2-135M-Instruct"
    assert int(command[command.index("-c") + 1]) == 4 * (4 * 96 + 256)  # four slots, each with room for a request
